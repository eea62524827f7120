"""The `blockspec` command line as a client, against a fake gRPC Generator (no Ray, no model):
help shows defaults, stdout carries the generated text only, errors read `error: CODE: message`
with a nonzero exit status, the stats line says what ran, the client imports no torch/ray/
transformers, and `blockspec chat` keeps one session. tests/test_cli_live.py runs the client
against the real service."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.cli import build_parser, main
from blockspec.service.client import ClientError, Reply, config_ran, stats_line
from tests.cli_process import BLOCKSPEC

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "transformers", "ray", "numpy", "tokenizers", "safetensors", "rich"}
HEAVY |= {"pydantic", "redis", "prometheus_client", "blockspec.workers", "blockspec.loadtest"}
LIGHT_SERVICE = {"blockspec.service", "blockspec.service.cli", "blockspec.service.client"}
LIGHT_SERVICE |= {"blockspec.service.auth"}


class FakeGenerator(pb_grpc.GeneratorServicer):
    """Streams `pieces` as chunks (one token each), then a last chunk with stats; or aborts
    with `error` after them. Keeps the requests it got."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.pieces = ["Hello", ", ", "world", "!"]
        self.error: tuple[grpc.StatusCode, str] | None = None
        self.sessions = 0

    def GenerateStream(self, request, context):
        self.requests.append(request)
        for i, piece in enumerate(self.pieces):
            yield pb.GenerateChunk(text=piece, token_ids=[100 + i])
        if self.error:
            context.abort(*self.error)
        session = request.session_id
        if request.new_session:
            self.sessions += 1
            session = f"s{self.sessions}"
        stats = pb.SpeculationStats(
            target_calls=2,
            accepted_tokens=2,
            tokens_per_call=2.0,
            cached_prompt_tokens=7,
            steps_by_config={"block/1/4": 2},
        )
        yield pb.GenerateChunk(
            finish_reason=pb.FINISH_REASON_LENGTH, stats=stats, replica="r1", session_id=session
        )


@pytest.fixture
def fake():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = FakeGenerator()
    pb_grpc.add_GeneratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    server.stop(None)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "demo", "methods"])
def test_help_shows_every_options_default(command, capsys):
    parser = _subparsers(build_parser())[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and not action.required and action.dest != "help":
            assert "default" in formatter._get_help_string(action), action.option_strings
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    if command in ("generate", "chat"):
        assert "deadline per reply, seconds (default: 600.0)" in usage
        assert "(default: on)" in usage  # --stats
    if command == "serve":
        assert "(default: 50051; 0 = any free port)" in usage


def test_generate_prints_only_the_generated_text(fake, capsys):
    main(["generate", "PROMPT-TEXT", "--address", fake.address, "--seed", "3"])
    out, err = capsys.readouterr()
    assert out == "Hello, world!\n"  # no prompt echo; a newline ends the text
    assert "PROMPT-TEXT" not in err
    (request,) = fake.requests
    assert request.prompt == "PROMPT-TEXT" and request.seed == 3
    # Unset flags are not sent: the server's defaults apply.
    assert (request.method, request.k, request.gamma, request.max_new_tokens) == ("", 0, 0, 0)
    assert not request.HasField("temperature") and not request.HasField("top_p")


def test_generate_local_decodes_in_process_in_the_dtype_asked(monkeypatch, capsys):
    """`generate --local` runs the engine in this process on the pair and dtype given (int8
    here: rounded weights); the same seed prints the same text."""
    from blockspec.service import build
    from tests.live_service import TINY_PAIR

    built, real = [], build.build_engine
    monkeypatch.setattr(
        build, "build_engine", lambda *a, **kw: built.append(kw["dtype"]) or real(*a, **kw)
    )
    argv = ["generate", "def f(x):", "--local", "--draft", TINY_PAIR["draft_dir"], "--target",
            TINY_PAIR["target_dir"], "--dtype", "int8", "--max-new-tokens", "8", "--seed", "3",
            "--no-stats"]  # fmt: skip
    texts = []
    for _ in range(2):
        main(argv)
        texts.append(capsys.readouterr().out)
    assert built == ["int8", "int8"] and texts[0] == texts[1] and texts[0].strip()


def test_the_stats_line_says_what_ran_and_how_fast(fake, capsys):
    argv = ["generate", "x", "--address", fake.address, "--method", "gbv", "--k", "0"]
    main(argv)
    _, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    # What the server reports it ran, not the flags (which asked for gbv, K=0).
    assert line.startswith("[block K=1 γ=4] 4 tokens in "), line
    assert "tok/s" in line and "first token " in line
    assert "2.00 tokens/call (2 calls)" in line and "7 cached prompt tokens" in line
    assert "finish=length" in line and "replica=r1" in line
    main([*argv, "--no-stats"])
    assert capsys.readouterr().err == ""


def test_stats_line_numbers():
    stats = pb.SpeculationStats(tokens_per_call=2.5, steps_by_config={"none": 1, "gbv/2/3": 9})
    reply = Reply(tokens=20, seconds=0.5, first_token_s=0.125, finish="stop", stats=stats)
    line = stats_line(reply)
    assert line.startswith("[gbv K=2 γ=3 ×9, none ×1] 20 tokens in 0.50s (40.0 tok/s)")
    assert "first token 0.12s" in line and "finish=stop" in line
    assert config_ran({"block/1/4": 5}) == "block K=1 γ=4"
    # A server that sent no stats: the line says what the client knows.
    line = stats_line(Reply(tokens=3, seconds=1.0, finish="stop"))
    assert line == "3 tokens in 1.00s (3.0 tok/s), finish=stop"


def test_errors_go_to_stderr_as_code_and_message(fake, capsys):
    fake.error = (grpc.StatusCode.INVALID_ARGUMENT, "k: method 'block' verifies a single path")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "x", "--address", fake.address])
    assert exit_.value.code == "error: INVALID_ARGUMENT: k: method 'block' verifies a single path"
    out, _ = capsys.readouterr()
    assert out == "Hello, world!\n"  # what streamed before the error, its line ended


