"""End to end over real gRPC, a real local Ray cluster (127.0.0.1), Ray Serve and redis-server.

One service (tests/live_service.py) for the session (starting Ray and the actors costs ~25 s on
2 cores); every test leaves it serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.build import build_engine
from blockspec.service.config import Settings
from blockspec.service.requests import ReplicaStats, make_request
from blockspec.service.results import StepTimes
from blockspec.service.sessions import RedisStore
from blockspec.verification import VERIFIERS
from blockspec.workers.draft import padding_groups
from blockspec.workers.sampling import SamplingParams
from tests.cli_process import BLOCKSPEC
from tests.live_service import APP, MAX_BATCH, MAX_QUEUED, TINY_PAIR, stop_remote_engine

pytestmark = pytest.mark.xdist_group("ray")  # with every test that uses the live service


def stats(service) -> ReplicaStats:
    return service["replica"].stats.remote().result()


def wait_idle(service, timeout: float = 20.0) -> ReplicaStats:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(service)
        if (s.active == 0 and s.in_flight == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def scrape(url: str, keep=("",)) -> dict[str, float]:
    """Prometheus samples at `url` whose labels are among `keep` (others summed over):
    {'name{label="v",...}': value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for x in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(x.labels.items()) if k in keep)
            name = f"{x.name}{{{labels}}}" if labels else x.name
            samples[name] = samples.get(name, 0.0) + x.value
    return samples


def gateway_metrics(service) -> dict[str, float]:
    """The gateway's request metrics, by method and gRPC code."""
    port = service["address"]["metrics_port"]
    return scrape(f"http://127.0.0.1:{port}/metrics", keep=("method", "code", "le", "position"))


def poll_gateway_metrics(service, condition, timeout: float = 20.0) -> dict[str, float]:
    """The gateway's metrics once `condition` holds of them (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while not condition(metrics := gateway_metrics(service)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return metrics


def test_info_health_reflection_and_metrics(service):
    info = service["stub"].Info(pb.InfoRequest())
    assert info.vocab_size == 8192 and info.limits.max_context == 384
    assert [m.name for m in info.methods] == [*VERIFIERS, "auto"]
    assert info.limits.max_batch == MAX_BATCH

    health = health_pb2_grpc.HealthStub(service["channel"])
    for name in ("", "blockspec.v1.Generator"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    reflect = reflection_pb2_grpc.ServerReflectionStub(service["channel"])
    (reply,) = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in reply.list_services_response.service}
    assert {"blockspec.v1.Generator", "grpc.health.v1.Health"} <= names

    # A client that has its answer sees it counted (the count is not left to the RPC's end).
    stub = service["stub"]
    request = pb.GenerateRequest(prompt="x = ", max_new_tokens=4, method="block")
    for call in [stub.Generate, lambda r: list(stub.GenerateStream(r))] * 4:
        before = gateway_metrics(service)
        call(request)
        after = gateway_metrics(service)
        for name in (
            'blockspec_requests_total{code="OK",method="block"}',
            'blockspec_block_efficiency_count{method="block"}',
        ):
            assert after[name] == before.get(name, 0) + 1, name


def test_serves_controller_gives_a_slow_proxy_time_to_start(service):
    # Ray's 5 s readiness check made Serve kill a proxy still importing beside a busy test run,
    # and serve.start failed (service.app.LOCAL_CLUSTER_ENV): the controller that runs the
    # check must read the longer one.
    import psutil

    from blockspec.service.app import LOCAL_CLUSTER_ENV

    key = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
    controllers = [
        proc
        for proc in psutil.Process().children(recursive=True)
        if proc.name().startswith("ray::ServeControl")
    ]
    assert controllers
    assert {proc.environ().get(key) for proc in controllers} == {LOCAL_CLUSTER_ENV[key]}


def test_replica_step_metrics_reach_rays_prometheus_endpoint(service):
    """The replica records step metrics with ray.util.metrics; the node's metrics agent
    exports them (on 127.0.0.1) for Prometheus: every phase, batch sizes, queue depth."""
    import ray

    # Steps run while the metrics are read: a gauge is exported only for report intervals in
    # which it was set (histograms accumulate).
    def start():
        request = pb.GenerateRequest(prompt="def f(x):", max_new_tokens=300, ignore_eos=True)
        return service["stub"].GenerateStream(request)

    busy = start()
    next(busy)
    node = ray._private.worker.global_worker.node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    assert node.node_ip_address == "127.0.0.1"
    wanted = [f'ray_blockspec_step_phase_seconds_count{{phase="{p}"}}' for p in StepTimes.PHASES]
    wanted += ["ray_blockspec_step_batch_size_count", "ray_blockspec_queue_depth"]
    # Ray's metrics agent publishes every 10 s (its default; at 0.5 s the idle test cluster
    # costs 0.29 of a core against 0.24: blockspec-bench idle), so allow a few reports.
    deadline, metrics = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # each metric shows up at its first report interval
        if busy.done():
            busy = start()
        with contextlib.suppress(OSError):  # the agent may be slow to answer: ask again
            metrics = scrape(url, keep=("phase",))
        if all(key in metrics for key in wanted):
            break
        time.sleep(0.5)
    busy.cancel()
    assert all(key in metrics for key in wanted), sorted(set(wanted) - set(metrics))
    assert all(metrics[key] > 0 for key in wanted[:-1])  # counts; the queue depth may be 0
    assert metrics['ray_blockspec_step_phase_seconds_sum{phase="target"}'] > 0


def test_greedy_output_of_every_method_equals_the_in_process_engine_and_is_batched(service):
    """≥ 8 concurrent clients, every method: batched together, outputs equal to the engine's."""
    prompts = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]
    cases = [("none", 1)] + [
        (m, 1 if VERIFIERS[m].single_path else 2) for m in VERIFIERS
    ]  # 10 methods x 4 prompts = 40 requests
    before = stats(service).batch_sizes

    def call(case_prompt):
        (method, k), prompt = case_prompt
        req = pb.GenerateRequest(
            prompt=prompt,
            max_new_tokens=24,
            temperature=0,
            method=method,
            k=k,
            gamma=3,
            ignore_eos=True,
        )
        return service["stub"].Generate(req, timeout=120)

    jobs = [(c, p) for c in cases for p in prompts]
    with ThreadPoolExecutor(MAX_BATCH) as pool:  # 8 clients, within capacity
        replies = list(pool.map(call, jobs))

    engine, tokenizer = build_engine(
        service["settings"].replica.draft_dir, service["settings"].replica.target_dir, 4
    )
    greedy = SamplingParams(temperature=0.0)
    refs = engine.generate(
        [
            make_request(engine.limits, tokenizer(p)["input_ids"], 24, "block", 1, 3, greedy)
            for p in prompts
        ]
    )
    expected = {p: r.token_ids for p, r in zip(prompts, refs, strict=True)}
    for ((method, _), prompt), reply in zip(jobs, replies, strict=True):
        assert list(reply.token_ids) == expected[prompt], (method, prompt)
        assert reply.text == tokenizer.decode(expected[prompt], skip_special_tokens=True)
        assert reply.finish_reason == pb.FINISH_REASON_LENGTH
        if method != "none":
            assert reply.stats.target_calls < 24  # speculation accepted something
    assert max(r.stats.mean_batch_size for r in replies) > 1
    assert all(r.stats.step_ms.target > 0 and r.stats.step_ms.transfer > 0 for r in replies)
    after = stats(service).batch_sizes
    batched = {int(b): n - before.get(b, 0) for b, n in after.items() if int(b) > 1}
    assert any(n > 0 for b, n in batched.items() if b >= MAX_BATCH), after


