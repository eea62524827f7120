"""The gRPC client behind `blockspec generate --address` and `blockspec chat`.

Thin on purpose: it imports grpc, the generated protos and the standard library only (no torch,
transformers, ray or numpy, none of which a client needs), so a call starts sending within a
few hundred milliseconds (tests/test_cli.py checks the imports; blockspec-bench client-start
times them).

What it prints: stdout carries the generated text only (never the prompt); stderr carries the
stats line of each reply and errors, as ``error: CODE: message``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

import grpc

from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.auth import bearer, client_channel

# Sampling and method fields a request may set; None (the flag's default) leaves the field
# unset: the server's default then applies (Info tells which).
REQUEST_FIELDS = ("max_new_tokens", "method", "k", "gamma", "temperature", "top_k", "top_p")

CHAT_HELP = """commands:
  /new     start a new conversation (the --system prompt is kept)
  /stats   show or hide the stats line after each reply
  /help    this list
  /exit    leave (also /quit, Ctrl-D)
Ctrl-C stops a reply as it streams; at the prompt it leaves."""


class ClientError(Exception):
    """A call that failed: the gRPC status code's name and the server's message."""

    def __init__(self, code: str, message: str):
        super().__init__(code, message)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return f"error: {self.code}: {self.message}"


@dataclass
class Reply:
    """One streamed completion as the client saw it."""

    text: str = ""
    tokens: int = 0  # token ids received
    first_token_s: float | None = None  # send -> first chunk carrying tokens or text
    seconds: float = 0.0  # send -> last chunk
    finish: str = ""
    stats: pb.SpeculationStats | None = None  # None: the server sent none
    replica: str = ""
    session_id: str = ""
    chunks: list[str] = field(default_factory=list)


class UsageError(Exception):
    """A flag or an input line that cannot be sent: printed as ``error: message``."""

    def __str__(self) -> str:
        return f"error: {self.args[0]}"


# What the wire can carry (protos/blockspec.proto): a value outside is refused before sending,
# in the server's words where the server has a bound (the seed's); the server judges the rest.
INT32 = (-(1 << 31), 1 << 31, "must fit in 32 bits")
WIRE_RANGES = {
    "seed": (0, 1 << 64, "must lie in [0, 2^64)"),
    **dict.fromkeys(("max_new_tokens", "k", "gamma", "top_k"), INT32),
}
# The text flags, as the user wrote them (the prompt is positional).
TEXT_FLAGS = ("prompt", "system", "stop", "session", "method", "address", "token", "tls_ca")


def flag_name(attribute: str) -> str:
    return attribute if attribute == "prompt" else "--" + attribute.replace("_", "-")


def utf8_fault(text: str) -> str | None:
    """Why `text` is not UTF-8 text, or None. Python hands over undecodable bytes of argv and
    stdin as lone surrogates (PEP 383); protobuf strings (and JSON) carry UTF-8 only. Refused
    rather than replaced: a U+FFFD would send a prompt other than the one given."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})"
        return "not valid UTF-8 (a lone surrogate)"


def address_fault(address: str) -> str | None:
    """Why `address` is no HOST:PORT, or None (a gRPC target with a scheme, such as
    `unix:/path` or `dns:///host:port`, is left to gRPC)."""
    if address.startswith("unix:") or "://" in address:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"must be HOST:PORT with a port in 1..65535, got {address!r}"
    return None


def check_args(args) -> None:
    """Refuse (UsageError) the flags that could not be sent: a number the wire cannot carry,
    text that is not UTF-8, a timeout that is not a positive number of seconds."""
    for name, (low, high, rule) in WIRE_RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not low <= value < high:
            raise UsageError(f"{flag_name(name)}: {rule}, got {value}")
    for name in TEXT_FLAGS:
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            fault = isinstance(value, str) and utf8_fault(value)
            if fault:
                raise UsageError(f"{flag_name(name)}: {fault}")
    address = getattr(args, "address", None)
    if address is not None and (fault := address_fault(address)):
        raise UsageError(f"--address: {fault}")
    token = getattr(args, "token", None) or os.environ.get("BLOCKSPEC_TOKEN")
    if token and not all(" " <= c <= "~" for c in token):  # an HTTP/2 header's characters
        raise UsageError("--token (or $BLOCKSPEC_TOKEN): must be printable ASCII")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout < float("inf"):
        raise UsageError(f"--timeout: must be a positive number of seconds, got {timeout}")


