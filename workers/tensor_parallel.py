"""Tensor-parallel target: one target model split over N ranks of a ``torch.distributed`` group.

Rank 0 lives in the calling process and drives; ranks 1..N-1 are spawned worker processes. Every
rank holds a Megatron shard of the target (``Llama(spec, state, rank, world)``: its heads and
its slice of the MLP, cut by ``workers.llama.CheckpointShard``) and a KV cache of its own kv
heads, wrapped in an ordinary :class:`TargetWorker`. The ranks run the same worker ops in
lockstep: rank 0 sends each op and its arguments to every worker, then runs it itself; the
all-reduces inside the forward pass keep the ranks together. Only rank 0's results are used
(every rank computes full logits, since lm_head is not sharded).

The parts know nothing about processes, so a rank can live in a spawned process or in a Ray
actor (workers/actors.py): :func:`join_group` (rendezvous), :class:`TargetShard` (load one
rank's shard, run an op) and :func:`serve` (a command loop over any ``recv`` callable); only
:class:`TensorParallelTarget` spawns.

Loopback only: the rendezvous store listens on a socket that we bind to 127.0.0.1 ourselves
(``TCPStore``'s own server would listen on every interface), and every rank sets
``GLOO_SOCKET_IFNAME=lo`` / ``NCCL_SOCKET_IFNAME=lo`` before joining, so the backend's own
connections stay on loopback too. A process belongs to one group at a time (the default one):
one tensor-parallel target per process, as with one Ray actor per rank.

Commands travel over a pipe per worker rather than as a collective: a worker idling between
requests would otherwise hit the group's collective timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from blockspec.workers.compiled import DEFAULT_FORWARDS, DecodeForwards
from blockspec.workers.draft import padding_groups
from blockspec.workers.feature_draft import feed_draft
from blockspec.workers.llama import LlamaSpec
from blockspec.workers.models import DTYPES, LoadedModel, load_model
from blockspec.workers.protocols import DraftPrefill
from blockspec.workers.sampling import SamplingParams
from blockspec.workers.target import TargetWorker, path_rows
from blockspec.workers.tree import DraftTree

OPS = ("prefill", "move", "score_logits", "commit")  # TargetWorker methods run on every rank
STOP = "stop"
Command = tuple[str, tuple]


# ------------------------------------------------------------------------------ per rank
def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """CPU ranks share the CPU; CUDA rank r uses GPU r (one GPU per rank) unless the device
    names its GPU (a Ray actor sees only its own GPU, as cuda:0)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank)
    return device


def _use_loopback() -> None:
    """Make the backends connect over loopback only. They read these when they open their
    sockets: gloo when the group is created, NCCL lazily at its first collective, so the
    setting stays in this rank's environment (rank 0: the calling process's) from now on."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"


def loopback_store(world: int, timeout_s: float) -> dist.TCPStore:
    """Rendezvous server for rank 0 on a free port of 127.0.0.1 (`.port` tells the workers).

    The socket is bound here and handed to the store: TCPStore would bind every interface,
    and holding the socket from bind to use leaves no race for the port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(world, 16))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,  # they connect once spawned; init_process_group waits
        master_listen_fd=sock.detach(),  # the store owns (and closes) the fd from now on
        use_libuv=True,  # the only server that accepts a listening fd
    )