def test_seeded_output_through_the_service_equals_the_engine_alone(service):
    """Sampled (T = 1) seeded requests of every method, sent concurrently so that they share
    decode steps, write what the in-process engine writes for each request alone.

    Up to float rounding: a batch's padding and matmul shapes move the last bits of p and q
    (~5e-7), and a draw that lands that close to a boundary flips (seen once, on spectr_gbv).
    So 8 of the 10 must match exactly; when batch-mates consumed a request's random stream (the
    defect this guards), 50 of 50 seeds changed in the issue's reproduction. The first request's
    seed is the API's largest (2^64 - 1: its keys take it as int64 bits)."""
    from tests.test_engine import MIXED

    def request(i: int, method: str, k: int, gamma: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt=f"def f{i}(x):", max_new_tokens=20, seed=40 + i if i else (1 << 64) - 1,
            method=method, k=k, gamma=gamma, ignore_eos=True,
        )  # fmt: skip

    jobs = [request(i, *case) for i, case in enumerate(MIXED)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda r: service["stub"].Generate(r, timeout=120), jobs))
    assert max(r.stats.mean_batch_size for r in replies) > 1  # they did share steps
    replica = service["settings"].replica
    engine, tokenizer = build_engine(replica.draft_dir, replica.target_dir, 1)
    differ = []
    for job, reply in zip(jobs, replies, strict=True):
        ids = tokenizer(job.prompt)["input_ids"]
        alone = make_request(engine.limits, ids, 20, job.method, job.k, job.gamma, seed=job.seed)
        if list(reply.token_ids) != engine.generate([alone])[0].token_ids:
            differ.append(job.method)
    assert len(differ) <= 2, differ


def test_auto_requests_say_what_ran_and_share_steps_with_fixed_methods(service):
    """`method: auto` over gRPC, concurrently with fixed-method requests: every step of a
    request is counted under the configuration it ran, and auto's are among its arms."""
    arms = set(service["settings"].replica.auto_arms)
    jobs = [
        pb.GenerateRequest(prompt=f"def g{i}(x):", max_new_tokens=24, method=method, k=k,
                           gamma=gamma, ignore_eos=True)
        for i, (method, k, gamma) in enumerate([("auto", None, None)] * 4 + [("gbv", 2, 3)] * 2)
    ]  # fmt: skip
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda r: service["stub"].Generate(r, timeout=120), jobs))
    for job, reply in zip(jobs, replies, strict=True):
        assert len(reply.token_ids) == 24
        ran = dict(reply.stats.steps_by_config)
        assert sum(ran.values()) == reply.stats.target_calls
        assert reply.stats.method == job.method  # the configuration that ran, reported
        if job.method == "auto":
            assert set(ran) <= arms, ran
            assert (reply.stats.k, reply.stats.gamma) == (0, 0)  # chosen per step: see ran
        else:
            assert ran == {"gbv/2/3": reply.stats.target_calls}
            assert (reply.stats.k, reply.stats.gamma) == (2, 3)
    assert max(r.stats.mean_batch_size for r in replies) > 1


