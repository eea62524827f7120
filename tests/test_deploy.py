"""deploy/: the Serve config, the KubeRay RayService and the Dockerfile are valid for Ray Serve and
for service.config.Settings, describe the same application, and agree with each other.

Nothing here starts Ray: Serve applications are built lazily (bind + build_app only record
options), so the real builder is run on each file's args.

Each check collects problems as strings; the tests assert there are none, and the negative tests
feed the same checks a broken copy to show they catch it.
"""

from __future__ import annotations

import copy
import importlib
import math
import re
import shlex
import typing
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.build_app import build_app
from ray.serve.config import AutoscalingConfig, ProxyLocation
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from blockspec.service import app as service_app
from blockspec.service.config import Settings
from blockspec.service.ports import SERVE_EXCLUSIVE_ENV

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SERVE_CONFIG = DEPLOY / "serve_config.yaml"
RAYSERVICE = DEPLOY / "rayservice.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
APP_NAME = "blockspec"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's built-in resource of the head node
CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
IMAGE = "blockspec:latest"


pytestmark = pytest.mark.usefixtures("clean_env")


# ---- loading ---------------------------------------------------------------------------------


def load_serve_config() -> dict[str, Any]:
    return yaml.safe_load(SERVE_CONFIG.read_text())


def load_rayservice() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(RAYSERVICE.read_text()) if doc]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in {RAYSERVICE.name}, found {len(found)}"
    return found[0]


def rayservice_serve_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    embedded = only(docs, "RayService")["spec"]["serveConfigV2"]
    assert isinstance(embedded, str), "serveConfigV2 must be a YAML string"
    return yaml.safe_load(embedded)


CONFIGS = {
    "serve_config": load_serve_config,
    "rayservice": lambda: rayservice_serve_config(load_rayservice()),
}


def the_app(cfg: dict[str, Any]) -> dict[str, Any]:
    apps = cfg["applications"]
    assert [app.get("name") for app in apps] == [APP_NAME]
    return apps[0]


# ---- checks ----------------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def unknown_keys(model: type[BaseModel], data: Any, where: str = "") -> list[str]:
    """Keys of `data` that are no field of `model`, recursively through nested models.

    Needed on top of model_validate for Ray's schemas: they take `autoscaling_config` as a plain
    dict and ignore unknown keys, so a misspelled key there would silently fall back to its
    default. (Settings and its nested models forbid unknown keys themselves.)"""
    if not isinstance(data, dict):
        return []
    found = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            found.append(f"{where}{key}")
            continue
        subs = _models_in(field.annotation)
        assert len(subs) <= 1, f"{model.__name__}.{key}: ambiguous nested models {subs}"
        for sub in subs:
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                index = f"[{i}]" if isinstance(value, list) else ""
                found += unknown_keys(sub, item, f"{where}{key}{index}.")
    return found


def config_problems(cfg: dict[str, Any]) -> list[str]:
    """The whole Serve config: Ray's schema, no unknown keys, then each application."""
    problems = [f"unknown key {key}" for key in unknown_keys(ServeDeploySchema, cfg)]
    try:
        schema = ServeDeploySchema.model_validate(cfg)
    except ValidationError as e:
        return [*problems, f"Ray Serve schema: {e}"]
    if schema.proxy_location != ProxyLocation.Disabled:
        problems.append(f"proxy_location {schema.proxy_location}: the gateway serves gRPC itself")
    for app in cfg["applications"]:
        problems += app_problems(app)
    return problems