def test_an_unreachable_server_is_an_error_line_and_a_nonzero_status():
    code = "from service.cli import main; main(['generate', 'x', '--address', '127.0.0.1:1'])"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: UNAVAILABLE: "), done.stderr


IMPORTS = """
import json, sys
from blockspec.service.cli import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit as exit_:
        print(exit_.code, file=sys.stderr)
mods = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}
              or (m.startswith('service') and m not in {light!r}))
print(json.dumps(mods), file=sys.stderr)
"""


def test_the_client_imports_no_torch_ray_or_transformers():
    """`blockspec --help`, `generate` (help, a call, an error) and `chat` run without torch,
    Ray, transformers or numpy: a client starts in a fraction of a second."""
    argvs = [
        ["--help"],
        ["generate", "--help"],
        ["chat", "--help"],
        ["generate", "x", "--address", "127.0.0.1:1", "--timeout", "5"],
        ["chat", "--address", "127.0.0.1:1", "--timeout", "5"],
    ]
    code = IMPORTS.format(argvs=argvs, heavy=HEAVY, light=LIGHT_SERVICE)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        input="hello\n/exit\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    *lines, modules = done.stderr.strip().splitlines()
    assert json.loads(modules) == []
    assert "error: UNAVAILABLE: " in "\n".join(lines)  # both calls went out, and failed


def chat(fake, script: str, *flags: str, monkeypatch, capsys) -> tuple[str, str, int]:
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--address", fake.address, *flags])
    out, err = capsys.readouterr()
    return out, err, exit_.value.code


def test_chat_keeps_one_session_across_turns(fake, monkeypatch, capsys):
    script = "hi there\n\n  second turn  \n/exit\nnever sent\n"
    out, err, code = chat(fake, script, "--system", "be brief", monkeypatch=monkeypatch,
                          capsys=capsys)  # fmt: skip
    assert code == 0
    assert out == "Hello, world!\nHello, world!\n"
    first, second = fake.requests
    # The first turn starts a session with the system prompt and the user's message ...
    assert first.new_session and not first.session_id
    assert [(m.role, m.content) for m in first.messages] == [
        ("system", "be brief"),
        ("user", "hi there"),
    ]
    # ... later turns send its id and the next user message only.
    assert second.session_id == "s1" and not second.new_session
    assert [(m.role, m.content) for m in second.messages] == [("user", "second turn")]
    assert err.count("[block K=1 γ=4] 4 tokens in") == 2
    assert "session=s1" in err