def test_a_request_read_at_its_end_takes_two_token_events_from_the_replica(service):
    """A unary call without stop strings reads its tokens only at the end (the gateway sets
    read_at_end): the replica sends the first step's tokens at once (time to first token) and
    the rest with the finish, not an event a step (each a message from the replica's process
    to the gateway's, and CPU in both); the tokens are the same."""
    from blockspec.service.requests import FinishedEvent, GenerationRequest, TokensEvent
    from blockspec.workers.sampling import SamplingParams

    def events(read_at_end: bool) -> list:
        request = GenerationRequest(
            (5, 6, 7), 30, "block", 1, 3, SamplingParams(1.0), seed=11, read_at_end=read_at_end
        )
        return list(service["replica"].options(stream=True).generate.remote(request))

    each_step, at_end = events(False), events(True)
    assert isinstance(each_step[-1], FinishedEvent) and isinstance(at_end[-1], FinishedEvent)
    assert all(isinstance(e, TokensEvent) for e in each_step[:-1] + at_end[:-1])
    assert len(each_step) > 4 and len(at_end) == 3
    tokens = [[t for e in run[:-1] for t in e.token_ids] for run in (each_step, at_end)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 30
    assert at_end[0].token_ids == each_step[0].token_ids  # the first step's, at once


def test_streaming_chunks_add_up_and_stop_strings_cut_the_text(service):
    req = pb.GenerateRequest(prompt="def f(x):", max_new_tokens=40, seed=7, method="gbv", k=3)
    chunks = list(service["stub"].GenerateStream(req))
    unary = service["stub"].Generate(req)  # same seed: same output
    assert len(chunks) > 2 and chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert "".join(c.text for c in chunks) == unary.text
    assert chunks[-1].stats.target_calls == unary.stats.target_calls
    # A stop string taken from the middle of that text ends the output just before it.
    text = unary.text
    at = next(i for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].strip())
    stop = text[at : at + 3]
    stopped = service["stub"].Generate(
        pb.GenerateRequest(
            prompt="def f(x):", max_new_tokens=40, seed=7, method="gbv", k=3, stop=[stop]
        )
    )
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.text == text[: text.find(stop)]
    # Cut by the gateway, it still reports what ran: the same steps as the whole answer's up
    # to the cut (same seed), the configuration, and the replica.
    cut = stopped.stats
    assert (cut.method, cut.k, cut.gamma) == (unary.stats.method, 3, unary.stats.gamma)
    assert 0 < cut.target_calls <= unary.stats.target_calls and cut.tokens_per_call >= 1
    assert dict(cut.steps_by_config) == {f"gbv/3/{cut.gamma}": cut.target_calls}
    assert stopped.replica == unary.replica != ""
    streamed = list(
        service["stub"].GenerateStream(
            pb.GenerateRequest(
                prompt="def f(x):", max_new_tokens=40, seed=7, method="gbv", k=3, stop=[stop]
            )
        )
    )
    again = streamed[-1].stats  # the same seed: the same steps (their times differ)
    assert (again.target_calls, again.accepted_tokens) == (cut.target_calls, cut.accepted_tokens)
    assert again.steps_by_config == cut.steps_by_config and streamed[-1].replica == unary.replica
    assert wait_idle(service).active == 0


def test_a_second_deployment_cannot_take_the_ports_of_the_first(service):
    """Every listener binds exclusively: no socket can join one (as a later server that sets
    SO_REUSEPORT, gRPC's and Serve's default, would), `blockspec serve` on the same ports exits
    naming the first taken one, and the first deployment answers every request."""
    import errno
    import socket
    import subprocess

    settings = service["settings"]
    ports = dict(port=service["address"]["port"], http_port=settings.http_port)
    ports["metrics_port"] = service["address"]["metrics_port"]
    for name, port in ports.items():
        with socket.socket() as joining:
            joining.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError) as err:
                joining.bind(("127.0.0.1", port))
            assert err.value.errno == errno.EADDRINUSE, name
    argv = [f"--{name.replace('_', '-')}={port}" for name, port in ports.items()]
    second = subprocess.run(
        [*BLOCKSPEC, "serve", *argv], capture_output=True, text=True, timeout=120
    )
    assert second.returncode == 1
    assert second.stderr.startswith(f"error: 127.0.0.1:{ports['port']} (gRPC, --port) is already")
    request = pb.GenerateRequest(prompt="x", max_new_tokens=2)
    replicas = {service["stub"].Generate(request).replica for _ in range(8)}
    assert len(replicas) == 1 and "" not in replicas  # all answered, by the one replica


