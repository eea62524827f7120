"""Test-wide settings."""

import torch

# pytest-xdist runs one process per core; more than one intra-op thread per process
# oversubscribes the cores and OpenMP spin-waiting then slows everything ~10x.
torch.set_num_threads(1)
