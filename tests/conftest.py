"""Test-wide settings."""

import fnmatch
import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest
import torch

# `redis_url`: a real redis-server; `service`: the whole service on a local Ray cluster.
pytest_plugins = ["tests.redis_server", "tests.live_service"]

# pytest-xdist runs one process per core; more than one intra-op thread per process
# oversubscribes the cores and OpenMP spin-waiting then slows everything ~10x.
torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent

# Without a GPU, Triton's interpreter runs the verifiers' CUDA kernels on CPU tensors
# (tests/test_verify_kernels.py). Triton reads this when it is imported, so it is set here,
# before any test imports it; nothing else runs Triton code on a CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def clean_env(monkeypatch):
    """No BLOCKSPEC_* variables (Settings reads them in any case, and BLOCKSPEC_CONFIG)."""
    for key in list(os.environ):
        if key.upper().startswith("BLOCKSPEC_"):
            monkeypatch.delenv(key)


# ---------------------------------------------------------------------------- the unit tier
# `pytest -m unit`: the tests that need no Ray, no server (gRPC, HTTP, redis-server) and no
# other process, in under 3 minutes on 2 cores: the verifiers' laws against tests/reference/
# (the statistical ones on a subset of their cases), the engine on the tiny pair in process,
# the request contract, the model code. Only the files named here are searched (a test file
# added later runs in the full suite only, until it is named here); a file's patterns pick its
# tests as `name` or `name[id]` (fnmatch on each part), a leading "-" leaves matches out and the
# last match decides. A slow test, or one that uses a fixture of SERVER_FIXTURES (also through
# another fixture), is never unit.
ALL = ("*",)
UNIT: dict[str, tuple[str, ...]] = {
    # the verifiers: laws against tests/reference/, contract, loops, kernels' CPU twins
    "test_reference_numbers.py": ALL,
    "test_reference_laws.py": (
        "test_output_law_matches_reference[toy-*]",  # every method at K = 1, 2, 3
        "test_output_law_matches_reference[*-K2-*]",  # every instance
        "test_power_*",
    ),
    "test_facts.py": ALL,
    "test_adversarial.py": ("test_adversarial_positions_default", "test_power_*"),
    "test_loop_lossless.py": (
        "test_loop_law_equals_target[peaked-*-K1]",
        "test_loop_law_equals_target[peaked-*-K2]",
        "test_toy_*",
        "test_power_greedy_block_without_carry_is_rejected",
        "test_power_spectr_gbv_without_carry_is_rejected[toy-*]",
    ),
    "test_outcomes.py": ALL,
    "test_cpu_verifiers.py": ("*", "-*[*-5003]"),
    "test_cpu_kernels.py": ("*", "-test_loading_the_kernels_*"),  # a fresh process
    "test_verify_cost.py": ALL,
    "test_verify_graphs.py": ALL,
    "test_sampling.py": ALL,
    # the engine on the tiny pair, in process (its sampled-law tests: one case)
    "test_engine.py": (
        "*",
        "-test_sampled_output_law_*",
        "test_sampled_output_law_equals_target_law[block-1]",
    ),
    "test_prefix_cache.py": ALL,
    "test_policy.py": ("*", "-test_engine_law_equals_target_law_while_auto_switches"),
    "test_feature_draft.py": ("*", "-test_sampled_output_law_*"),
    "test_speculation.py": (
        "test_above_its_batch_limit_the_cache_prepares_nothing",
        "test_greedy_requests_rank_recovered_tokens_by_the_drafts_beliefs",
        "test_downweighted_rows_scale_the_top_tokens_and_keep_one_hot_rows",
        "test_loop_law_with_the_engines_counter_based_draft_uniforms",
        "test_draft_uniforms_keyed_by_the_token_position_are_rejected",
    ),
    "test_fake_device.py": (
        "test_harness_refuses_what_cuda_refuses_and_counts_host_reads",
        "test_a_device_cache_keeps_its_lengths_on_the_host_and_still_refuses_overflow",
        "test_every_method_decodes_on_the_device_as_on_the_cpu[token]",
        "test_a_session_follow_up_decodes_on_the_device_as_on_the_cpu",
        "test_a_dropped_move_fails_as_on_a_gpu",
    ),
    "test_graphs.py": ("*", "-test_the_engine_writes_the_same_tokens_with_replayed_forwards"),
    # the request contract: validation, refusals, settings, sessions, the clients' parsers
    "test_gateway.py": ALL,
    "test_http_api.py": ALL,  # the tests that need no `service`
    "test_config.py": ALL,
    "test_sessions.py": ("*", "-*[redis]", "-test_expires_after_ttl", "-test_put_refreshes_ttl"),
    "test_cli.py": (
        "test_help_shows_every_options_default",
        "test_stats_line_numbers",
        "test_client_error_reads_code_and_message",
        "test_version",
    ),
    "test_loadtest.py": ALL,
    "test_security.py": ALL,
    "test_deploy.py": ALL,  # builds the Serve application without starting Ray
    # the model code
    "test_model_families.py": (
        "*",
        "-test_a_compiled_forward_*",
        "-test_an_int4_forward_compiles_*",
    ),  # inductor: g++
    "test_default_pair.py": ("*", "-test_greedy_chat_answer_equals_hugging_face"),
    "test_detokenizer.py": ALL,
    "test_draft_prompts.py": ("*", "-test_round_*"),
}
# The live service and its redis-server (tests/live_service.py, tests/redis_server.py), and
# test_cli.py's in-process gRPC server.
SERVER_FIXTURES = {"service", "redis_url", "fake"}