def test_session_continuation_reuses_the_kv_cache_and_lives_in_redis(service):
    sid = f"s-{time.time_ns()}"

    def ask(**fields):  # greedy, 16 tokens
        req = pb.GenerateRequest(max_new_tokens=16, temperature=0, ignore_eos=True, **fields)
        return service["stub"].Generate(req)

    first = ask(prompt="def mean(xs):", session_id=sid)
    assert first.stats.cached_prompt_tokens == 0
    second = ask(prompt="\n\ndef median(xs):", session_id=sid)
    history = first.prompt_tokens + len(first.token_ids)
    assert second.prompt_tokens > history
    assert second.stats.cached_prompt_tokens >= history - 1  # only the new turn was prefilled
    assert second.replica == first.replica

    # The store holds the whole conversation; a cold replica would rebuild from it.
    async def load():
        store = RedisStore(service["settings"].redis_url, ttl_s=60)
        try:
            return await store.get(sid)
        finally:
            await store.close()

    saved = asyncio.run(load())
    assert saved.turns == 2 and saved.replica == second.replica
    assert len(saved.tokens) == second.prompt_tokens + len(second.token_ids)
    # Greedy continuation equals a fresh request with the full history as prompt.
    fresh = ask(prompt_token_ids=saved.tokens[: second.prompt_tokens])
    assert list(fresh.token_ids) == list(second.token_ids)


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="x", prompt_token_ids=[1]), "prompt"),
    (dict(prompt_token_ids=[1, 99999]), "prompt_token_ids"),
    (dict(prompt="x", method="nope"), "method"),
    (dict(prompt="x", method="block", k=2), "k"),
    (dict(prompt="x", method="gbv", k=9), "k"),
    (dict(prompt="x", gamma=99), "gamma"),
    (dict(prompt="x", gamma=-1), "gamma"),
    (dict(prompt="x", max_new_tokens=100000), "max_new_tokens"),
    (dict(prompt="x", max_new_tokens=-3), "max_new_tokens"),
    # Explicit presence: a 0 that is set is a value, refused, not the default.
    (dict(prompt="x", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="x", k=0), "k"),
    (dict(prompt="x", gamma=0), "gamma"),
    (dict(prompt="x", method="auto", k=0), "k"),  # ignored by auto, but still a mistake
    (dict(prompt="x", method="none", gamma=-2), "gamma"),
    (dict(prompt="x", temperature=2.5), "temperature"),  # OpenAI's bound, on every wire
    (dict(messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role"),
    (dict(prompt="x", temperature=-1.0), "temperature"),
    (dict(prompt="x", temperature=float("nan")), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_k=-2), "top_k"),
    (dict(prompt="x", stop_token_ids=[-1]), "stop_token_ids"),
    (dict(prompt="x " * 400), "prompt"),  # longer than the 384-token context
    (dict(prompt="x" * (32 * 384 + 1)), "prompt"),  # refused before it is tokenized
    (dict(prompt_token_ids=[1] * 385), "prompt_token_ids"),
    (dict(prompt="x", stop=["a"] * 17), "stop"),
    (dict(prompt="x", stop=["a" * 257]), "stop"),
    (dict(prompt="x", stop_token_ids=[1] * 65), "stop_token_ids"),
    (dict(messages=[pb.ChatMessage(role="", content="x")]), "messages[0].role"),  # no role
    (dict(prompt="x", messages=[pb.ChatMessage(role="user", content="x")]), "prompt"),
]


@pytest.mark.parametrize(("fields", "name"), BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_requests_get_invalid_argument_naming_the_field(service, fields, name):
    for call in (service["stub"].Generate, service["stub"].GenerateStream):
        with pytest.raises(grpc.RpcError) as err:
            reply = call(pb.GenerateRequest(**fields))
            list(reply) if call is service["stub"].GenerateStream else None
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(name), err.value.details()
    ok = service["stub"].Generate(pb.GenerateRequest(prompt="x", max_new_tokens=2))
    assert len(ok.token_ids) >= 1


def test_unset_fields_take_the_defaults_and_stats_say_what_ran(service):
    """Unset k, gamma and max_new_tokens are the deployment's defaults (Info), and the stats
    report the configuration the validator filled in; top_k 0 stays "off"."""
    info = service["stub"].Info(pb.InfoRequest())
    reply = service["stub"].Generate(pb.GenerateRequest(prompt="x = ", ignore_eos=True))
    assert len(reply.token_ids) == info.default_max_new_tokens > 0
    assert reply.stats.method == info.default_method
    assert (reply.stats.k, reply.stats.gamma) == (1, info.default_gamma)
    assert dict(reply.stats.steps_by_config) == {
        f"{info.default_method}/1/{info.default_gamma}": reply.stats.target_calls
    }
    explicit = pb.GenerateRequest(
        prompt="x = ", max_new_tokens=3, method="gbv", k=2, gamma=2, top_k=0, ignore_eos=True
    )
    reply = service["stub"].Generate(explicit)
    assert len(reply.token_ids) == 3
    assert (reply.stats.method, reply.stats.k, reply.stats.gamma) == ("gbv", 2, 2)
    plain = service["stub"].Generate(
        pb.GenerateRequest(prompt="x", max_new_tokens=2, method="none")
    )
    assert (plain.stats.method, plain.stats.k, plain.stats.gamma) == ("none", 1, 1)
    assert info.limits.max_temperature == 2 and info.limits.max_stop_strings == 16
    assert "developer" in info.chat_roles


@pytest.mark.parametrize("payload", [b"\xff", b"\x0a\x05ab", b"\x0a" + b"\xff" * 10])
def test_undecodable_payloads_get_invalid_argument(service, payload):
    """Bytes that do not parse as the method's request message: INVALID_ARGUMENT saying so
    (grpc's own answer would be UNKNOWN), on every method; the server goes on serving."""
    channel = service["channel"]
    calls = [
        channel.unary_unary("/blockspec.v1.Generator/Generate"),
        channel.unary_stream("/blockspec.v1.Generator/GenerateStream"),
        channel.unary_unary("/blockspec.v1.Generator/Info"),
    ]
    for call in calls:  # no serializers: the bytes go out as they are
        with pytest.raises(grpc.RpcError) as err:
            reply = call(payload, timeout=30)
            list(reply) if hasattr(reply, "__iter__") and not isinstance(reply, bytes) else None
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("request: the payload did not parse")
    ok = service["stub"].Generate(pb.GenerateRequest(prompt="x", max_new_tokens=2))
    assert len(ok.token_ids) >= 1


def test_cancelled_streams_and_deadlines_free_the_kv_cache(service):
    stub = service["stub"]
    cancelled_before = stats(service).cancelled
    counted = 'blockspec_requests_total{code="CANCELLED",method="token"}'
    counted_before = gateway_metrics(service).get(counted, 0)
    # Cancelled after the first chunk, several times: the RPC may end while the gateway is
    # inside grpc's write of a chunk (not awaiting the replica), and must still free the slot.
    for _ in range(6):
        stream = stub.GenerateStream(
            pb.GenerateRequest(prompt="x", max_new_tokens=300, ignore_eos=True, method="token")
        )
        next(stream)
        stream.cancel()
    # A deadline that passes mid-generation (a chunk proves the replica has it; on a loaded
    # machine the deadline may pass before the first one). Half the time the same request
    # takes to finish, measured here: a fixed deadline would fit one machine only.
    long = pb.GenerateRequest(prompt="y", max_new_tokens=370, ignore_eos=True, method="none")
    start = time.monotonic()
    stub.Generate(long)
    late = stub.GenerateStream(long, timeout=(time.monotonic() - start) / 2)
    reached_replica = False
    with pytest.raises(grpc.RpcError) as err:
        for _ in late:
            reached_replica = True
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    s = wait_idle(service)
    assert s.active == 0 and s.in_flight == 0
    assert s.cancelled >= cancelled_before + 6 + reached_replica, (s, cancelled_before)
    # The replica drops the late request by itself; the gateway ends its RPC independently.
    metrics = poll_gateway_metrics(service, lambda m: m["blockspec_in_flight"] == 0)
    assert metrics[counted] == counted_before + 6, (metrics, counted_before)
    assert metrics["blockspec_in_flight"] == 0, metrics
    assert stub.Generate(pb.GenerateRequest(prompt="z", max_new_tokens=3)).token_ids


def test_overload_gets_resource_exhausted_and_the_service_recovers(service):
    stub = service["stub"]
    exhausted_before = gateway_metrics(service).get(
        'blockspec_requests_total{code="RESOURCE_EXHAUSTED",method="none"}', 0
    )
    # The replica holds max_batch + max_queued requests and the gateway queues as many more.
    # Each request holds its place for 300 plain decoding steps (~4 s alone on the dev
    # machine, longer when batched), so none finishes while the gateway takes the burst in.
    streams = [
        stub.GenerateStream(
            pb.GenerateRequest(prompt="x", max_new_tokens=300, ignore_eos=True, method="none")
        )
        for _ in range(2 * (MAX_BATCH + MAX_QUEUED) + 6)
    ]
    codes = []
    for s in streams:
        try:
            next(s)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
    for s in streams:
        s.cancel()
    # None finishes during the burst and the gateway holds at most 2 replicas' worth (the live
    # service runs one replica): the 6 beyond are rejected, and Serve may reject a few more.
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 6, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert wait_idle(service).active == 0
    # Rejected RPCs are counted (before the client sees the code) and leave the in-flight gauge
    # (which drain() waits on) at 0.
    metrics = gateway_metrics(service)
    rejected = metrics['blockspec_requests_total{code="RESOURCE_EXHAUSTED",method="none"}']
    assert rejected == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) + exhausted_before
    assert metrics["blockspec_in_flight"] == 0
    assert stub.Generate(pb.GenerateRequest(prompt="z", max_new_tokens=3)).token_ids


