"""Settings: defaults, a YAML or TOML file named by BLOCKSPEC_CONFIG, env vars over the file,
init arguments over both, and typos refused."""

from __future__ import annotations

import pydantic
import pytest

from blockspec.service.config import Settings

pytestmark = pytest.mark.usefixtures("clean_env")


def test_defaults_run_locally_on_loopback():
    s = Settings()
    assert s.host == "127.0.0.1" and s.redis_url is None and s.ray_address is None
    assert s.replica.tensor_parallel == 1 and s.autoscaling.min_replicas == 1


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_file_then_env_then_arguments(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"blockspec{suffix}"
    if suffix == ".yaml":
        path.write_text(
            "port: 6000\nreplica:\n  max_batch: 4\n  max_k: 3\nautoscaling:\n  max_replicas: 3\n"
        )
    else:
        path.write_text(
            "port = 6000\n[replica]\nmax_batch = 4\nmax_k = 3\n[autoscaling]\nmax_replicas = 3\n"
        )
    monkeypatch.setenv("BLOCKSPEC_CONFIG", str(path))
    monkeypatch.setenv("BLOCKSPEC_REPLICA__MAX_BATCH", "16")
    s = Settings(port=7000)
    assert s.port == 7000  # argument over file
    assert s.replica.max_batch == 16  # env over file
    assert s.replica.max_k == 3 and s.autoscaling.max_replicas == 3  # file over defaults


def test_typos_and_bad_values_are_refused(tmp_path, monkeypatch):
    with pytest.raises(pydantic.ValidationError, match="max_batchs"):
        Settings(replica={"max_batchs": 3})
    with pytest.raises(pydantic.ValidationError, match="min_replicas exceeds"):
        Settings(autoscaling={"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(pydantic.ValidationError, match="look_back_period_s"):
        Settings(autoscaling={"metrics_interval_s": 10, "look_back_period_s": 5})
    with pytest.raises(pydantic.ValidationError, match=r"resources: amounts must be > 0 \(gpu_a\)"):
        Settings(replica={"draft": {"resources": {"gpu_a": 0, "node_b": 0.01}}})
    with pytest.raises(pydantic.ValidationError, match="tls_cert_file and tls_key_file"):
        Settings(tls_cert_file=__file__)
    with pytest.raises(pydantic.ValidationError, match="tls_client_ca_file: mutual TLS"):
        Settings(tls_client_ca_file=__file__)
    with pytest.raises(pydantic.ValidationError, match="auth_tokens_file: no such file"):
        Settings(auth_tokens_file=str(tmp_path / "none.txt"))
    with pytest.raises(pydantic.ValidationError, match="auth_tokens: empty token"):
        Settings(auth_tokens={"alice": ""})
    bad = tmp_path / "tokens.txt"
    bad.write_text("alice one two\n")
    with pytest.raises(ValueError, match=r"tokens\.txt:1: expected 'principal token'"):
        Settings(auth_tokens_file=str(bad)).tokens()
    monkeypatch.setenv("BLOCKSPEC_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="no such file"):
        Settings()


def test_cuda_without_gpus_is_refused_naming_the_field():
    with pytest.raises(pydantic.ValidationError, match=r"replica\.draft\.num_gpus: device 'cuda'"):
        Settings(replica={"device": "cuda"})
    with pytest.raises(pydantic.ValidationError, match=r"replica\.target_shard\.num_gpus"):
        Settings(replica={"device": "cuda:0", "draft": {"num_gpus": 1}})
    gpus = {"num_gpus": 0.5}
    s = Settings(replica={"device": "cuda", "draft": gpus, "target_shard": gpus})
    assert s.replica.coordinator.num_gpus == 0  # the coordinator runs no model
    assert Settings(replica={"device": "cpu"}).replica.draft.num_gpus == 0
    with pytest.raises(pydantic.ValidationError, match=r"replica\.dtype: int8 runs on a CPU"):
        Settings(replica={"device": "cuda", "dtype": "int8", "draft": gpus, "target_shard": gpus})
    assert Settings(replica={"dtype": "int8"}).replica.dtype == "int8"
    with pytest.raises(pydantic.ValidationError, match=r"replica\.dtype: int4 runs on a CPU"):
        Settings(replica={"device": "cuda", "dtype": "int4", "draft": gpus, "target_shard": gpus})
    assert Settings(replica={"dtype": "int4"}).replica.dtype == "int4"


def test_serve_flags_override_env_and_are_validated(monkeypatch):
    from blockspec.service.cli import main, serve_settings

    captured = {}
    monkeypatch.setattr(
        "blockspec.service.cli.serve_forever", lambda args: captured.update(args=args)
    )
    monkeypatch.setenv("BLOCKSPEC_REPLICA__MAX_K", "3")
    main(["serve", "--port", "0", "--tp", "2", "--replicas", "1-3"])
    s = serve_settings(captured["args"])
    assert (s.port, s.replica.tensor_parallel, s.replica.max_k) == (0, 2, 3)
    assert not s.replica.compiled
    assert (s.autoscaling.min_replicas, s.autoscaling.max_replicas) == (1, 3)
    main(["serve", "--draft", "/d", "--target", "/t", "--dtype", "bfloat16"])
    s = serve_settings(captured["args"])
    assert (s.replica.draft_dir, s.replica.target_dir, s.replica.dtype) == ("/d", "/t", "bfloat16")
    main(["serve", "--tp", "0"])
    with pytest.raises(pydantic.ValidationError, match="tensor_parallel"):
        serve_settings(captured["args"])
    main(["serve"])
    monkeypatch.setenv("BLOCKSPEC_REPLICA__COMPILED", "true")
    assert serve_settings(captured["args"]).replica.compiled  # the flag unset: the environment's
    monkeypatch.delenv("BLOCKSPEC_REPLICA__COMPILED")
    main(["serve", "--compiled"])
    assert serve_settings(captured["args"]).replica.compiled


def test_a_compiled_replica_waits_for_a_compile_before_calling_a_step_stuck():
    """A compiled replica's steps may compile for minutes: unless the config sets its own, its
    step timeout is COMPILED_STEP_TIMEOUT_S, not the eager replica's 120 s."""
    from blockspec.service.config import COMPILED_STEP_TIMEOUT_S, ReplicaConfig

    assert ReplicaConfig().step_timeout_s == 120.0
    assert ReplicaConfig(compiled=True).step_timeout_s == COMPILED_STEP_TIMEOUT_S > 600
    assert ReplicaConfig(compiled=True, step_timeout_s=300).step_timeout_s == 300