def join_group(
    rank: int,
    world: int,
    port: int,
    device: str | torch.device = "cpu",
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
) -> None:
    """Join the default process group of `world` ranks whose store is on 127.0.0.1:port.

    Rank 0 passes its :func:`loopback_store`; the others connect to it as clients. Blocks until
    every rank has joined. gloo on CPU, NCCL on CUDA (unless BLOCKSPEC_TP_BACKEND names
    another), both restricted to loopback.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: "
            "one tensor-parallel target per process"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # NCCL refuses two ranks on one GPU: BLOCKSPEC_TP_BACKEND=gloo runs them there anyway (gloo
    # all-reduces CUDA tensors through the host), how a machine of one GPU checks TP > 1.
    backend = os.environ.get("BLOCKSPEC_TP_BACKEND") or ("nccl" if dev.type == "cuda" else "gloo")
    _use_loopback()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TargetShard:
    """One rank's share of the target: its weight shard and KV cache, and the ops it runs.

    Loading needs no group (the forward finds the default group when it all-reduces), so a
    rank can report a bad checkpoint before the rendezvous.
    """

    def __init__(
        self,
        path: str | Path,
        rank: int,
        world: int,
        max_batch: int,
        max_len: int,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        forwards: DecodeForwards = DEFAULT_FORWARDS,  # with one rank (a split one: eager)
        loaded: LoadedModel | None = None,  # the whole model's weights, read already
        keep_loaded: bool = False,  # keep them, whole, in `loaded` (for the actor to hand over)
    ):
        self.rank, self.world = rank, world
        self.device = rank_device(device, rank)
        if loaded is None:
            loaded = load_model(path, dtype, str(self.device))
        loaded = loaded.to(self.device)
        # ValueError when the heads or the MLP do not split
        model = loaded.build(rank, world, packed=forwards.packed if world == 1 else None)
        # else the shard keeps its slices only (plus the unsharded embeddings/lm_head)
        self.loaded = loaded if keep_loaded else None
        self.worker = TargetWorker(model, max_batch, max_len, DTYPES[dtype], self.device)
        if world == 1:  # a split forward all-reduces through the group: it stays eager
            forwards.use(self.worker)

    def execute(self, op: str, args: tuple) -> Any:
        if op not in OPS:  # ops come from our own proxies only: a wrong one is our bug
            raise RuntimeError(f"unknown op {op!r}; expected one of {OPS}")
        return getattr(self.worker, op)(*args)


def serve(shard: TargetShard, recv: Callable[[], Command]) -> None:
    """Run every command from `recv` on `shard` until STOP (ranks 1..N-1)."""
    while True:
        op, args = recv()
        if op == STOP:
            return
        shard.execute(op, _to_device(args, shard.device))


def _to_device(obj: Any, device: torch.device) -> Any:
    """Tensors inside (lists, tuples, dataclasses of) arguments, moved to `device`."""
    if isinstance(obj, torch.Tensor):  # from the host without waiting; to it, waiting
        return obj.to(device, non_blocking=obj.device.type == "cpu" and device.type != "cpu")
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(x, device) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj


# ------------------------------------------------------------------------------ processes
def _worker_main(
    rank: int,
    world: int,
    port: int,
    path: str,
    max_batch: int,
    max_len: int,
    dtype: str,
    device: str,
    timeout_s: float,
    num_threads: int,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a spawned rank: load, report, join the group, serve commands."""
    # Ctrl-C reaches the whole process group: rank 0 decides (it closes the group if the
    # interrupt caught it mid-op); a worker dies with rank 0 anyway (EOF on its pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    try:
        shard = TargetShard(path, rank, world, max_batch, max_len, dtype, device)
        conn.send_bytes(pickle.dumps(("ready", None)))
        join_group(rank, world, port, device, timeout_s)
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        sys.exit(1)
    try:
        # Plain pickle: torch.multiprocessing's reducers would move every argument tensor
        # to shared memory (a side effect on the caller's tensors, and slower for small ones).
        serve(shard, lambda: pickle.loads(conn.recv_bytes()))
    except EOFError:
        sys.exit(1)  # rank 0 went away without a STOP
    except BaseException:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        sys.exit(1)
    finally:
        leave_group()


