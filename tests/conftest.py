"""Test-wide settings."""

import torch

# `redis_url`: a real redis-server; `service`: the whole service on a local Ray cluster.
pytest_plugins = ["tests.redis_server", "tests.live_service"]

# pytest-xdist runs one process per core; more than one intra-op thread per process
# oversubscribes the cores and OpenMP spin-waiting then slows everything ~10x.
torch.set_num_threads(1)
