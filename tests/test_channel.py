"""The replica's links (workers/channel.py): what a message keeps, how a link fails, how fast
a multi-frame message comes back, and that a waiting reader spins nothing."""

from __future__ import annotations

import resource
import statistics
import threading
import time
from multiprocessing import AuthenticationError

import pytest
import torch

from blockspec.workers import channel


@pytest.fixture()
def pair():
    """(our end, the echoing peer's listener thread) over loopback."""
    key = channel.new_key()
    listener = channel.listen(channel.LOOPBACK, key)

    def echo() -> None:
        link = channel.accept(listener, {"test"})["test"]
        try:
            while True:
                message = link.recv()
                if message == "close":
                    break
                if not (isinstance(message, tuple) and message[0] == "posted"):  # unanswered
                    link.send(message)
        except channel.LinkBroken:
            pass
        link.close()

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    link = channel.dial(listener.address, key, "test")
    yield link, thread
    link.close()
    listener.close()


def test_tensors_arrive_equal_writable_and_on_the_host():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    message = dict(
        f32=base,
        bf16=base.to(torch.bfloat16),
        i64=torch.tensor([[1, -2], [3, 2**40]]),
        strided=base.t(),  # not contiguous
        empty=torch.zeros(0, 3),
        scalar=torch.tensor(7),
        other=[1, "two", (3.0, None)],
    )
    out = channel.loads(channel.dumps(message))
    for name, t in message.items():
        if isinstance(t, torch.Tensor):
            assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
            assert torch.equal(out[name], t), name
            out[name].add_(1)  # writable: the receiver's own memory
    assert out["other"] == message["other"]
    assert torch.equal(message["f32"], base)  # the sender's tensor is untouched


def test_a_message_crosses_a_link_and_its_large_buffer_travels_out_of_band(pair):
    link, _ = pair
    rows = torch.rand(2, 2, 4, 8192)  # 512 KiB: q rows of two requests
    frames = channel.dumps(("step", rows))
    assert len(frames[0]) < 1024  # the pickle holds no tensor bytes: they follow it as they lie
    assert memoryview(frames[-1]).nbytes == rows.numel() * 4
    link.send(("step", rows))
    op, back = link.recv(timeout_s=10)
    assert op == "step" and torch.equal(back, rows)
    assert back.data_ptr() % 16 == 0  # a view of the message, aligned for any dtype


def test_a_message_of_many_tensors_arrives_whole(pair):
    """Past what one sendmsg call takes (1,024 frames on Linux): a step's carries at batch 256
    are that many tensors. The small ones travel inside the pickle, still writable."""
    link, _ = pair
    message = [torch.full((3,), i) for i in range(3000)] + [torch.rand(2048) for _ in range(1500)]
    assert len(channel.dumps(message)) > 1500
    link.send(message)
    back = link.recv(timeout_s=30)
    assert all(torch.equal(a, b) for a, b in zip(back, message, strict=True))
    back[0].add_(1)


def test_a_message_larger_than_the_sockets_buffer_arrives_whole(pair):
    """Written with one sendmsg call that the kernel takes in parts, read in parts."""
    link, _ = pair
    message = (torch.arange(5), torch.rand(4 << 20), torch.ones(3, dtype=torch.bfloat16))
    link.send(message)
    back = link.recv(timeout_s=30)
    assert all(torch.equal(a, b) for a, b in zip(back, message, strict=True))


def test_messages_after_unanswered_ones_go_without_nagles_delay(pair):
    """Posted messages (no reply) then a step, as the coordinator sends them: with Nagle's
    algorithm on, a write that follows an unacknowledged one waits for the peer's delayed ACK
    (~40 ms on Linux), and the step's round trip takes that long."""
    link, _ = pair
    posted = ("posted", torch.zeros(4), torch.ones(1250))
    laps = []
    for _ in range(30):
        start = time.perf_counter()
        link.send(posted)
        link.send(posted)
        link.send("step")
        link.recv(timeout_s=10)
        laps.append(time.perf_counter() - start)
    assert statistics.median(laps) < 0.01, laps


def test_a_closed_peer_breaks_the_link_and_silence_times_out(pair):
    link, thread = pair
    with pytest.raises(channel.LinkTimedOut):
        link.recv(timeout_s=0.2)
    link.send("close")
    thread.join(timeout=10)
    with pytest.raises(channel.LinkBroken, match=r"^receiving: EOFError\('the other end closed"):
        link.recv(timeout_s=10)


def test_a_wrong_key_is_refused():
    listener = channel.listen(channel.LOOPBACK, channel.new_key())
    refused = []

    def accept() -> None:
        try:
            listener.accept()
        except AuthenticationError as exc:
            refused.append(exc)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    with pytest.raises(AuthenticationError):
        channel.dial(listener.address, channel.new_key(), "intruder")
    thread.join(timeout=10)
    listener.close()
    assert refused


def test_a_reader_waiting_on_a_link_spins_nothing(pair):
    """The peer's thread blocks in the kernel while nothing arrives (this process's CPU time
    over a second of waiting stays near zero)."""
    link, _ = pair
    link.send("warm")
    link.recv(timeout_s=10)
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert used < 0.1, used


def test_shared_rows_cross_a_process_and_leave_nothing_in_dev_shm():
    """The draft's q through shared memory: what the reader (a process of its own, as rank 0
    is) gets is the writer's tensor, written again into the same segment or into a grown one
    that the reader follows; the segment's name is gone once the reader has mapped it, so a
    killed writer or reader leaks nothing."""
    import multiprocessing as mp
    from pathlib import Path

    def named(ref) -> bool:
        return (Path("/dev/shm") / ref.segment.lstrip("/")).exists()

    writer = channel.SharedWriter()
    with mp.get_context("spawn").Pool(1) as pool:
        segments = set()
        for shape in [(1, 1, 4, 8192), (1, 2, 4, 8192), (16, 2, 4, 8192)]:  # the last: 4 MiB
            rows = torch.rand(shape)
            ref = writer.put(rows)
            assert named(ref) == (ref.segment not in segments)  # until the reader maps it
            segments.add(ref.segment)
            assert torch.equal(pool.apply(_read_in_another_process, (ref,)), rows)
            assert not named(ref)
        assert len(segments) == 2  # the second fit the first segment; the third grew it
    first, grown = writer.put(torch.zeros(1)), writer.put(torch.zeros(1 << 21))
    assert first.segment != grown.segment and not named(first)  # the writer moved on
    writer.close()
    assert not named(grown)


_READER = None


def _read_in_another_process(ref):
    global _READER
    if _READER is None:  # a tracker of its own, as each Ray actor has (not the parent's)
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker = resource_tracker.ResourceTracker()
        _READER = channel.SharedReader()
    return _READER.get(ref)
