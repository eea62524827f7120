"""How fast the `blockspec` client starts: median wall seconds over N fresh processes of

- `blockspec --help` and `blockspec generate --help`,
- importing the command line (`import blockspec.service.cli`),
- `blockspec generate x --address ...` up to the moment the server receives the request (time
  to first byte sent) and to its exit, against a fake Generator in this process that answers
  at once (so the numbers are the client's own: interpreter, imports, channel, one call).

Each process runs `from blockspec.service.cli import main; main()` as the `blockspec` console
script does, with the interpreter given (`--python`, default this one) and the blockspec it
imports.

    blockspec-bench client-start --runs 10 [--python /other/venv/bin/python]
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

from blockspec.loadtest.bench.harness import parser, spread
from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc

CONSOLE_SCRIPT = "from blockspec.service.cli import main; main()"


class Fake(pb_grpc.GeneratorServicer):
    """Notes when each request arrives and answers with one chunk and the stats."""

    def __init__(self):
        self.arrived: list[float] = []
        self.event = threading.Event()

    def GenerateStream(self, request, context):
        self.arrived.append(time.perf_counter())
        self.event.set()
        stats = pb.SpeculationStats(target_calls=1, tokens_per_call=1.0)
        stats.steps_by_config["block/1/4"] = 1
        yield pb.GenerateChunk(text="ok", token_ids=[1])
        yield pb.GenerateChunk(finish_reason=pb.FINISH_REASON_LENGTH, stats=stats)


def run(python: str, args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([python, *args], check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = parser("client-start", __doc__)
    ap.add_argument("--runs", type=int, default=10, help="processes per measurement")
    ap.add_argument("--python", default=sys.executable, help="interpreter")
    args = ap.parse_args(argv)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    fake = Fake()
    pb_grpc.add_GeneratorServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def first_byte() -> tuple[float, float]:
        fake.event.clear()
        argv = ["-c", CONSOLE_SCRIPT, "generate", "x", "--address", f"127.0.0.1:{port}"]
        start = time.perf_counter()
        proc = subprocess.Popen(
            [args.python, *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, err = proc.communicate(timeout=120)
        end = time.perf_counter()
        if proc.returncode or not fake.event.is_set():
            raise SystemExit(f"generate failed ({proc.returncode}): {err.decode()}")
        return fake.arrived[-1] - start, end - start

    cases = {
        "python -c pass (interpreter alone)": ["-c", "pass"],
        "import blockspec.service.cli": ["-c", "import blockspec.service.cli"],
        "blockspec --help": ["-c", CONSOLE_SCRIPT, "--help"],
        "blockspec generate --help": ["-c", CONSOLE_SCRIPT, "generate", "--help"],
    }
    results = {
        name: [run(args.python, argv) for _ in range(args.runs)] for name, argv in cases.items()
    }
    calls = [first_byte() for _ in range(args.runs)]
    results["blockspec generate: first byte at the server"] = [c[0] for c in calls]
    results["blockspec generate: whole call (exit)"] = [c[1] for c in calls]
    server.stop(None)

    print(f"{args.python}, {args.runs} runs each, median (range) seconds")
    for name, seconds in results.items():
        print(f"  {name:46s} {spread(seconds, digits=3)}")