def app_problems(app: dict[str, Any]) -> list[str]:
    """One application: schema, builder, args as Settings, deployment overrides vs the code."""
    try:
        schema = ServeApplicationSchema.model_validate(app)
    except ValidationError as e:
        return [f"Ray Serve application schema: {e}"]
    problems = []
    if schema.route_prefix is not None:
        problems.append(f"route_prefix {schema.route_prefix!r}: there is no HTTP proxy")
    module, _, attr = schema.import_path.partition(":")
    builder = getattr(importlib.import_module(module), attr, None)
    if builder is not service_app.app_builder:
        return [*problems, f"import_path {schema.import_path} is not service.app.app_builder"]

    args = schema.args
    try:
        settings = Settings.model_validate(args)
    except ValidationError as e:
        return [*problems, f"args are not Settings: {e}"]
    if schema.name != settings.app_name:
        problems.append(f"application {schema.name!r} but args.app_name {settings.app_name!r}")

    # What Serve does with the file: call the builder with args, build the application.
    application = call_user_app_builder_with_args_if_necessary(builder, args)
    built = build_app(application, name=schema.name)
    in_code = {deployment.name: deployment for deployment in built.deployments}
    for override in app.get("deployments", []):
        name = override["name"]
        options = {k: v for k, v in override.items() if k != "name"}
        if name not in in_code:
            problems.append(f"deployments: {name!r} is not a deployment of the app ({in_code})")
            continue
        code = in_code[name]
        try:
            # Serve's own checks (ray_actor_options keys and values). On a copy: Serve fills
            # in its defaults (num_cpus=1) in place.
            code.options(**copy.deepcopy(options))
        except Exception as e:
            problems.append(f"deployments[{name}]: Serve rejects the options: {e}")
        # Serve replaces ray_actor_options wholesale: the file must repeat what the code sets.
        if "ray_actor_options" in options:
            for key, value in (code.ray_actor_options or {}).items():
                got = options["ray_actor_options"].get(key)
                if got != value:
                    problems.append(
                        f"deployments[{name}].ray_actor_options.{key} = {got!r}, "
                        f"the code (from args) sets {value!r}"
                    )
        if name == "Replica" and "autoscaling_config" in options:
            problems += autoscaling_problems(options["autoscaling_config"], settings)
    return problems


def autoscaling_problems(override: dict[str, Any], settings: Settings) -> list[str]:
    args = settings.autoscaling
    problems = [
        f"deployments[Replica].autoscaling_config.{key} = {override.get(key)!r}, "
        f"args.autoscaling.{key} = {getattr(args, key)!r}"
        for key in ("min_replicas", "max_replicas", "target_ongoing_requests")
        if override.get(key) != getattr(args, key)
    ]
    try:
        ours = AutoscalingConfig(**override)
    except Exception as e:
        return [*problems, f"deployments[Replica].autoscaling_config: {e}"]
    if ours != AutoscalingConfig(**args.serve_config()):
        problems.append(
            "deployments[Replica].autoscaling_config differs from args.autoscaling: "
            f"{override} vs {args.serve_config()}"
        )
    return problems


def cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def port_name_problems(name: str) -> list[str]:
    if len(name) <= 15 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name):
        return []
    return [f"port name {name!r}: Kubernetes wants at most 15 of [a-z0-9-]"]


