"""Which code a verify call runs: one backend, chosen once per call from the inputs.

Every verifier is written as torch ops; a backend says which of their variants run and which
compiled kernels replace parts of them:

- ``numba``: float32 rows on the CPU. Host reads are free (the values sit in host memory), and
  the compiled loops (numba) replace whole verifiers or their row passes where there are any.
- ``torch-host``: other rows on the CPU. The torch ops that read values on the host to skip
  work: compact the requests still walking, sum only the levels a uniform can reach.
- ``torch-device``: an accelerator without fused kernels (or the fake device of the tests).
  Fixed-shape torch ops that read nothing back, so that a call can replay from a CUDA graph;
  finished requests are masked, not dropped. The same tokens as the host variants.
- ``triton``: CUDA with Triton installed. ``torch-device`` with the fused row passes
  (kernels.py) wherever the rows fit them.

``verify`` calls :func:`choose_backend` once and passes the result down as an argument: no
verifier decides again from its tensors' device or dtype.
"""

from __future__ import annotations

import enum
import sys

import torch

from . import kernels


class Backend(enum.Enum):
    NUMBA = "numba"
    TORCH_HOST = "torch-host"
    TORCH_DEVICE = "torch-device"
    TRITON = "triton"

    @property
    def reads_host(self) -> bool:
        """Reading a value on the host is free: work may be skipped after looking at it."""
        return self in (Backend.NUMBA, Backend.TORCH_HOST)

    @property
    def compiled_loops(self) -> bool:
        """The numba loops run in place of the torch ops where there are any."""
        return self is Backend.NUMBA

    @property
    def fused(self) -> bool:
        """The Triton kernels replace row passes wherever the rows fit them (kernels.fit)."""
        return self is Backend.TRITON

    def fuses(self, p: torch.Tensor, q: torch.Tensor) -> bool:
        """Whether a row pass over p, q [..., V] runs as its Triton kernel: on this backend,
        where the rows fit it (a shape's condition, not a second choice of backend)."""
        return self.fused and kernels.fit(p, q)


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading values of tensors on ``device`` costs no wait: on the CPU, yes; on an
    accelerator it waits for every queued kernel (and breaks CUDA-graph capture)."""
    return device.type == "cpu"


def numba_fits(*rows: torch.Tensor) -> bool:
    """Whether the compiled loops can read rows: float32 on a little-endian CPU, contiguous
    along V (they read numpy views of them)."""
    return sys.byteorder == "little" and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in rows
    )


def choose_backend(
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
) -> Backend:
    """The backend of a call on these rows (on one device, checked by check_inputs)."""
    device = draft_probs.device
    if host_reads_are_free(device):
        return Backend.NUMBA if numba_fits(draft_probs, target_probs) else Backend.TORCH_HOST
    if device.type == "cuda" and kernels.available():
        return Backend.TRITON
    return Backend.TORCH_DEVICE


def check_backend(
    backend: Backend,
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
) -> None:
    """Raise ValueError where a backend named by the caller cannot run on these rows. The torch
    variants run anywhere (on the CPU the device one is how tests take an accelerator's path);
    triton needs Triton (on CPU tensors its interpreter, TRITON_INTERPRET=1)."""
    if backend is Backend.NUMBA and not numba_fits(draft_probs, target_probs):
        raise ValueError("backend 'numba' needs float32 CPU rows, contiguous along V")
    if backend is Backend.TORCH_HOST and not host_reads_are_free(draft_probs.device):
        raise ValueError(
            f"backend 'torch-host' reads values on the host: not on {draft_probs.device}"
        )
    if backend is Backend.TRITON and not kernels.available():
        raise ValueError("backend 'triton' needs Triton installed")
