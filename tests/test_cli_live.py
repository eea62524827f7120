"""`blockspec generate` and `blockspec chat` against the real service (the `service` fixture:
Ray, the tiny pair, the gRPC gateway): stdout is the generated text only, the stats line is
the server's, errors are `error: CODE: message`, and a chat's first turn starts a session."""

from __future__ import annotations

import io
import re
import signal
import subprocess

import pytest

from blockspec.protos import blockspec_pb2 as pb
from blockspec.service.cli import main
from tests.cli_process import BLOCKSPEC
from tests.live_service import TINY_PAIR
from tests.redis_server import free_port

pytestmark = pytest.mark.xdist_group("ray")

STATS = re.compile(
    r"^\[(?P<ran>[^\]]+)\] (?P<tokens>\d+) tokens in [\d.]+s \([\d.]+ tok/s\), "
    r"first token [\d.]+s, [\d.]+ tokens/call \(\d+ calls\), (?P<cached>\d+) cached prompt "
    r"tokens, finish=(?P<finish>length|stop), replica=\S+",
    re.MULTILINE,
)
ERROR = re.compile(r"^error: ", re.MULTILINE)  # the client's (stderr also has Ray's log lines)


def _address(service) -> str:
    return f"127.0.0.1:{service['address']['port']}"


def test_generate_prints_the_completion_and_the_servers_stats(service, capsys):
    argv = ["generate", "def f(x):", "--address", _address(service), "--seed", "1"]
    main([*argv, "--max-new-tokens", "12", "--temperature", "0", "--method", "gbv"])
    out, err = capsys.readouterr()
    ref = service["stub"].Generate(
        pb.GenerateRequest(
            prompt="def f(x):", max_new_tokens=12, temperature=0, seed=1, method="gbv"
        )
    )
    assert out == ref.text + ("" if ref.text.endswith("\n") else "\n")  # no prompt echo
    stats = STATS.search(err)
    assert stats, err
    assert stats["ran"] == "gbv K=1 γ=4" and int(stats["tokens"]) == len(ref.token_ids)


def test_a_reply_cut_by_a_stop_string_prints_the_whole_stats_line(service, capsys):
    argv = ["generate", "def f(x):", "--address", _address(service), "--seed", "1"]
    argv += ["--max-new-tokens", "12", "--temperature", "0", "--method", "gbv"]
    main(argv)
    whole, _ = capsys.readouterr()
    stop = whole.strip()[len(whole.strip()) // 2]  # a character from its middle
    main([*argv, "--stop", stop])
    out, err = capsys.readouterr()
    stats = STATS.search(err)
    assert stats, err
    assert stats["ran"] == "gbv K=1 γ=4" and stats["finish"] == "stop"
    assert out.rstrip("\n") == whole[: whole.index(stop)].rstrip("\n")


def test_generate_refusal_is_an_error_line(service, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "x", "--address", _address(service), "--method", "block", "--k", "3"])
    assert str(exit_.value.code).startswith("error: INVALID_ARGUMENT: k: ")
    assert capsys.readouterr().out == ""


def test_chat_first_turn_starts_a_session_then_exit(service, monkeypatch, capsys):
    script = "Say hi.\n/exit\nnot sent\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    argv = ["chat", "--address", _address(service), "--system", "Be brief."]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--max-new-tokens", "6", "--seed", "2"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0
    assert not ERROR.search(err), err
    stats = STATS.search(err)
    assert stats and int(stats["tokens"]) >= 1, err
    assert re.search(r"replica=\S+, session=[0-9a-f]{32}$", err, re.M), err  # the server's id
    assert out.endswith("\n") and out.count("\n") >= 1


def test_chat_second_turn_continues_the_session(service, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\nAnd again.\n"))  # then EOF
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--address", _address(service), "--max-new-tokens", "6", "--seed", "2"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0
    assert not ERROR.search(err), err
    assert len(STATS.findall(err)) == 2 and out.count("\n") >= 2
    sessions = re.findall(r"session=([0-9a-f]{32})", err)
    assert len(sessions) == 2 and sessions[0] == sessions[1]


@pytest.mark.slow  # a Ray cluster of its own: ~30 s
def test_serve_answers_then_stops_cleanly_on_ctrl_c():
    """`blockspec serve` as a user runs it: it says where it listens, answers, and on Ctrl-C
    drains and exits 0 without Ray reporting failed tasks (as serve.shutdown() made it do)."""
    http = free_port()
    argv = ["serve", "--port", "0", "--http-port", str(http), "--metrics-port", "0"]
    argv += ["--draft", TINY_PAIR["draft_dir"], "--target", TINY_PAIR["target_dir"]]
    server = subprocess.Popen(
        [*BLOCKSPEC, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if line.startswith("blockspec serving"):
                break
        ready = re.search(r"gRPC on 127\.0\.0\.1:(\d+), OpenAI HTTP on 127\.0\.0\.1:(\d+)", line)
        assert ready and int(ready[2]) == http, "".join(lines)
        generate = ["generate", "x", "--address", f"127.0.0.1:{ready[1]}", "--max-new-tokens=3"]
        done = subprocess.run(
            [*BLOCKSPEC, *generate],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and "finish=length" in done.stderr, done.stderr
        server.send_signal(signal.SIGINT)
        rest, _ = server.communicate(timeout=120)
    finally:
        server.kill()
    assert server.returncode == 0, rest
    assert "draining..." in rest and "failed" not in rest, rest