def cluster_problems(docs: list[dict[str, Any]]) -> list[str]:
    """The Ray cluster and Service of the manifest fit the application they carry."""
    rayservice, service = only(docs, "RayService"), only(docs, "Service")
    if rayservice.get("apiVersion") != "ray.io/v1":
        return [f"RayService apiVersion {rayservice.get('apiVersion')!r}, expected ray.io/v1"]
    app = the_app(rayservice_serve_config(docs))
    settings = Settings.model_validate(app["args"])
    overrides = {d["name"]: d for d in app.get("deployments", [])}
    cluster = rayservice["spec"]["rayClusterConfig"]
    head, workers = cluster["headGroupSpec"], cluster.get("workerGroupSpecs", [])
    problems = []
    if not workers:
        problems.append("no worker group: replicas need worker nodes (the head has no CPUs)")

    for group in [head, *workers]:
        group_name = group.get("groupName", "head")
        for container in group["template"]["spec"]["containers"][:1]:  # the Ray container
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if env.get(CLUSTER_ENV) != "1":
                problems.append(f"{group_name}: {CLUSTER_ENV} must be '1' (Ray on the pod IP)")
            if container.get("image") != IMAGE:
                problems.append(f"{group_name}: image {container.get('image')!r}, not {IMAGE}")
            for port in container.get("ports", []):
                problems += port_name_problems(port["name"])

    # The Service reaches the gateway: it selects the head pod, which the gateway is pinned to.
    head_template = head["template"]
    head_labels = {**head_template["metadata"].get("labels", {}), "ray.io/node-type": "head"}
    selector = service["spec"]["selector"]
    if selector.get("ray.io/node-type") != "head" or any(
        head_labels.get(k) != v for k, v in selector.items()
    ):
        problems.append(f"Service selector {selector} does not select the head pod {head_labels}")
    gateway = overrides.get("Gateway", {}).get("ray_actor_options", {})
    if gateway.get("resources", {}).get(HEAD_RESOURCE, 0) <= 0:
        problems.append(f"Gateway is not pinned to the head ({HEAD_RESOURCE}), the Service is")
    head_ports = {
        p["name"]: p["containerPort"] for p in head_template["spec"]["containers"][0]["ports"]
    }
    wanted = {settings.port, settings.metrics_port}
    if {p["port"] for p in service["spec"]["ports"]} != wanted:
        problems.append(f"Service ports {service['spec']['ports']} are not {sorted(wanted)}")
    for p in service["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        if isinstance(target, str):
            container_port = head_ports.get(target)
        else:
            container_port = target if target in head_ports.values() else None
        if container_port != p["port"]:
            problems.append(f"Service port {p['port']} -> {target!r}: head port {container_port}")
    if head["rayStartParams"].get("num-cpus") == "0":
        gateway_cpus = gateway.get("num_cpus", 1)  # Serve's default is 1 CPU
        if gateway_cpus != 0:
            problems.append(f"the head has 0 CPUs, the Gateway asks for {gateway_cpus}")

    # Enough worker pods for max_replicas, a replica fitting in one pod (its target shards are
    # one STRICT_PACK placement group, i.e. one node).
    r = settings.replica
    need_cpu = (
        r.coordinator.num_cpus + r.draft.num_cpus + r.tensor_parallel * r.target_shard.num_cpus
    )
    need_gpu = (
        r.coordinator.num_gpus + r.draft.num_gpus + r.tensor_parallel * r.target_shard.num_gpus
    )
    capacity = 0
    for group in workers:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        pod_cpu = cpus(group["rayStartParams"].get("num-cpus", limits["cpu"]))
        pod_gpu = float(group["rayStartParams"].get("num-gpus", limits.get("nvidia.com/gpu", 0)))
        per_pod = math.floor(pod_cpu / need_cpu) if need_cpu else math.inf
        if need_gpu:
            per_pod = min(per_pod, math.floor(pod_gpu / need_gpu))
        capacity += per_pod * group["maxReplicas"]
    if capacity < settings.autoscaling.max_replicas:
        problems.append(
            f"worker groups hold {capacity} replicas ({need_cpu} CPUs, {need_gpu} GPUs each), "
            f"autoscaling.max_replicas is {settings.autoscaling.max_replicas}"
        )
    return problems


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (parts[0].upper(), parts[1] if len(parts) > 1 else "")
        for parts in (line.strip().split(None, 1) for line in joined.splitlines())
        if parts
    ]