def _matches(pattern: str, name: str, param: str | None) -> bool:
    name_glob, _, param_glob = pattern.partition("[")
    if not fnmatch.fnmatchcase(name, name_glob):
        return False
    return not param_glob or (param is not None and fnmatch.fnmatchcase(param, param_glob[:-1]))


def _is_unit(item: pytest.Item) -> bool:
    path = Path(str(item.path))
    patterns = UNIT.get(path.name) if path.parent == TESTS else None
    if not patterns or item.get_closest_marker("slow"):
        return False
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return False
    name = getattr(item, "originalname", item.name)
    callspec = getattr(item, "callspec", None)
    param = callspec.id if callspec is not None else None
    picked = False
    for pattern in patterns:  # the last pattern that matches decides
        exclude = pattern.startswith("-")
        if _matches(pattern.removeprefix("-"), name, param):
            picked = not exclude
    return picked


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_unit(item):
            item.add_marker(pytest.mark.unit)


# In a run of unit tests only (`-m unit`, or unit tests picked by node id), starting Ray, a gRPC
# server or any other process raises, and a test that tried (even if it caught the error), or
# after which Ray is up, fails: a mislabelled test fails the unit run instead of slowing it.
_GUARDED = pytest.StashKey[bool]()
_started: list[str] = []


def _refuse(what: str):
    def refused(*args, **kwargs):
        _started.append(what)
        raise RuntimeError(f"a unit test must not start {what} (see tests/conftest.py)")

    return refused


def pytest_collection_finish(session: pytest.Session) -> None:
    items = session.items  # empty in pytest-xdist's controller; its workers guard themselves
    if not items or not all(item.get_closest_marker("unit") for item in items):
        return
    import grpc
    import ray
    import ray._private.node
    import ray._private.worker

    mp = pytest.MonkeyPatch()
    mp.setattr(ray, "init", _refuse("Ray"))
    mp.setattr(ray._private.worker, "init", _refuse("Ray"))
    mp.setattr(ray._private.node.Node, "__init__", _refuse("a Ray node"))
    mp.setattr(grpc, "server", _refuse("a gRPC server"))
    mp.setattr(grpc.aio, "server", _refuse("a gRPC server"))
    mp.setattr(subprocess.Popen, "__init__", _refuse("a subprocess"))  # redis-server too
    mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a process"))
    session.config.add_cleanup(mp.undo)
    session.config.stash[_GUARDED] = True


@pytest.fixture(autouse=True)
def _unit_starts_nothing(request: pytest.FixtureRequest):
    yield
    if not request.config.stash.get(_GUARDED, False):
        return
    import ray

    started, _started[:] = list(_started), []
    if started or ray.is_initialized():
        pytest.fail(f"this unit test started {started or ['Ray']}: it is not a unit test")