def test_draining_gateway_answers_unavailable_and_not_serving(service):
    """A second gateway on the same replicas, drained: the first keeps serving."""
    from ray import serve

    from blockspec.service.gateway import GatewayServer
    from tests.test_http_api import post_completion

    # drain waits as long as the in-flight request takes, however loaded the machine
    update = dict(port=0, metrics_port=0, drain_timeout_s=600)
    settings = service["settings"].model_copy(update=update)
    replicas = serve.get_deployment_handle("Replica", APP)

    async def until(condition, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def scenario():
        server = GatewayServer(settings, replicas, await replicas.info.remote())
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GeneratorStub(channel)
            long = pb.GenerateRequest(prompt="a", max_new_tokens=300, ignore_eos=True)
            in_flight = asyncio.ensure_future(stub.Generate(long))
            await until(lambda: server.core.in_flight == 1)
            drain = asyncio.create_task(server.drain())  # waits for in_flight
            await until(lambda: server.core.draining)
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(prompt="a", max_new_tokens=2))
            # The HTTP API over the same gateway: 503 in OpenAI's schema.
            http = await post_completion(server.core, dict(model="target", prompt="a"))
            finished = await in_flight
            await drain
        return status, err.value.code(), finished, http

    status, code, finished, (http_status, http_body) = asyncio.run(scenario())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert code == grpc.StatusCode.UNAVAILABLE
    assert http_status == 503 and http_body["error"]["type"] == "service_unavailable"
    assert len(finished.token_ids) == 300  # the in-flight request was allowed to finish
    assert service["stub"].Generate(pb.GenerateRequest(prompt="z", max_new_tokens=3)).token_ids


@pytest.mark.parametrize("until", ["asked", pytest.param("running", marks=pytest.mark.slow)])
def test_serve_scales_replicas_from_one_to_two_under_load(service, until):
    """A second app on the same cluster, autoscaled 1..2 replicas on ongoing requests: under
    load Serve's autoscaler asks for a second replica, and (until="running") it runs. The
    default run stops at the ask: the second start is the first one's again and half the
    test's time (34 s of 62 alone)."""
    from ray import serve

    from blockspec.service.app import build

    autoscaling = dict(
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=2,
        upscale_delay_s=0.5,
        metrics_interval_s=0.5,
        look_back_period_s=2,
        downscale_delay_s=600,  # the second replica takes long to start on a loaded machine
    )
    fields = dict(port=0, metrics_port=0, autoscaling=autoscaling)
    settings = Settings.model_validate({**service["settings"].model_dump(), **fields})
    name = "blockspec-scale"
    gateway = serve.run(build(settings), name=name, route_prefix=None)
    try:
        scaled = _scale_up(gateway.address.remote().result()["port"], name, until == "running")
    finally:  # whatever happened: its replicas would hold the cluster's CPUs
        serve.delete(name)
    assert scaled == 2