def dockerfile_problems(text: str, settings: Settings) -> list[str]:
    instructions = dockerfile_instructions(text)
    exposed = {
        int(port.split("/")[0])
        for name, rest in instructions
        if name == "EXPOSE"
        for port in rest.split()
    }
    problems = []
    # The image's own command (`blockspec serve`, default Settings) also opens the HTTP API;
    # the configs' ports must be among the exposed ones too (KubeRay replaces the command).
    default = Settings()
    wanted = {default.port, default.metrics_port, default.http_port}
    if exposed != wanted:
        problems.append(f"EXPOSE {sorted(exposed)}, `blockspec serve` opens {sorted(wanted)}")
    if not {settings.port, settings.metrics_port} <= exposed:
        problems.append(f"EXPOSE {sorted(exposed)} lacks the configs' gRPC or metrics port")
    env = dict(
        token.split("=", 1)
        for name, rest in instructions
        if name == "ENV"
        for token in shlex.split(rest)
        if "=" in token
    )
    for field in ("draft_dir", "target_dir"):
        key = f"BLOCKSPEC_REPLICA__{field.upper()}"
        if env.get(key) != getattr(settings.replica, field):
            problems.append(
                f"{key}={env.get(key)!r}, args.replica.{field} is "
                f"{getattr(settings.replica, field)!r}"
            )
    for key, value in SERVE_EXCLUSIVE_ENV.items():  # Serve's proxy keeps its port to itself
        if env.get(key) != value:
            problems.append(f"ENV {key}={env.get(key)!r}, service/ports.py wants {value!r}")
    return problems


