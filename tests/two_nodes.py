"""Run by tests/test_multinode.py in a fresh interpreter (a process joins one Ray cluster):
a simulated two-node cluster on 127.0.0.1, the draft placed on one node and the target on the
other through custom resources from the settings; prints the seeded outputs, those of the
in-process engine on the same requests, and where each actor ran, as JSON."""

from __future__ import annotations

import json
import os

import ray
import torch
from ray.cluster_utils import Cluster

from blockspec.service.build import build_engine
from blockspec.service.config import ReplicaConfig
from blockspec.service.replica import build_remote_engine
from blockspec.service.requests import make_request
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET
from blockspec.workers.sampling import SamplingParams
from tests.test_engine import MIXED

LOOPBACK = dict(node_ip_address="127.0.0.1", num_cpus=2)


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def run(draft_node: str, target_node: str, prompts: list[list[int]]) -> dict:
    """One target shard: the shards of a replica share a node anyway (one STRICT_PACK
    placement group), so what crosses nodes is the draft's rows, whatever the shard count."""
    cfg = ReplicaConfig(
        draft_dir=str(TINY_DRAFT),
        target_dir=str(TINY_TARGET),
        max_batch=len(MIXED),
        draft=dict(resources={draft_node: 0.01}),
        target_shard=dict(resources={target_node: 0.01}),
    )
    engine, _ = build_remote_engine(cfg)
    local = build_engine(cfg.draft_dir, cfg.target_dir, len(MIXED))[0]

    def requests():
        return [
            make_request(
                engine.limits, prompt, 16, method, k, gamma, SamplingParams(1.0), seed=90 + i
            )
            for i, (prompt, (method, k, gamma)) in enumerate(zip(prompts, MIXED, strict=True))
        ]

    try:
        return dict(
            tokens=[r.token_ids for r in engine.generate(requests())],
            local=[r.token_ids for r in local.generate(requests())],
            draft_node=node_of(engine.draft.actors[0]),
            target_nodes=[node_of(a) for a in engine.target.actors],
        )
    finally:
        for actor in engine.draft.actors + engine.target.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(engine.target.placement_group)


def main() -> None:
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":  # read when ray is imported
        raise SystemExit("run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (loopback only)")
    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, head_node_args=dict(LOOPBACK, resources={"a": 1}))
    cluster.add_node(**LOOPBACK, resources={"b": 1})
    ray.init(address=cluster.address)
    try:
        nodes = {n["NodeID"]: sorted(set(n["Resources"]) & {"a", "b"}) for n in ray.nodes()}
        prompts = [[1 + i, 40 + 3 * i, 7, 100 + i] for i in range(len(MIXED))]
        print(json.dumps(dict(nodes=nodes, split=run("a", "b", prompts))))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