def _scale_up(port: int, name: str, running: bool) -> int:
    """Load the app until it has 2 replicas (running ones, or any state: starting counts) or
    120 s have passed; returns how many it has."""
    from ray import serve

    def replicas() -> int:
        app = serve.status().applications[name]
        states = app.deployments["Replica"].replica_states
        return sum(n for state, n in states.items() if state == "RUNNING" or not running)

    assert replicas() == 1
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        load = [
            stub.GenerateStream(pb.GenerateRequest(prompt="x", max_new_tokens=300, ignore_eos=True))
            for _ in range(8)
        ]
        deadline = time.monotonic() + 120
        while replicas() < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        scaled = replicas()
        for s in load:
            s.cancel()
    return scaled


@pytest.mark.slow  # the sampled features-2 case of the next test covers 2 shards by default
def test_target_sharded_over_two_ray_actors_gives_the_same_greedy_output(service):
    """The replica's engine with the target split over 2 shard actors (gloo on loopback, one
    placement group) decodes exactly like the in-process engine."""

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.replica import build_remote_engine

    cfg = ReplicaConfig(**TINY_PAIR, tensor_parallel=2, max_batch=2, max_sessions=0)
    engine, info = build_remote_engine(cfg)
    local, tokenizer = build_engine(cfg.draft_dir, cfg.target_dir, 2)
    greedy = SamplingParams(temperature=0.0)

    def requests():
        return [
            make_request(engine.limits, tokenizer(p)["input_ids"], 20, m, k, 3, greedy)
            for p, m, k in (("def add(a, b):", "traversal", 2), ("while True:", "block", 1))
        ]

    try:
        assert info["tensor_parallel"] == 2
        remote = [r.token_ids for r in engine.generate(requests())]
        assert remote == [r.token_ids for r in local.generate(requests())]
        assert engine.times.transfer > 0  # actor calls cost something beyond their compute
    finally:
        stop_remote_engine(engine)


def test_a_compiled_replica_compiles_in_its_warm_up_then_samples_as_eager(service):
    """`compiled: true`: the actors' forwards go through torch.compile. The replica's warm-up
    meets each kind of call the declared shapes make, so serving compiles nothing (a compile
    of the tiny pair takes seconds; the served steps' forwards take milliseconds), and seeded
    tokens are the eager in-process engine's (float32: the compiled sums move the logits' last
    bits)."""
    from blockspec.service.config import ReplicaConfig
    from blockspec.service.replica import build_remote_engine, warm_replica

    common = dict(max_batch=1, max_len=64, max_sessions=0)
    cfg = ReplicaConfig(
        **TINY_PAIR, **common, compiled=True, prefix_caching=False, default_gamma=3,
        auto_arms=["block/1/3"],
    )  # fmt: skip
    engine, _ = build_remote_engine(cfg)
    local, _ = build_engine(cfg.draft_dir, cfg.target_dir, prefix_caching=False, **common)
    sampling = SamplingParams(1.0)

    def requests(method: str, gamma: int, seed: int) -> list:
        prompt = [(seed * 7 + j) % 90 + 3 for j in range(5 + seed % 4)]
        return [make_request(engine.limits, prompt, 10, method, 1, gamma, sampling, seed=seed)]

    try:
        report = warm_replica(engine, cfg, [sampling])  # as the replica starts, one law
        assert report.runs >= 2 and report.seconds > 2.0  # compiles: seconds, not milliseconds
        engine.reset_stats()
        for seed, method in enumerate(["block", "none", "block", "none"]):
            served = engine.generate(requests(method, 3, seed))
            assert served[0].token_ids == local.generate(requests(method, 3, seed))[0].token_ids
        times = engine.times
        assert times.draft + times.target < 1.5, vars(times)  # nothing compiled while serving
    finally:
        stop_remote_engine(engine)