def test_chat_commands(fake, monkeypatch, capsys):
    script = "one\n/stats\ntwo\n/new\nthree\n/stats\n/help\n/bogus\nfour\n"  # then EOF
    out, err, code = chat(fake, script, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0  # end of input leaves
    assert out == "Hello, world!\n" * 4
    one, two, three, four = fake.requests
    assert one.new_session and two.session_id == "s1"
    assert three.new_session and four.session_id == "s2"  # /new started another
    assert err.count("tokens in") == 2  # /stats turned the line off for two and three
    assert "(stats off)" in err and "(stats on)" in err and "/exit" in err  # /help
    assert "error: unknown command /bogus" in err


def test_chat_survives_an_error(fake, monkeypatch, capsys):
    fake.error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    _, err, code = chat(fake, "one\ntwo\n/exit\n", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and len(fake.requests) == 2
    assert err.count("error: RESOURCE_EXHAUSTED: queue full") == 2
    assert fake.requests[1].new_session  # no session was started: the next turn starts one


def test_client_error_reads_code_and_message():
    assert str(ClientError("UNAVAILABLE", "down")) == "error: UNAVAILABLE: down"


# Bad flags and inputs, each as a user could type it (undecodable argv bytes reach Python as
# lone surrogates, PEP 383): every one ends as `error: ...` on stderr with exit status 1.
BAD_FLAGS = [
    ["--seed", "-1"],
    ["--seed", "123456789012345678901234"],
    ["--seed", str(1 << 64)],
    ["--seed", "abc"],
    ["--k", "99999999999"],
    ["--gamma", "-99999999999"],
    ["--top-k", str(1 << 31)],
    ["--max-new-tokens", str(1 << 40)],
    ["--temperature", "hot"],
    ["--top-p", "-inf"],
    ["--timeout", "-1"],
    ["--timeout", "0"],
    ["--timeout", "nan"],
    ["--timeout", "inf"],
    ["--tls-ca", "/nonexistent/ca.pem"],
    ["--token", "a\nb"],
    ["--token", "\udcff"],
    ["--stop", "\udcff"],
    ["--method", "\udcfe"],
    ["--bogus"],
]
BAD_ADDRESSES = ["", "not an address", "127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1"]


def _bad_argvs(address: str) -> list[list[str]]:
    generate = ["generate", "hi", "--address", address]
    argvs = [[*generate, *flags] for flags in BAD_FLAGS]
    argvs += [["generate", "hi", "--address", bad] for bad in BAD_ADDRESSES]
    argvs += [["chat", "--address", address, *flags] for flags in BAD_FLAGS[:3]]
    argvs += [
        ["generate", "hi \udcff\udcfe there", "--address", address],
        [*generate, "--session", "\udcff"],
        ["chat", "--address", address, "--system", "\udcff"],
        ["generate", "--address", address],  # no prompt
        ["generate", "hi", "--local", "--address", address],
        ["generate", "hi", "--local", "--seed", "-1"],  # refused before loading a model
        [],
        ["bogus"],
    ]
    return argvs


def test_no_bad_argument_gets_a_traceback(fake, monkeypatch, capsys):
    argvs = _bad_argvs(fake.address)
    assert len(argvs) >= 30
    for argv in argvs:
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
        with pytest.raises(SystemExit) as exit_:  # any other exception fails the test
            main(argv)
        out, err = capsys.readouterr()
        code = exit_.value.code
        # SystemExit("error: ...") prints its message and exits 1; SystemExit(1) after printing.
        message = code if isinstance(code, str) else err.strip().splitlines()[-1]
        assert code == 1 or isinstance(code, str), (argv, code)
        assert message.startswith("error: ") and "Traceback" not in err, (argv, err)
        assert out == "", argv
    assert fake.requests == []  # nothing bad was sent


def test_the_client_names_the_flag_and_the_rule(fake, capsys):
    for flags, message in [
        (["--seed", "-1"], "error: --seed: must lie in [0, 2^64), got -1"),
        (["--k", str(1 << 31)], f"error: --k: must fit in 32 bits, got {1 << 31}"),
        (["--stop", "a\udcff"], "error: --stop: not valid UTF-8 (byte 0xff at offset 1)"),
        (["--timeout", "0"], "error: --timeout: must be a positive number of seconds, got 0.0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["generate", "hi", "--address", fake.address, *flags])
        assert exit_.value.code == 1
        assert capsys.readouterr().err.strip() == message


def test_undecodable_argv_bytes_are_refused_not_a_traceback(fake):
    """The real thing: bytes that are not UTF-8 on the command line of a new process."""
    argv = [b"generate", b"hi \xff\xfe there", b"--address", fake.address.encode()]
    done = subprocess.run(
        [*map(os.fsencode, BLOCKSPEC), *argv],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr == b"error: prompt: not valid UTF-8 (byte 0xff at offset 3)\n"
    assert fake.requests == []


def test_chat_refuses_an_undecodable_line_and_goes_on(fake, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"hi \xff\xfe there\nsecond\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--address", fake.address])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0 and out == "Hello, world!\n"
    assert "error: this line is not valid UTF-8 (byte 0xff at offset 3); not sent" in err
    (request,) = fake.requests  # the second line only
    assert [m.content for m in request.messages] == ["second"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("blockspec ")


def test_the_dtype_flags_offer_what_the_models_load():
    """The CLI keeps its own list of dtypes (it imports no torch); it must stay the models' and
    the config's, or a flag would offer what loading refuses, or hide what it takes."""
    from typing import get_args

    from blockspec.service.cli import DTYPES
    from blockspec.service.config import ReplicaConfig
    from blockspec.workers import models

    config = get_args(ReplicaConfig.model_fields["dtype"].annotation)
    assert set(DTYPES) == set(models.DTYPES) == set(config)
