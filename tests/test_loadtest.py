"""A short load-test sweep against the live service produces every output file, with sane values."""

from __future__ import annotations

import csv
import itertools
import json
import math

import pytest

from blockspec.loadtest.cli import main as loadtest
from blockspec.loadtest.report import auto_versus_fixed, best_per_method, parse_slo, summarize
from blockspec.workers.models import TINY_TARGET

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
    "speedup_c.png",
    "speedup_rate.png",
]


def test_sweep_writes_every_output_with_sane_values(service, tmp_path):
    address = f"127.0.0.1:{service['address']['port']}"
    out = tmp_path / "sweep"
    # The live service runs the tiny pair: prompts in its vocabulary, not the default target's.
    args = ["--address", address, "--tokenizer", str(TINY_TARGET)]
    args += ["--methods", "none", "block", "gbv", "auto", "--k", "2", "--slo", "ttft=60"]
    args += ["--gamma", "3", "--concurrency", "1", "4", "--rate", "8", "--requests", "4"]
    args += ["--warmup", "1", "--max-new-tokens", "12", "--num-prompts", "8", "--out", str(out)]
    loadtest(args)
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    points = data["points"]
    assert len(points) == 4 * 3  # 4 configurations × (2 concurrencies + 1 rate)
    assert len(data["records"]) == 4 * 3 * 4
    for p in points:
        details = {r["detail"] for r in data["records"] if r["code"] != "OK"}
        assert p["ok"] == 4 and not p["errors"], (p["config"], p["load"], p["errors"], details)
        assert p["tokens_per_s"] > 0 and p["goodput_requests_per_s"] == p["requests_per_s"] > 0
        assert 0 < p["itl_p50"] <= p["itl_p99"] and p["tokens_per_s_ci"] > 0
        assert 0 < p["ttft_p50"] <= p["latency_p50"] <= p["latency_p90"] <= p["latency_p99"]
        assert p["mean_batch_size"] >= 1 and p["step_ms"]["target"] > 0
        if p["config"].startswith("auto"):
            assert sum(p["steps_by_config"].values()) == pytest.approx(1.0)
        elif p["config"].startswith("none"):
            assert p["block_efficiency"] == 1.0 and p["acceptance_per_position"] == [0.0]
        else:
            assert 1 <= p["block_efficiency"] <= 4  # at most γ + 1
            assert len(p["acceptance_per_position"]) == 3
            assert all(0 <= a <= 1 for a in p["acceptance_per_position"])
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(points) and not math.isnan(float(rows[0]["tokens_per_s"]))
    report = (out / "report.md").read_text()
    assert "python -m blockspec.loadtest" in report and "gbv K=2 γ=3 T=1.0" in report
    assert "`auto` against fixed configurations" in report and "What `auto` ran" in report
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

    def rec(tokens, calls, latency, ttft, accepted, batch, step_ms, code="OK", itl=(), ran=None):
        return dict(
            itl_s=list(itl),
            steps_by_config=ran or {},
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
        rec(
            10,
            4,
            2.0,
            0.5,
            [3, 2],
            2.0,
            {"target": 10.0, "draft": 4.0},
            itl=[0.9, 0.1, 0.5],
            ran={"block/1/2": 3, "none": 1},
        ),
        rec(
            6, 2, 1.0, 0.2, [2, 1], 4.0, {"target": 20.0, "draft": 1.0}, itl=[0.1], ran={"none": 2}
        ),
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
    assert s["requests_per_s"] == 2 / 4.0 and math.isnan(s["goodput_requests_per_s"])
    assert s["itl_p50"] == 0.1 and s["itl_p99"] == 0.9  # gaps pooled over requests
    assert s["steps_by_config"] == {"block/1/2": 3 / 6, "none": 3 / 6}
    # 95% interval of the mean latency, relative: 1.96 × sd(2.0, 1.0) / sqrt(2) / 1.5
    assert s["tokens_per_s_ci"] == pytest.approx(1.96 * 0.5**0.5 / 2**0.5 / 1.5)
    slo = parse_slo("ttft=0.3,tpot=0.2")
    assert slo == {"ttft": 0.3, "tpot": 0.2}
    met = summarize(records, wall_s=4.0, slo=slo)  # only the second meets both
    assert (met["goodput_requests_per_s"], met["goodput_tokens_per_s"]) == (1 / 4.0, 6 / 4.0)
    with pytest.raises(ValueError, match="--slo: 'ttfb=1'"):
        parse_slo("ttfb=1")


def test_auto_is_compared_with_the_best_fixed_configuration_at_each_load():
    def point(config, load, tps):
        return dict(config=config, load=load, tokens_per_s=tps)

    points = [
        point("none T=1.0", "c=1", 10.0), point("none T=1.0", "c=8", 40.0),
        point("block K=1 γ=4 T=1.0", "c=1", 15.0), point("block K=1 γ=4 T=1.0", "c=8", 30.0),
        point("auto T=1.0", "c=1", 14.0), point("auto T=1.0", "c=8", 40.0),
    ]  # fmt: skip
    (v,) = auto_versus_fixed(points)
    # Single best over the sweep: geomean(10, 40) = 20 < geomean(15, 30) = 21.2 -> block.
    assert v["single"] == "block K=1 γ=4 T=1.0"
    assert [(r["best"], r["ratio"]) for r in v["loads"]] == [
        ("block K=1 γ=4 T=1.0", 14 / 15), ("none T=1.0", 1.0)
    ]  # fmt: skip
    assert v["worst_vs_best"] == 14 / 15
    assert v["geomean_vs_single"] == pytest.approx((14 / 15 * 40 / 30) ** 0.5)
    assert v["headroom"] == pytest.approx((15 / 15 * 40 / 30) ** 0.5)  # none at c=8, block at 1
    best = best_per_method(points)
    assert best[("1.0", "c=8")]["block"]["tokens_per_s"] == 30.0


def test_the_console_interval_says_when_there_is_none():
    """One request has no spread to estimate: said so, not `±nan%`."""
    from blockspec.loadtest.cli import interval

    assert interval(dict(tokens_per_s_ci=0.123, ok=8)) == "±12%"
    assert interval(dict(tokens_per_s_ci=math.nan, ok=1)) == "no interval from 1 request"
    assert interval(dict(tokens_per_s_ci=math.nan, ok=0)) == "no interval from 0 requests"


def test_help_shows_defaults_and_the_example_as_written():
    from blockspec.loadtest.cli import parser

    ap = parser()
    assert "--concurrency 1 2 4 8 16 32 --requests 32 \\\n" in ap.format_help()  # lines kept
    formatter = ap._get_formatter()
    for action in ap._actions:
        if action.option_strings and action.dest != "help":  # argparse shows no help-less one
            assert action.help and "default" in formatter._get_help_string(action), action.dest


@pytest.mark.parametrize(("requests", "warned"), [(1, True), (5, True), (6, False)])
def test_too_few_requests_per_point_are_warned(requests, warned, monkeypatch, capsys):
    async def no_run(args) -> None:
        pass

    monkeypatch.setattr("blockspec.loadtest.cli.run", no_run)
    loadtest(["--requests", str(requests)])
    err = capsys.readouterr().err
    assert ("warning: " in err) == warned, err
    if requests == 1:
        assert "give no interval" in err