@pytest.mark.parametrize(
    ("draft_kind", "world", "dtype"),
    [
        ("reduced_head", 1, "float32"),
        ("features", 2, "float32"),
        ("features", 2, "int8"),
        ("features", 1, "int4"),
    ],
)
def test_ray_actor_path_samples_exactly_like_the_in_process_engine(
    service, tmp_path, draft_kind, world, dtype
):
    """The chained actor step (draft actor -> target rank 0, which verifies and commits) gives
    every request of a sampled, seeded mixed batch the tokens the in-process engine gives it:
    same code, same shapes, so the same bits. Drafts: a reduced head (its rows travel on the
    head's ids and are widened on the target), or a feature draft (the target's rank 0 of 2
    sends the features of what it prefills, padding group by group, to the draft actor, and
    those of what it commits back for the draft's next step). Prompts of several lengths join
    at once (several prefill groups), then each continues as a session (warm caches). In int8
    and int4 too: the actors round the weights as the engine does (int8's row-parallel shards
    with their whole rows' scales; this target's int4 down projection has 344 input features a
    rank at world 2, not whole groups of 32, so it runs on one)."""
    import json
    import shutil
    from pathlib import Path

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.replica import build_remote_engine
    from tests.test_engine import MIXED
    from tests.test_feature_draft import save_feature_draft

    draft = tmp_path / "draft"
    if draft_kind == "features":
        save_feature_draft(Path(TINY_PAIR["target_dir"]), draft)
    else:
        shutil.copytree(TINY_PAIR["draft_dir"], draft)
        ids = torch.randperm(8192, generator=torch.Generator().manual_seed(5))[:6000]
        (draft / "draft_vocab.json").write_text(json.dumps(sorted(ids.tolist())))
    cfg = ReplicaConfig(
        draft_dir=str(draft),
        target_dir=TINY_PAIR["target_dir"],
        max_batch=len(MIXED),
        max_sessions=len(MIXED),
        tensor_parallel=world,
        dtype=dtype,
    )
    engine, _ = build_remote_engine(cfg)
    # Both sides split the target alike: all-reduce sums are the same bits.
    local, tokenizer = build_engine(
        cfg.draft_dir, cfg.target_dir, len(MIXED), tensor_parallel=world,
        max_sessions=len(MIXED), dtype=dtype,
    )  # fmt: skip
    prompts = [
        tokenizer(f"def f{i}(x):" + "\n    x = x + 1" * (2 * i))["input_ids"]
        for i in range(len(MIXED))
    ]
    assert len(padding_groups([len(p) - 1 for p in prompts])) > 2

    def requests(prompts):
        params = SamplingParams(1.0)
        return [
            make_request(
                engine.limits, prompt, 24, method, k, gamma, params, seed=70 + i, session_id=f"s{i}"
            )
            for i, (prompt, (method, k, gamma)) in enumerate(zip(prompts, MIXED, strict=True))
        ]

    try:
        for turn in range(2):
            results = engine.generate(requests(prompts))
            remote = [r.token_ids for r in results]
            assert remote == [r.token_ids for r in local.generate(requests(prompts))]
            assert turn == 0 or all(r.cached_tokens > 0 for r in results)
            more = tokenizer("\n\ny = 2")["input_ids"]
            prompts = [p + out + more for p, out in zip(prompts, remote, strict=True)]
        assert engine.times.transfer > 0 and engine.times.prefill > 0
    finally:
        if world > 1:
            local.target.close()
        stop_remote_engine(engine)


def _stop_process(actor) -> None:
    """SIGSTOP the actor's process: alive, holding its calls, answering nothing (a hang)."""
    import os
    import signal

    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda _actor: os.getpid()))
    os.kill(pid, signal.SIGSTOP)


@pytest.mark.parametrize(
    ("kind", "world", "fault"),
    [
        ("draft", 1, "killed"),
        pytest.param("target", 1, "killed", marks=pytest.mark.slow),
        ("target", 2, "killed"),
        ("draft", 1, "hung"),
    ],
)  # a target of 2 shards: a killed shard's restart, and its peer failing in a collective
def test_a_killed_actor_is_restarted_and_requests_finish_with_the_same_tokens(
    service, kind, world, fault
):
    """Kill the draft actor or a target shard (rank 1 of 2: its peer then fails in a
    collective) mid-generation, or stop the draft's process (a hang: the step times out after
    step_timeout_s and its actors are restarted): the coordinator restarts the workers,
    rebuilds every request's KV from its tokens, redoes the step, and each request of a
    sampled, seeded mixed batch finishes with the tokens of an undisturbed run on the same
    engine. (Rebuilt caches come from a batched prefill instead of step-by-step appends, which
    can move p and q in the last bits, as in the concurrent-service test above: 8 of 10 must
    match exactly.)"""
    import ray

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.coordinator import Coordinator, Done, Emitted
    from blockspec.service.replica import build_remote_engine
    from tests.test_engine import MIXED

    cfg = ReplicaConfig(
        **TINY_PAIR, max_batch=len(MIXED), max_sessions=0, tensor_parallel=world, step_timeout_s=5
    )
    engine, _ = build_remote_engine(cfg)
    tokenizer = build_engine(cfg.draft_dir, cfg.target_dir, 1)[1]

    def requests():
        prompts = [tokenizer(f"while x{i}:")["input_ids"] for i in range(len(MIXED))]
        return [
            make_request(
                engine.limits, prompt, 24, method, k, gamma, SamplingParams(1.0), seed=30 + i
            )
            for i, (prompt, (method, k, gamma)) in enumerate(zip(prompts, MIXED, strict=True))
        ]

    steps, results = [], {}
    killed = threading.Event()

    def deliver(request_id: str):
        def on_event(event) -> None:  # on the coordinator's thread, between steps
            if isinstance(event, Emitted) and request_id == "r0":
                steps.append(len(steps))
                if len(steps) == 3:  # mid-generation: every request has tokens, none is done
                    actors = engine.draft.actors if kind == "draft" else engine.target.actors
                    _stop_process(actors[-1]) if fault == "hung" else ray.kill(actors[-1])
                    killed.set()
            if isinstance(event, Done):
                results[request_id] = event.result.token_ids

        return on_event

    coordinator = None
    try:
        undisturbed = [r.token_ids for r in engine.generate(requests())]
        coordinator = Coordinator(engine, max_queued=0)
        for i, request in enumerate(requests()):
            coordinator.submit(f"r{i}", request, deliver(f"r{i}"))
        deadline = time.time() + 120
        while len(results) < len(MIXED) and time.time() < deadline:
            time.sleep(0.1)
        assert killed.is_set() and coordinator.failure is None
        assert coordinator.stats.recoveries == 1
        got = [results.get(f"r{i}") for i in range(len(MIXED))]
        assert sum(a != b for a, b in zip(got, undisturbed, strict=True)) <= 2, got
    finally:
        if coordinator is not None:
            coordinator.close()
        stop_remote_engine(engine)


