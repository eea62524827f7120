"""Service configuration: one pydantic model, read from env vars and an optional YAML/TOML file.

Precedence: init arguments (the CLI) > environment (``BLOCKSPEC_...``, nested with ``__``, e.g.
``BLOCKSPEC_REPLICA__MAX_BATCH=16``) > the file named by ``BLOCKSPEC_CONFIG`` > defaults. The
defaults run the default model pair on this machine with no external services: a local Ray
cluster on 127.0.0.1, the embedded session store, one replica.

``ReplicaConfig`` is what a Serve replica receives (``deploy/serve_config.yaml`` gives the same
fields as the application's ``args``), so the same code runs on a 2-core machine and on a GPU
cluster by changing resources, device and tensor parallelism only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from blockspec.service.policy import DEFAULT_ARMS, PLAIN, Arm
from blockspec.verification import VERIFIERS
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, ROUNDED

CONFIG_ENV = "BLOCKSPEC_CONFIG"
# A compiled replica's step timeout unless set: a step that compiles a new kind of call takes
# 1–2 minutes a model for the default pair on 2 cores, and the draft and the target may each
# compile in one step (docs/benchmarks.md, "The service, compiled").
COMPILED_STEP_TIMEOUT_S = 900.0


class Resources(BaseModel):
    """Ray resources of one actor. Logical CPUs: Ray schedules by them, the OS does not."""

    model_config = ConfigDict(extra="forbid")  # a typo in a config file is an error

    num_cpus: float = Field(0.25, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # Custom Ray resources the actor needs: places it on the nodes that offer them (start a
    # node with `ray start --resources='{"draft_node": 1}'`, then ask {"draft_node": 0.01}).
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [name for name, amount in value.items() if amount <= 0]
        if bad:
            raise ValueError(f"resources: amounts must be > 0 ({', '.join(bad)})")
        return value


class ReplicaConfig(BaseModel):
    """One replica: a coordinator (the Serve replica) with its draft actor and target shards."""

    model_config = ConfigDict(extra="forbid")  # a typo in a config file is an error

    # The default pair (SmolLM2-135M-Instruct and its trained draft), written by setup.sh into
    # BLOCKSPEC_MODEL_CACHE (~/.cache/blockspec); any compatible Llama-family pair works.
    draft_dir: str = str(DEFAULT_DRAFT)
    target_dir: str = str(DEFAULT_TARGET)
    # int8 / int4: bfloat16 with weight-only int8 projections and head / int4 layer
    # projections, CPU only (workers/llama.py)
    dtype: Literal["float32", "float16", "bfloat16", "int8", "int4"] = "float32"
    device: str = "cpu"  # "cuda" on GPU nodes: each actor gets its own GPU from Ray
    # on CUDA, the actors replay the decode step's forwards from CUDA graphs (workers/graphs.py)
    cuda_graphs: bool = True
    # The actors run the decode step's forwards through torch.compile (workers/compiled.py;
    # on CUDA inside the graphs; a split target's ranks stay eager): on a CPU in bfloat16
    # 1.1–1.2× faster at batch 1, in float32 slower (docs/benchmarks.md, "The service,
    # compiled"), for minutes of compiling when the replica starts (its warm-up) and again in
    # an actor that restarts.
    compiled: bool = False
    tensor_parallel: int = Field(1, ge=1)  # target shards (one actor each, one placement group)
    torch_threads: int = Field(1, ge=1)  # intra-op threads per actor (oversubscription is costly)
    max_batch: int = Field(8, ge=1)  # requests per decode step
    max_queued: int = Field(32, ge=0)  # waiting beyond max_batch before RESOURCE_EXHAUSTED
    max_len: int = Field(1024, ge=8)  # capped at the models' context
    # KV slots per replica for parked sessions and cached prefixes (one LRU order)
    max_sessions: int = Field(16, ge=0)
    # Requests without a session reuse the longest parked prefix of their principal's earlier
    # requests and park their own KV (automatic prefix caching); False: sessions only.
    prefix_caching: bool = True
    # Speculation cache (workers/speculation.py): the draft actor prepares the next step's
    # proposals for this many likeliest verification outcomes while the target verifies
    # (0: off; a feature draft then reads its own features after a rejection, another
    # lossless draft law), sampling with its top tokens scaled by the downweight (1: plain
    # sampling; < 1: Saguaro sampling, another lossless draft law).
    speculation: int = Field(0, ge=0)
    speculation_downweight: float = Field(1.0, gt=0, le=1)
    # Steps with more drafted requests prepare nothing: the draft's extra work would take the
    # device's throughput from the target (not yet calibrated on a GPU).
    speculation_max_batch: int = Field(4, ge=1)
    # A step whose actor calls take longer is stuck (a hung actor process): its draft and
    # target actors are restarted and the step redone, as when one dies. Compiled, unless set:
    # COMPILED_STEP_TIMEOUT_S (a step that meets a new kind of call compiles it: minutes).
    step_timeout_s: float = Field(120.0, gt=0)
    max_new_tokens: int = Field(512, ge=1)  # per-request limit
    max_k: int = Field(4, ge=1)
    max_gamma: int = Field(16, ge=1)
    default_method: str = "block"
    default_gamma: int = Field(4, ge=1)
    # What `method: auto` chooses among each step: "none" or "method/K/γ" (service/policy.py).
    auto_arms: list[str] = Field(default_factory=lambda: list(DEFAULT_ARMS))
    # On CUDA, the "method/K/γ" whose graphs the replica captures at start, beside `none` and
    # the auto arms (service/warm_up.py): nothing captures while serving, and a request of
    # another shape runs eagerly. None: the default method at K = 1 and the default γ.
    graph_shapes: list[str] | None = None
    default_max_new_tokens: int = Field(128, ge=1)
    coordinator: Resources = Resources()
    draft: Resources = Resources()
    target_shard: Resources = Resources()

    @model_validator(mode="after")
    def _auto_arms(self) -> ReplicaConfig:
        def fits(arm: Arm) -> bool:
            return arm.k <= self.max_k and arm.gamma <= self.max_gamma

        if "auto_arms" not in self.model_fields_set:  # the defaults within this deployment's
            self.auto_arms = [a for a in self.auto_arms if fits(Arm.parse(a))]
        for text in self.auto_arms:
            if not fits(Arm.parse(text)):  # parse: ValueError naming the arm
                raise ValueError(f"auto_arms: {text!r} exceeds max_k or max_gamma")
        if not self.auto_arms:
            raise ValueError("auto_arms: at least one arm")
        for text in self.graph_shapes or []:
            if not fits(Arm.parse_shape(text, "graph_shapes")):
                raise ValueError(f"graph_shapes: {text!r} exceeds max_k or max_gamma")
        return self

    @model_validator(mode="after")
    def _compiled_steps_compile(self) -> ReplicaConfig:
        """A compiled replica's steps may compile (its warm-up's, a restarted actor's): a
        default step timeout would take a compile for a hung actor, and restart it."""
        if self.compiled and "step_timeout_s" not in self.model_fields_set:
            self.step_timeout_s = COMPILED_STEP_TIMEOUT_S
        return self

    def warm_shapes(self) -> list[tuple[str, int, int]]:
        """The (method, K, γ) the replica's graphs are captured for at start."""
        arms = [Arm.parse_shape(text, "graph_shapes") for text in self.graph_shapes or []]
        if self.graph_shapes is None and self.default_method in VERIFIERS:
            arms.append(Arm(self.default_method, 1, self.default_gamma))
        arms += [Arm.parse(text) for text in self.auto_arms]
        return sorted({(a.method, a.k, a.gamma) for a in arms if a.method != PLAIN})

    @model_validator(mode="after")
    def _gpus_for_cuda(self) -> ReplicaConfig:
        """The draft actor and each target shard load the models on `device`: on CUDA each
        needs a GPU from Ray (without one, Ray hides every GPU from it and it fails to load)."""
        if self.device.split(":")[0] == "cuda":
            if self.dtype in ROUNDED:
                raise ValueError(f"replica.dtype: {self.dtype} runs on a CPU only (device: cpu)")
            for name in ("draft", "target_shard"):
                if getattr(self, name).num_gpus <= 0:
                    raise ValueError(
                        f"replica.{name}.num_gpus: device {self.device!r} needs a GPU per "
                        f"{name} actor; set num_gpus > 0 (e.g. 1), or device: cpu"
                    )
        return self