class _Workers:
    """Spawned ranks 1..N-1 and their pipes; shutdown is idempotent and also runs at GC/exit."""

    def __init__(self):
        self.procs: list[mp.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.healthy = True  # every rank is between two ops (none is inside a collective)
        self.own_group = False
        self.closed = False
        self.errors: list[str] = []  # reports of failed workers, filled at shutdown

    def send(self, command: Command) -> None:
        data = pickle.dumps(command)
        for conn in self.conns:
            conn.send_bytes(data)

    def _collect_errors(self) -> None:
        """What failed workers reported (tracebacks, exit codes), once they have stopped."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            with contextlib.suppress(OSError, EOFError):
                while conn.poll():
                    kind, text = pickle.loads(conn.recv_bytes())
                    if kind == "error":
                        self.errors.append(f"rank {rank}:\n{text}")
            if p.exitcode is not None and p.exitcode > 0:  # < 0: we terminated it
                self.errors.append(f"rank {rank} exited with code {p.exitcode}")

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.healthy:
            with contextlib.suppress(OSError, ValueError):
                self.send((STOP, ()))
        for p in self.procs:
            # A worker stuck in a collective (rank 0 failed mid-op) never reads STOP.
            p.join(timeout=10 if self.healthy else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._collect_errors()
        for conn in self.conns:
            conn.close()
        if self.own_group:
            leave_group()
            self.own_group = False


class TensorParallelTarget:
    """Drop-in for :class:`TargetWorker` with the target split over `world` ranks (a
    LocalTarget: workers/protocols.py).

    Rank 0 runs here; ranks 1..world-1 are spawned processes that load `path` themselves.
    Use as a context manager or call :meth:`close`. Any failure inside an op shuts the whole
    group down (the ranks' states can no longer be trusted to agree) and raises RuntimeError;
    bad arguments are refused with ValueError before any rank starts the op.
    """

    def __init__(
        self,
        path: str | Path,
        world: int,
        max_batch: int,
        max_len: int,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        timeout_s: float = 300.0,
        num_threads: int | None = None,
    ):
        """timeout_s bounds startup and each collective; num_threads (default: this process's
        torch.get_num_threads()) is the intra-op thread count of each spawned rank."""
        from transformers import AutoConfig

        if isinstance(dtype, torch.dtype):
            dtype = {v: k for k, v in DTYPES.items()}[dtype]
        path = str(path)
        # Refuse a bad split before spawning anything (the config alone tells).
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        LlamaSpec.from_hf_config(cfg).check_divisible(world)
        if world > 1 and dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group: "
                "one tensor-parallel target per process"
            )
        self.world, self.max_batch, self.max_len = world, max_batch, max_len
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.shutdown)
        try:
            self._start(path, dtype, str(device), timeout_s, num_threads)
        except BaseException:
            self.close()
            raise

    def _start(self, path, dtype, device, timeout_s, num_threads) -> None:
        world, workers = self.world, self._workers
        store = loopback_store(world, timeout_s) if world > 1 else None
        ctx = mp.get_context("spawn")
        threads = num_threads or torch.get_num_threads()
        for rank in range(1, world):
            ours, theirs = ctx.Pipe(duplex=True)
            args = (rank, world, store.port, path, self.max_batch, self.max_len, dtype, device)
            p = ctx.Process(
                target=_worker_main,
                args=(*args, timeout_s, threads, theirs),
                name=f"tp-rank{rank}",
                daemon=True,  # never outlive the driver, even if close() is skipped
            )
            p.start()
            theirs.close()
            workers.procs.append(p)
            workers.conns.append(ours)
        # Rank 0 loads while the workers do.
        self._shard = TargetShard(path, 0, world, self.max_batch, self.max_len, dtype, device)
        self.model = self._shard.worker.model
        self.cache = self._shard.worker.cache
        self._wait_ready(timeout_s)
        if world > 1:
            join_group(0, world, store.port, device, timeout_s, store=store)
            workers.own_group = True

    def _wait_ready(self, timeout_s: float) -> None:
        workers = self._workers
        waiting = dict(enumerate(workers.conns, start=1))
        deadline = time.monotonic() + timeout_s
        while waiting:
            sentinels = [workers.procs[r - 1].sentinel for r in waiting]
            left = max(deadline - time.monotonic(), 0)
            if not multiprocessing.connection.wait([*waiting.values(), *sentinels], left):
                raise RuntimeError(f"tensor-parallel ranks {sorted(waiting)} not ready in time")
            for rank, conn in list(waiting.items()):
                proc = workers.procs[rank - 1]
                try:
                    kind, text = pickle.loads(conn.recv_bytes()) if conn.poll() else (None, None)
                except EOFError:  # its end of the pipe closed: it died without a word
                    kind = None
                if kind is None and not proc.is_alive():
                    proc.join()
                    kind, text = "error", f"exited during startup (code {proc.exitcode})"
                if kind == "error":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{text}")
                if kind == "ready":
                    del waiting[rank]

    # ---------------------------------------------------------------------------- lockstep
    def _call(self, op: str, *args, collective: bool) -> Any:
        """Run op on every rank. Ops with collectives are sent first (the ranks meet inside);
        ops without are run here first, so an error leaves the other ranks untouched."""
        workers = self._workers
        if workers.closed:
            raise RuntimeError("tensor-parallel target is closed")
        cpu_args = _to_device(args, torch.device("cpu"))  # transport; each rank moves them back
        try:
            if collective:
                workers.healthy = False  # until every rank is through the collectives
                workers.send((op, cpu_args))
                out = self._shard.execute(op, args)
            else:
                out = self._shard.execute(op, args)
                workers.healthy = False
                workers.send((op, cpu_args))
            workers.healthy = True
            return out
        except BaseException as e:
            if workers.healthy:
                raise  # raised here before any other rank ran the op: the group is intact
            self.close()
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt and the like stay what they are
            notes = "".join(f"\n{msg}" for msg in workers.errors)
            raise RuntimeError(f"tensor-parallel op {op!r} failed; group shut down{notes}") from e

    def prefill(
        self, slot0: int, contexts: list[torch.Tensor], keep: list[int] | None = None
    ) -> list[torch.Tensor]:
        """contexts: [T_i] int64 each, into slots slot0.. after keep[i] cached tokens
        (see workers.draft.prefill). Returns their features [T_i, E] (rank 0's)."""
        if not 0 <= slot0 <= slot0 + len(contexts) <= self.max_batch:
            raise ValueError(f"slots {slot0}..{slot0 + len(contexts)} exceed max_batch")
        keep = keep or [0] * len(contexts)
        if any(c.shape[0] + s > self.max_len for c, s in zip(contexts, keep, strict=True)):
            raise ValueError(f"a context exceeds max_len={self.max_len}")
        return self._call("prefill", slot0, list(contexts), keep, collective=True)

    def prefill_features(
        self,
        slot0: int,
        contexts: list[torch.Tensor],
        keep: list[int],
        draft_keep: list[int],
        draft_pending: list[int],
        to_draft: DraftPrefill,
    ) -> list[torch.Tensor]:
        """Prefill for a feature draft (TargetWorker.prefill_features): the ranks prefill every
        context in one op, then each padding group's draft inputs go to `to_draft`."""
        features = self.prefill(slot0, contexts, keep)
        groups = (features[lo:hi] for lo, hi in padding_groups([len(c) for c in contexts]))
        return feed_draft(groups, draft_keep, draft_pending, to_draft)

    def move(self, src: int, dst: int) -> None:
        self._call("move", src, dst, collective=False)

    @torch.inference_mode()
    def score(self, tree: DraftTree, params: list[SamplingParams]) -> torch.Tensor:
        """Processed target rows [n, K, γ+1, V] along every path (as TargetWorker.score)."""
        tree = tree.to(self.device)
        return path_rows(self.score_logits(tree), tree, params)

    def score_logits(self, tree: DraftTree) -> torch.Tensor:
        """Raw logits of every tree node [n, N, V] (rank 0's copy)."""
        if tree.tokens.shape[0] > self.max_batch:
            raise ValueError(f"{tree.tokens.shape[0]} requests exceed max_batch={self.max_batch}")
        return self._call("score_logits", tree, collective=True)

    def commit(
        self,
        path: torch.Tensor,  # [n] int64: accepted path per request
        num_accepted: torch.Tensor,  # [n] int64
    ) -> torch.Tensor:
        """Returns the kept positions' features [n, γ+1, E] (TargetWorker.commit)."""
        return self._call("commit", path, num_accepted, collective=False)

    # ---------------------------------------------------------------------------- lifetime
    @property
    def device(self) -> torch.device:
        """Rank 0's device: where its results are (each rank moves its arguments itself)."""
        return self._shard.device

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..world-1."""
        return [p.pid for p in self._workers.procs]

    @property
    def closed(self) -> bool:
        return self._workers.closed

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        self._finalizer()

    def __enter__(self) -> TensorParallelTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
