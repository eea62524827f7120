"""Test-wide settings."""

import torch

pytest_plugins = ["tests.redis_server"]  # the `redis_url` fixture: a real redis-server

# pytest-xdist runs one process per core; more than one intra-op thread per process
# oversubscribes the cores and OpenMP spin-waiting then slows everything ~10x.
torch.set_num_threads(1)
