"""A replica's per-step traffic: persistent, authenticated sockets between its processes.

Ray starts, places, restarts and scales the actors; once they run, each decode step's messages
(coordinator → draft → target ranks → coordinator) go over links set up once, not as Ray task
calls: of Ray's calls, a Ray Compiled Graph (whose readers spin while idle) and a gloo group,
these sockets pass a step's chain fastest (`blockspec-bench bounds --floor`; the table and the
argument: docs/service_benchmark.md, "Why links and not Ray calls").

A link is a `multiprocessing.connection` socket (HMAC-authenticated with a key the coordinator
draws per wiring; loopback when every process of the replica shares a node). A message is one
pickle (protocol 5) whose tensors travel out of band: as numpy buffers (bf16 as its int16 bits)
sent as they lie in memory and received into writable memory, arriving on the host. A message
goes out in one write (its reader wakes once for it) and reads block in the kernel: an idle
replica spins nothing.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import socket
import struct
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Client, Connection, Listener, wait

import numpy as np
import torch

LOOPBACK = "127.0.0.1"


class LinkBroken(ConnectionError):
    """The process at the other end is gone (it died, or closed the link)."""


class LinkTimedOut(TimeoutError):
    """Nothing arrived in time: the process at the other end is alive but stuck, or slow."""


def tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A tensor as our processes send it, on links and in Ray's calls: a numpy array (bf16 as
    its int16 bits, numpy has no bf16) and its dtype's tag. Torch's own pickling goes through
    torch.save, ~50 µs a tensor each way; numpy takes ~10 µs."""
    t = t.detach()
    t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), ""


def tensor_from_wire(payload: tuple[np.ndarray, str]) -> torch.Tensor:
    """tensor_to_wire's inverse, on the host; the receiver's own, writable memory."""
    array, dtype = payload
    if not array.flags.writeable:  # in-band (small, or strided), or Ray's shared store
        array = array.copy()
    t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        return tensor_from_wire, (tensor_to_wire(obj),)


_ALIGN = 64  # each out-of-band buffer starts this far into a message: aligned for any dtype
_IN_BAND = 4096  # smaller buffers go inside the pickle: a step's many small tensors, one frame
_IOV_MAX = 512  # frames per sendmsg call (Linux takes at most 1024)


def dumps(obj) -> list:
    """One message's frames, as they go out in one write: the layout (the buffers' offsets and
    sizes), the pickle, then its out-of-band buffers, each after the padding that aligns it."""
    buffers: list[pickle.PickleBuffer] = []

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        if memoryview(buffer).nbytes < _IN_BAND:
            return True
        buffers.append(buffer)
        return False

    body = io.BytesIO()
    _Pickler(body, protocol=5, buffer_callback=in_band).dump(obj)
    raws = [b.raw() for b in buffers]
    pickled = body.getvalue()
    offset = struct.calcsize(f"<I{2 * len(raws)}Q") + len(pickled)
    frames, layout = [b""], []  # frame 0, the head, is set once the offsets are known
    for raw in raws:
        pad = -offset % _ALIGN
        if pad:
            frames.append(bytes(pad))
        offset += pad
        layout += [offset, raw.nbytes]
        frames.append(raw)
        offset += raw.nbytes
    frames[0] = struct.pack(f"<I{len(layout)}Q", len(raws), *layout) + pickled
    return frames


def _parse(message: bytearray) -> object:
    """dumps' inverse over one received message; the buffers are views of it (writable)."""
    (count,) = struct.unpack_from("<I", message)
    layout = struct.unpack_from(f"<{2 * count}Q", message, 4)
    start = 4 + 16 * count
    end = layout[0] if count else len(message)
    view = memoryview(message)
    buffers = [view[o : o + n] for o, n in zip(layout[::2], layout[1::2], strict=True)]
    return pickle.loads(view[start:end], buffers=buffers)


def loads(frames: list) -> object:
    """What `dumps` framed (the test suite's wire without a socket)."""
    return _parse(bytearray(b"".join(frames)))