# ---- the files -------------------------------------------------------------------------------


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray or Serve fails the test (building an application must not)."""

    def no(*args, **kwargs):
        raise AssertionError("building the application must not start Ray or Serve")

    for owner, name in ((ray, "init"), (serve, "start"), (serve, "run")):
        monkeypatch.setattr(owner, name, no)


@pytest.mark.parametrize("source", sorted(CONFIGS))
def test_serve_config_is_valid(source, no_ray):
    cfg = CONFIGS[source]()
    app = the_app(cfg)
    assert app["import_path"] == "blockspec.service.app:app_builder"
    assert config_problems(cfg) == []  # runs the builder


@pytest.mark.parametrize("source", sorted(CONFIGS))
def test_args_are_for_a_cluster(source):
    settings = Settings.model_validate(the_app(CONFIGS[source]())["args"])
    assert settings.host == "0.0.0.0"  # reachable from other pods/nodes
    assert (settings.port, settings.metrics_port) == (50051, 9464)
    assert settings.autoscaling.min_replicas >= 1
    assert settings.autoscaling.max_replicas > settings.autoscaling.min_replicas


def test_both_files_carry_the_same_application():
    ours, kuberay = (the_app(CONFIGS[source]()) for source in ("serve_config", "rayservice"))
    assert kuberay["args"] == ours["args"]
    for key in ("import_path", "route_prefix", "deployments"):
        assert kuberay.get(key) == ours.get(key), key
    assert (
        load_serve_config()["proxy_location"]
        == rayservice_serve_config(load_rayservice())["proxy_location"]
    )


def test_rayservice_cluster_fits_the_application():
    assert cluster_problems(load_rayservice()) == []


def test_dockerfile_matches_the_configs():
    settings = Settings.model_validate(the_app(load_serve_config())["args"])
    assert dockerfile_problems(DOCKERFILE.read_text(), settings) == []


def test_dockerfile_command_is_a_valid_cli_call(capsys):
    from blockspec.service.cli import main

    cmd = [rest for name, rest in dockerfile_instructions(DOCKERFILE.read_text()) if name == "CMD"]
    assert len(cmd) == 1
    argv = yaml.safe_load(cmd[0])  # exec form: a JSON array
    assert argv[:2] == ["blockspec", "serve"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    for flag in (arg for arg in argv[2:] if arg.startswith("--")):
        assert flag in usage, f"`blockspec serve` has no {flag}"


def test_build_returns_an_application_without_starting_ray(no_ray):
    settings = Settings(autoscaling={"min_replicas": 1, "max_replicas": 3}, port=0)
    app = service_app.build(settings)
    assert isinstance(app, serve.Application)
    built = build_app(app, name=APP_NAME)
    assert built.ingress_deployment_name == "Gateway"
    replica = next(d for d in built.deployments if d.name == "Replica")
    coordinator = settings.replica.coordinator
    assert replica.ray_actor_options == {
        "num_cpus": coordinator.num_cpus,
        "num_gpus": coordinator.num_gpus,
    }


# ---- the checks catch mistakes ----------------------------------------------------------------


def broken(edit) -> dict[str, Any]:
    cfg = copy.deepcopy(load_serve_config())
    edit(the_app(cfg))
    return cfg


def test_misspelled_args_key_is_rejected():
    def typo(app):
        app["args"]["metrics_prot"] = app["args"].pop("metrics_port")

    cfg = broken(typo)
    with pytest.raises(ValidationError, match="metrics_prot"):
        Settings.model_validate(the_app(cfg)["args"])
    with pytest.raises(ValidationError):  # what Serve runs
        service_app.app_builder(the_app(cfg)["args"])
    assert any("metrics_prot" in p for p in config_problems(cfg))


def test_misspelled_nested_args_key_is_caught():
    # Settings alone accepts this (its nested models ignore unknown keys): unknown_keys catches it.
    def typo(app):
        app["args"]["replica"]["max_batchs"] = app["args"]["replica"].pop("max_batch")
        app["args"]["autoscaling"]["max_replica"] = 9

    problems = config_problems(broken(typo))
    assert any("replica.max_batchs" in p for p in problems)
    assert any("autoscaling.max_replica" in p for p in problems)


def test_override_disagreeing_with_args_is_caught():
    def more_replicas(app):
        app["deployments"][0]["autoscaling_config"]["max_replicas"] = 5

    def more_cpus(app):
        app["deployments"][0]["ray_actor_options"]["num_cpus"] = 3

    def misspelled(app):
        app["deployments"][0]["autoscaling_config"]["target_ongoing_request"] = 2

    def dropped_option(app):
        app["deployments"][0]["ray_actor_options"] = {"num_gpus": 0}

    for edit, expected in [
        (more_replicas, "max_replicas"),
        (more_cpus, "num_cpus"),
        (misspelled, "target_ongoing_request"),
        (dropped_option, "num_cpus"),
    ]:
        problems = config_problems(broken(edit))
        assert any(expected in p for p in problems), (edit.__name__, problems)


def test_bad_serve_options_are_caught():
    def bad(app):
        app["deployments"][1]["ray_actor_options"]["num_cpu"] = 1
        app["import_path"] = "blockspec.service.app:build"
        app["route_prefix"] = "/"

    problems = config_problems(broken(bad))
    assert any("num_cpu" in p for p in problems)
    assert any("import_path" in p for p in problems)
    assert any("route_prefix" in p for p in problems)
    cfg = load_serve_config()
    cfg["proxy_location"] = "Everywhere"
    assert any("schema" in p for p in config_problems(cfg))


def test_cluster_mismatches_are_caught():
    def edited(edit) -> list[str]:
        docs = copy.deepcopy(load_rayservice())
        edit(docs)
        return cluster_problems(docs)

    def small_workers(docs):
        group = only(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
        group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "4"

    def loopback(docs):
        head = only(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
        head["template"]["spec"]["containers"][0]["env"] = []

    def wrong_port(docs):
        only(docs, "Service")["spec"]["ports"][0]["port"] = 8000

    for edit, expected in [
        (small_workers, "worker groups hold 0"),
        (loopback, CLUSTER_ENV),
        (wrong_port, "Service port"),
    ]:
        assert any(expected in p for p in edited(edit)), edit.__name__
    settings = Settings.model_validate(the_app(load_serve_config())["args"])
    assert dockerfile_problems("FROM x\nEXPOSE 50051\n", settings)
    assert dockerfile_problems("FROM x\nEXPOSE 50051 9464\n", settings)  # HTTP left out