def request_fields(args) -> dict:
    """The GenerateRequest fields the flags set (flags left at None are not sent)."""
    fields = {name: getattr(args, name) for name in REQUEST_FIELDS}
    fields = {name: value for name, value in fields.items() if value is not None}
    if args.seed is not None:
        fields["seed"] = args.seed
    if args.stop:
        fields["stop"] = list(args.stop)
    return fields


class Client:
    """A channel to a running service, with the caller's credentials."""

    def __init__(self, address: str, tls_ca: str | None = None, token: str | None = None):
        try:
            self.channel = client_channel(address, tls_ca)
        except OSError as err:
            raise UsageError(f"--tls-ca: cannot read {tls_ca}: {err.strerror}") from None
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.metadata = bearer(token or os.environ.get("BLOCKSPEC_TOKEN"))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, request: pb.GenerateRequest, timeout: float | None, out=None) -> Reply:
        """Stream `request`, writing each chunk's text to `out` as it arrives (None: don't).
        Raises ClientError when the call fails (text already written stays written); Ctrl-C
        cancels the call and propagates."""
        reply = Reply()
        start = time.perf_counter()
        call = self.stub.GenerateStream(request, timeout=timeout, metadata=self.metadata)
        try:
            for chunk in call:
                if chunk.text or chunk.token_ids:
                    if reply.first_token_s is None:
                        reply.first_token_s = time.perf_counter() - start
                    reply.tokens += len(chunk.token_ids)
                if chunk.text:
                    reply.chunks.append(chunk.text)
                    if out is not None:
                        out.write(chunk.text)
                        out.flush()
                if chunk.finish_reason:
                    reply.finish = pb.FinishReason.Name(chunk.finish_reason)
                    reply.finish = reply.finish.removeprefix("FINISH_REASON_").lower()
                    reply.stats = chunk.stats if chunk.HasField("stats") else None
                    reply.replica, reply.session_id = chunk.replica, chunk.session_id
        except grpc.RpcError as err:
            raise ClientError(err.code().name, err.details() or "") from None
        except KeyboardInterrupt:
            call.cancel()
            raise
        reply.seconds = time.perf_counter() - start
        reply.text = "".join(reply.chunks)
        return reply


