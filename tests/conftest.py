"""Test-wide settings."""

import os

import pytest
import torch

# `redis_url`: a real redis-server; `service`: the whole service on a local Ray cluster.
pytest_plugins = ["tests.redis_server", "tests.live_service"]

# pytest-xdist runs one process per core; more than one intra-op thread per process
# oversubscribes the cores and OpenMP spin-waiting then slows everything ~10x.
torch.set_num_threads(1)

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