@pytest.mark.parametrize("world", [1, 2])
def test_restarted_actors_load_the_weights_their_first_ones_handed_over(service, tmp_path, world):
    """A restarted actor loads the weights its group's first actor handed to the object store
    (workers/actors.py, `_Remote.weights`), not the checkpoint: with the model directories
    gone, the draft actor and every target shard still restart, and decode the same tokens."""
    import shutil

    import ray

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.replica import build_remote_engine

    dirs = {key: tmp_path / key for key in TINY_PAIR}
    for key, path in dirs.items():
        shutil.copytree(TINY_PAIR[key], path)
    cfg = ReplicaConfig(
        **{key: str(path) for key, path in dirs.items()}, max_batch=2, max_sessions=0,
        tensor_parallel=world,
    )  # fmt: skip
    engine, _ = build_remote_engine(cfg)
    try:
        request = make_request(engine.limits, [1, 2, 3], 12, "block", 1, 3, SamplingParams(0.0))
        before = engine.generate([request])[0].token_ids
        for path in dirs.values():
            shutil.rmtree(path)
        for actor in engine.draft.actors + engine.target.actors:
            ray.kill(actor)  # asynchronous: a call sent right after may still be answered
        for actor in engine.draft.actors + engine.target.actors:
            deadline = time.time() + 30
            while time.time() < deadline:  # dead before the recovery looks
                try:
                    ray.get(actor.ready.remote(), timeout=5)
                except ray.exceptions.RayActorError:
                    break
                time.sleep(0.1)
            else:
                pytest.fail(f"{actor} still answers 30 s after ray.kill")
        engine.recover()
        assert engine.generate([request])[0].token_ids == before
    finally:
        stop_remote_engine(engine)


def test_a_restart_ends_requests_whose_feature_draft_kept_its_own_state(service, tmp_path):
    """A feature draft under a live greedy-block record runs on its own features, state that a
    rebuild from the tokens cannot reproduce (docs/verification.md, "Carried records with a
    feature draft"): when the draft actor is killed mid-generation, those requests end with
    RequestLost (UNAVAILABLE, retry) and the others finish; the replica keeps serving."""
    from pathlib import Path

    import ray

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.coordinator import Coordinator, Done, Emitted, Failed, RequestLost
    from blockspec.service.replica import build_remote_engine
    from tests.test_feature_draft import save_feature_draft

    draft = tmp_path / "draft"
    save_feature_draft(Path(TINY_PAIR["target_dir"]), draft)
    methods = ["greedy_block"] * 4 + ["block"]
    cfg = ReplicaConfig(
        draft_dir=str(draft), target_dir=TINY_PAIR["target_dir"], max_batch=len(methods),
        max_sessions=0,
    )  # fmt: skip
    engine, _ = build_remote_engine(cfg)
    outcome, killed = {}, threading.Event()

    def deliver(request_id: str):
        def on_event(event) -> None:  # on the coordinator's thread, between steps
            if isinstance(event, Emitted) and request_id == "r4" and not killed.is_set():
                lost = [a.request_id for a in engine.active if a.own_features]
                if lost:  # some request now depends on the draft's own state: kill it
                    ray.kill(engine.draft.actors[0])
                    killed.set()
            if isinstance(event, Done | Failed):
                outcome[request_id] = event

        return on_event

    coordinator = Coordinator(engine, max_queued=0)
    try:
        for i, method in enumerate(methods):
            request = make_request(
                engine.limits, [1, 2 + i, 3], 32, method, 1, 5, SamplingParams(1.0), seed=50 + i
            )
            coordinator.submit(f"r{i}", request, deliver(f"r{i}"))
        deadline = time.time() + 120
        while len(outcome) < len(methods) and time.time() < deadline:
            time.sleep(0.1)
        assert killed.is_set() and coordinator.failure is None
        assert coordinator.stats.recoveries == 1
        lost = [rid for rid, e in outcome.items() if isinstance(e, Failed)]
        assert lost and all(isinstance(outcome[rid].error, RequestLost) for rid in lost)
        assert isinstance(outcome["r4"], Done)  # block: no record, rebuilt and finished
        assert len(outcome) == len(methods)
    finally:
        coordinator.close()
        stop_remote_engine(engine)


def _kill_replica_process(service) -> None:
    """SIGKILL the Serve replica's process (Serve then starts a new one)."""
    import os
    import signal

    os.kill(service["replica"].stats.remote().result().pid, signal.SIGKILL)


@pytest.mark.slow
def test_replica_death_retries_unary_requests_and_ends_streams_with_unavailable(service):
    """A unary request whose replica dies is retried once on the replacement replica, with the
    seed the gateway drew for it, and answers what an undisturbed run answers; a stream that
    already sent chunks ends with UNAVAILABLE saying so."""
    stub = service["stub"]
    request = pb.GenerateRequest(prompt="def f(x):", max_new_tokens=300, seed=5, ignore_eos=True)
    undisturbed = stub.Generate(request, timeout=120)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(stub.Generate, request, timeout=180)
        time.sleep(1.0)  # mid-generation
        _kill_replica_process(service)
        assert list(reply.result().token_ids) == list(undisturbed.token_ids)

    stream = stub.GenerateStream(request, timeout=180)
    next(stream)  # a chunk has been sent
    _kill_replica_process(service)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "died after" in err.value.details()
    ok = stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=2), timeout=180)
    assert len(ok.token_ids) >= 1  # the replacement serves