def config_ran(steps_by_config) -> str:
    """What ran, as the server reports it: each configuration ("none" or method/K/γ) with its
    steps, most steps first."""
    ran = sorted(steps_by_config.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = []
    for config, steps in ran:
        method, *shape = config.split("/")
        name = f"{method} K={shape[0]} γ={shape[1]}" if len(shape) == 2 else config
        parts.append(f"{name} ×{steps}" if len(ran) > 1 else name)
    return ", ".join(parts)


def stats_line(reply: Reply) -> str:
    """`[what ran] N tokens in S s (T tok/s), first token F s, E tokens/call, ...`."""
    rate = reply.tokens / reply.seconds if reply.seconds > 0 else 0.0
    parts = [f"{reply.tokens} tokens in {reply.seconds:.2f}s ({rate:.1f} tok/s)"]
    if reply.first_token_s is not None:  # unknown without a stream (generate --local)
        parts.append(f"first token {reply.first_token_s:.2f}s")
    stats = reply.stats
    head = ""
    if stats is not None:
        head = f"[{config_ran(stats.steps_by_config) or '?'}] "
        parts.append(f"{stats.tokens_per_call:.2f} tokens/call ({stats.target_calls} calls)")
        parts.append(f"{stats.cached_prompt_tokens} cached prompt tokens")
    parts.append(f"finish={reply.finish or '?'}")
    if reply.replica:
        parts.append(f"replica={reply.replica}")
    if reply.session_id:
        parts.append(f"session={reply.session_id}")
    return head + ", ".join(parts)


def _end_line(text: str) -> None:
    """Streamed text ends with a newline on stdout (added when the text has none)."""
    if text and not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()


def generate(args) -> None:
    """`blockspec generate --address`: stream one completion to stdout."""
    if args.chat:
        prompt = dict(messages=[pb.ChatMessage(role="user", content=args.prompt)])
    else:
        prompt = dict(prompt=args.prompt)
    request = pb.GenerateRequest(**prompt, **request_fields(args), session_id=args.session or "")
    with Client(args.address, args.tls_ca, args.token) as client:
        written: list[str] = []
        out = _Tee(sys.stdout, written)
        try:
            reply = client.stream(request, args.timeout, out=out)
        except ClientError as err:
            _end_line("".join(written))
            raise SystemExit(str(err)) from None
        except KeyboardInterrupt:
            _end_line("".join(written))
            raise SystemExit(130) from None
    _end_line(reply.text)
    if args.stats:
        print(stats_line(reply), file=sys.stderr, flush=True)


class _Tee:
    """A stream that also remembers what was written (to end the line after an error)."""

    def __init__(self, stream, into: list[str]):
        self.stream, self.into = stream, into

    def write(self, text: str) -> None:
        self.into.append(text)
        self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _read_line(prompt: str) -> str | None:
    """The next input line (None at end of input); bytes that are not UTF-8 arrive as lone
    surrogates (stdin is set to surrogateescape), for `utf8_fault` to refuse."""
    try:
        return input(prompt)
    except EOFError:
        return None


def _tolerant_stdin() -> None:
    """Undecodable input bytes reach the chat loop instead of failing inside input()."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)  # a TextIOWrapper's (not a StringIO)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


def chat(args) -> int:
    """`blockspec chat`: a conversation in one server-side session. The first turn starts it
    (new_session, the --system prompt and the user's message); each later turn sends the
    session id and the next user message; the server keeps the history and its KV cache."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    _tolerant_stdin()
    interactive = sys.stdin.isatty()
    prompt = "> " if interactive else ""
    show_stats = args.stats
    session = ""  # the server's id once the first turn has been answered
    if interactive:
        print(f"blockspec chat with {args.address}; /help for commands", file=sys.stderr)
    with Client(args.address, args.tls_ca, args.token) as client:
        while True:
            try:
                line = _read_line(prompt)
            except KeyboardInterrupt:
                line = None
            if line is None:  # Ctrl-D / end of the script
                if interactive:
                    print(file=sys.stderr)
                return 0
            text = line.strip()
            if not text:
                continue
            fault = utf8_fault(text)
            if fault:
                print(f"error: this line is {fault}; not sent", file=sys.stderr, flush=True)
                continue
            if text.startswith("/"):
                command = text.split()[0].lower()
                if command in ("/exit", "/quit"):
                    return 0
                if command == "/new":
                    session = ""
                    print("(new conversation)", file=sys.stderr, flush=True)
                elif command == "/stats":
                    show_stats = not show_stats
                    print(f"(stats {'on' if show_stats else 'off'})", file=sys.stderr, flush=True)
                elif command == "/help":
                    print(CHAT_HELP, file=sys.stderr, flush=True)
                else:
                    print(f"error: unknown command {command} (/help)", file=sys.stderr, flush=True)
                continue
            messages = [pb.ChatMessage(role="user", content=text)]
            if not session and args.system:
                messages.insert(0, pb.ChatMessage(role="system", content=args.system))
            request = pb.GenerateRequest(
                messages=messages,
                session_id=session,
                new_session=not session,
                **request_fields(args),
            )
            written: list[str] = []
            try:
                reply = client.stream(request, args.timeout, out=_Tee(sys.stdout, written))
            except ClientError as err:
                _end_line("".join(written))
                print(err, file=sys.stderr, flush=True)
                continue
            except KeyboardInterrupt:
                _end_line("".join(written))
                print("(stopped)", file=sys.stderr, flush=True)
                continue
            _end_line(reply.text)
            session = reply.session_id or session
            if show_stats:
                print(stats_line(reply), file=sys.stderr, flush=True)
