"""Multi-node placement: on a simulated two-node Ray cluster (loopback only), the draft actor
runs on one node and the target on the other, as the settings' custom resources ask, and
seeded outputs equal the in-process engine's (the draft's rows cross nodes through Ray's object
store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.xdist_group("ray")
def test_draft_and_target_on_different_nodes_sample_like_the_in_process_engine():
    argv = [sys.executable, "-m", "tests.two_nodes"]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # every node on 127.0.0.1; read when ray loads
    )
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    nodes, split = out["nodes"], out["split"]
    assert nodes[split["draft_node"]] == ["a"]
    assert [nodes[n] for n in split["target_nodes"]] == [["b"]]
    assert split["tokens"] == split["local"]
    assert all(len(t) == 16 for t in split["tokens"])