class Link:
    """One end of a duplex, ordered message link to another process.

    A message is its length (8 bytes), then dumps' frames, written with one `sendmsg` and read
    with two reads: the reader wakes once per message, not once per frame."""

    def __init__(self, connection: Connection):
        self.connection = connection  # authenticated; its own framing is not used past that
        self._socket = socket.socket(fileno=os.dup(connection.fileno()))
        if self._socket.family in (socket.AF_INET, socket.AF_INET6):
            # Without TCP_NODELAY, Nagle's algorithm holds a write that follows an unacked one
            # until the peer's delayed ACK, ~40 ms.
            self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, obj) -> None:
        self.send_frames(dumps(obj))

    def send_frames(self, frames: list) -> None:
        """Send a message framed once (`dumps`), as to each rank of a group."""
        size = sum(memoryview(f).nbytes for f in frames)
        parts = [memoryview(struct.pack("<Q", size)), *(memoryview(f).cast("B") for f in frames)]
        try:
            while parts:
                sent = self._socket.sendmsg(parts[:_IOV_MAX])
                while parts and sent >= parts[0].nbytes:
                    sent -= parts.pop(0).nbytes
                if sent:
                    parts[0] = parts[0][sent:]
        except (OSError, ValueError) as exc:  # ValueError: this end was closed
            raise LinkBroken(f"sending: {exc!r}") from None

    def recv(self, timeout_s: float | None = None):
        """The next message; raises LinkTimedOut when none arrives within timeout_s."""
        try:
            waiting = timeout_s is None or self.connection.poll(timeout_s)
        except (OSError, ValueError) as exc:
            raise LinkBroken(f"receiving: {exc!r}") from None
        if not waiting:  # (a TimeoutError is an OSError: raised outside the handler)
            raise LinkTimedOut(f"nothing arrived in {timeout_s:.1f} s")
        try:
            (size,) = struct.unpack("<Q", self._read(bytearray(8)))
            message = self._read(bytearray(size))
        except (EOFError, OSError, ValueError) as exc:
            raise LinkBroken(f"receiving: {exc!r}") from None
        return _parse(message)

    def _read(self, into: bytearray) -> bytearray:
        view, got = memoryview(into), 0
        while got < len(into):
            n = self._socket.recv_into(view[got:])
            if n == 0:
                raise EOFError("the other end closed the link")
            got += n
        return into

    def close(self) -> None:
        self._socket.close()
        self.connection.close()


def ready(links: list[Link], timeout_s: float | None) -> list[Link]:
    """The links with a message waiting (blocks until one has, or timeout_s: then [])."""
    by_connection = {link.connection: link for link in links}
    return [by_connection[c] for c in wait(list(by_connection), timeout_s)]


def new_key() -> bytes:
    """A wiring's authentication key (HMAC, multiprocessing.connection's handshake)."""
    return os.urandom(32)


def listen(host: str, key: bytes) -> Listener:
    """A listener on an ephemeral port of host (its `.address` is what peers dial)."""
    return Listener((host, 0), authkey=key, backlog=16)


def accept(listener: Listener, names: set[str]) -> dict[str, Link]:
    """Accept one link per name; each dialer says its name first (`dial`)."""
    links: dict[str, Link] = {}
    while set(links) != names:
        link = Link(listener.accept())
        links[link.recv()] = link
    return links


def dial(address: tuple[str, int], key: bytes, name: str, timeout_s: float = 30.0) -> Link:
    """Connect to a listener, retrying while it is not yet there, and say who we are."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            link = Link(Client(tuple(address), authkey=key))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    link.send(name)
    return link


@dataclass(frozen=True)
class SharedTensor:
    """Where a tensor lies in a shared-memory segment of this node: what a link carries
    instead of its bytes (`SharedWriter`, `SharedReader`)."""

    segment: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class SharedWriter:
    """One process's outgoing tensor (the draft's rows q) in a shared-memory segment that a
    reader on the same node maps: one copy in, none through a socket. The segment is reused
    message after message (grown when a tensor does not fit), so the writer may write again
    only once the reader is done with the last one: the step's order guarantees it (the next
    proposal comes after rank 0's reply).

    Its name is unlinked as soon as the reader has mapped it (or when the writer moves on):
    the memory then lives exactly as long as the two mappings, and a process killed with
    SIGKILL (Ray kills an actor's resource tracker with it) leaves nothing in /dev/shm."""

    def __init__(self) -> None:
        self._segment: shared_memory.SharedMemory | None = None

    def put(self, t: torch.Tensor) -> SharedTensor:
        t = t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        if self._segment is None or self._segment.size < nbytes:
            self.close()
            self._segment = shared_memory.SharedMemory(create=True, size=max(nbytes, 1 << 20))
        view = torch.frombuffer(self._segment.buf, dtype=t.dtype, count=t.numel())
        view.copy_(t.reshape(-1))
        return SharedTensor(self._segment.name, tuple(t.shape), t.dtype)

    def close(self) -> None:
        """Unmap the segment (and unlink its name if no reader has yet)."""
        if self._segment is not None:
            self._segment.close()
            try:
                self._segment.unlink()
            except FileNotFoundError:  # the reader did: what this process's tracker holds goes
                resource_tracker.unregister(self._segment._name, "shared_memory")
            self._segment = None


class SharedReader:
    """The reading side of a SharedWriter: maps its current segment (unlinking its name, see
    there), returns a copy."""

    def __init__(self) -> None:
        self._segment: shared_memory.SharedMemory | None = None

    def get(self, ref: SharedTensor) -> torch.Tensor:
        if self._segment is None or self._segment.name != ref.segment:
            self.close()
            self._segment = shared_memory.SharedMemory(name=ref.segment)
            self._segment.unlink()
        count = math.prod(ref.shape)
        view = torch.frombuffer(self._segment.buf, dtype=ref.dtype, count=count)
        return view.reshape(ref.shape).clone()

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
