"""A short load-test sweep against the live service produces every output file, with sane values."""

from __future__ import annotations

import csv
import itertools
import json
import math

import pytest

from loadtest.cli import main as loadtest
from loadtest.report import summarize
from workers.models import TINY_TARGET

pytestmark = pytest.mark.xdist_group("ray")  # uses the live service (tests/live_service.py)

FILES = [
    "results.json",
    "results.csv",
    "report.md",
    "throughput_c.png",
    "latency_c.png",
    "throughput_rate.png",
    "latency_rate.png",
    "block_efficiency.png",
]


def test_sweep_writes_every_output_with_sane_values(service, tmp_path):
    address = f"127.0.0.1:{service['address']['port']}"
    out = tmp_path / "sweep"
    # The live service runs the tiny pair: prompts in its vocabulary, not the default target's.
    args = ["--address", address, "--tokenizer", str(TINY_TARGET)]
    args += ["--methods", "none", "block", "gbv", "--k", "2"]
    args += ["--gamma", "3", "--concurrency", "1", "4", "--rate", "8", "--requests", "4"]
    args += ["--warmup", "1", "--max-new-tokens", "12", "--num-prompts", "8", "--out", str(out)]
    loadtest(args)
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    points = data["points"]
    assert len(points) == 3 * 3  # 3 configurations × (2 concurrencies + 1 rate)
    assert len(data["records"]) == 3 * 3 * 4
    for p in points:
        details = {r["detail"] for r in data["records"] if r["code"] != "OK"}
        assert p["ok"] == 4 and not p["errors"], (p["config"], p["load"], p["errors"], details)
        assert p["tokens_per_s"] > 0
        assert 0 < p["ttft_p50"] <= p["latency_p50"] <= p["latency_p90"] <= p["latency_p99"]
        assert p["mean_batch_size"] >= 1 and p["step_ms"]["target"] > 0
        if p["config"].startswith("none"):
            assert p["block_efficiency"] == 1.0 and p["acceptance_per_position"] == [0.0]
        else:
            assert 1 <= p["block_efficiency"] <= 4  # at most γ + 1
            assert len(p["acceptance_per_position"]) == 3
            assert all(0 <= a <= 1 for a in p["acceptance_per_position"])
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(points) and not math.isnan(float(rows[0]["tokens_per_s"]))
    report = (out / "report.md").read_text()
    assert "python -m loadtest" in report and "gbv K=2 γ=3 T=1.0" in report
    # A concurrency of 4 ran batches larger than 1.
    assert max(p["mean_batch_size"] for p in points if p["load"] == "c=4") > 1


def test_compare_interleaves_two_configurations_and_reports_ratios(service, tmp_path):
    address = f"127.0.0.1:{service['address']['port']}"
    out = tmp_path / "compare"
    args = ["--address", address, "--tokenizer", str(TINY_TARGET)]
    args += ["--compare", "token:1:3:1.0", "block:1:3:1.0"]
    args += ["--concurrency", "2", "--requests", "3", "--warmup", "0", "--max-new-tokens", "12"]
    loadtest([*args, "--out", str(out)])
    data = json.loads((out / "results.json").read_text())
    a, b = "token K=1 γ=3 T=1.0", "block K=1 γ=3 T=1.0"
    points = {p["config"]: p for p in data["points"]}
    assert set(points) == {a, b}
    # Sent in turn: the configurations alternate in start order.
    order = [r["config"] for r in sorted(data["records"], key=lambda r: r["start"])]
    assert len(order) == 6 and all(x != y for x, y in itertools.pairwise(order))
    ratios = {row["metric"]: row for row in data["meta"]["compare"]}
    assert set(ratios) >= {"tokens_per_s", "latency_p50", "block_efficiency"}
    for metric, row in ratios.items():  # A and B are the two points, B/A their ratio
        assert (row["a"], row["b"]) == (points[a][metric], points[b][metric])
        assert row["ratio"] == pytest.approx(row["b"] / row["a"])
    assert "Comparison (B / A" in (out / "report.md").read_text()


def test_summary_of_hand_made_records():
    """Throughput over the wall time, BE and acceptance per target call, per-step means
    weighted by each request's steps, nearest-rank percentiles, errors counted apart."""

    def rec(tokens, calls, latency, ttft, accepted, batch, step_ms, code="OK"):
        return dict(
            tokens=tokens,
            target_calls=calls,
            latency_s=latency,
            ttft_s=ttft,
            accepted_per_position=accepted,
            mean_batch_size=batch,
            step_ms=step_ms,
            code=code,
        )

    records = [
        rec(10, 4, 2.0, 0.5, [3, 2], 2.0, {"target": 10.0, "draft": 4.0}),
        rec(6, 2, 1.0, 0.2, [2, 1], 4.0, {"target": 20.0, "draft": 1.0}),
        rec(0, 0, 0.1, None, [], 0.0, {}, code="RESOURCE_EXHAUSTED"),
    ]
    s = summarize(records, wall_s=4.0)
    assert (s["requests"], s["ok"], s["errors"]) == (3, 2, {"RESOURCE_EXHAUSTED": 1})
    assert s["tokens_per_s"] == 16 / 4.0
    assert s["block_efficiency"] == pytest.approx(16 / 6)
    assert s["acceptance_per_position"] == pytest.approx([5 / 6, 3 / 6])
    assert s["mean_batch_size"] == pytest.approx((2.0 * 4 + 4.0 * 2) / 6)
    assert s["step_ms"]["target"] == pytest.approx((10.0 * 4 + 20.0 * 2) / 6)
    assert s["step_ms"]["draft"] == pytest.approx((4.0 * 4 + 1.0 * 2) / 6)
    assert (s["latency_p50"], s["latency_p99"], s["ttft_p50"]) == (1.0, 2.0, 0.2)
    assert s["tpot_p50"] == pytest.approx(0.8 / 5)  # min of 1.5/9 and 0.8/5