class Autoscaling(BaseModel):
    """Ray Serve ``autoscaling_config`` of the replica deployment (same field names)."""

    model_config = ConfigDict(extra="forbid")  # a typo in a config file is an error

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = None
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(2.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    metrics_interval_s: float = Field(10.0, gt=0)
    look_back_period_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling: min_replicas exceeds max_replicas")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("autoscaling: look_back_period_s must exceed metrics_interval_s")
        return self

    def serve_config(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BLOCKSPEC_", env_nested_delimiter="__", extra="forbid"
    )

    host: str = "127.0.0.1"  # where gRPC, HTTP and metrics listen (loopback unless meant)
    port: int = Field(50051, ge=0, le=65535)  # 0: any free port
    metrics_port: int = Field(9464, ge=0, le=65535)  # Prometheus /metrics on `host`; 0: off
    # OpenAI-compatible HTTP API (Serve's HTTP proxy) on `host`; 0: off. Plain HTTP: keep it on
    # loopback or behind a TLS-terminating proxy, and set auth tokens.
    http_port: int = Field(8000, ge=0, le=65535)
    redis_url: str | None = None  # None: embedded in-process session store (single node)
    session_ttl_s: float = Field(3600.0, gt=0)
    ray_address: str | None = None  # join this cluster; None: RAY_ADDRESS or a local cluster
    ray_num_cpus: int | None = None  # logical CPUs of a local cluster (None: the machine's)
    # TLS for the gRPC port (PEM files); with tls_client_ca_file, mutual TLS.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # Bearer tokens (service/auth.py): principal -> token, and/or a file of "principal token"
    # lines. None of either: no authentication.
    auth_tokens: dict[str, str] = Field(default_factory=dict)
    auth_tokens_file: str | None = None
    # Requests one client (its principal, or its address without auth) may have in flight;
    # more get RESOURCE_EXHAUSTED. None: no per-client limit.
    max_in_flight_per_client: int | None = Field(None, ge=1)
    app_name: str = "blockspec"
    drain_timeout_s: float = Field(30.0, ge=0)  # on shutdown: finish in-flight requests
    replica: ReplicaConfig = ReplicaConfig()
    autoscaling: Autoscaling = Autoscaling()

    @model_validator(mode="after")
    def _security(self) -> Settings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file: give both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file: mutual TLS needs tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")
        if any(not token for token in self.auth_tokens.values()):
            raise ValueError("auth_tokens: empty token")
        return self

    def tokens(self) -> dict[str, str]:
        """principal -> token, from auth_tokens and auth_tokens_file."""
        from blockspec.service.auth import read_tokens_file

        tokens = read_tokens_file(self.auth_tokens_file) if self.auth_tokens_file else {}
        return {**tokens, **self.auth_tokens}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        path = os.environ.get(CONFIG_ENV)
        if path:
            if not Path(path).is_file():
                raise ValueError(f"{CONFIG_ENV}: no such file {path!r}")
            if path.endswith(".toml"):
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)
