"""`blockspec-bench`: every benchmark a docs page cites is a subcommand, and the harness they
share runs paths in turn and writes what the docs pages read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockspec.loadtest.bench import cli
from blockspec.loadtest.bench.harness import (
    alternate,
    cpu_by_process,
    cpu_ms_per_step,
    median_run,
    ratios,
    save_json,
    spread,
)
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET

BENCH = Path(cli.__file__).parent


def test_every_benchmark_module_is_a_subcommand_with_its_own_help(capsys):
    modules = {p.stem for p in BENCH.glob("*.py")} - {"__init__", "__main__", "cli", "harness"}
    assert modules == {module for module, _, _ in cli.BENCHMARKS.values()}
    for name in cli.BENCHMARKS:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0, name
        assert f"usage: blockspec-bench {name}" in capsys.readouterr().out


def test_the_list_names_each_benchmark_and_an_unknown_one_is_an_error(capsys):
    cli.main([])
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in cli.BENCHMARKS), listing
    with pytest.raises(SystemExit) as done:
        cli.main(["nope"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no benchmark 'nope'; one of: engine,"), err


def test_alternate_warms_each_path_then_rotates_which_goes_first():
    calls: list[str] = []

    def arm(name: str):
        return lambda: calls.append(name) or len(calls)

    seen = []
    runs = alternate({n: arm(n) for n in "abc"}, 3, on_run=lambda *run: seen.append(run))
    assert "".join(calls) == "abc" + "abc" + "bca" + "cab"
    assert runs == {"a": [4, 9, 11], "b": [5, 7, 12], "c": [6, 8, 10]}
    assert seen[:4] == [("a", 0, 4), ("b", 0, 5), ("c", 0, 6), ("b", 1, 7)]
    calls.clear()
    alternate({n: arm(n) for n in "ab"}, 1, warm=False)
    assert calls == ["a", "b"]


def test_ratios_pair_rounds_and_spread_shows_median_and_range():
    assert ratios([2.0, 3.0], [4.0, 3.0]) == [0.5, 1.0]
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])
    assert spread([0.92, 0.86, 0.9], "×") == "0.90× (0.86–0.92)"
    assert spread([1.0], "×") == "1.00×"
    assert spread([0.1234, 0.2], " s", 3) == "0.162 s (0.123–0.200)"
    assert spread([]) == "-"


def test_median_run_keeps_one_runs_numbers_together():
    runs = [dict(tps=3, ms=1), dict(tps=1, ms=9), dict(tps=2, ms=4)]
    assert median_run(runs, "tps") == dict(tps=2, ms=4)


def test_save_json_records_the_command_and_the_machine(tmp_path):
    path = tmp_path / "out.json"
    save_json(path, "engine", ["--prompts", "2"], dict(rows=[1], machine="stale"))
    out = json.loads(path.read_text())
    assert out["command"] == "blockspec-bench engine --prompts 2"
    assert out["rows"] == [1] and out["machine"]["cores"] == os.cpu_count()
    assert set(out["machine"]) == {"cpu", "cores", "torch", "torch_threads", "revision"}
    save_json(None, "engine", [], dict(rows=[]))  # no path: nothing written, no error


def test_the_engine_benchmark_runs_on_the_tiny_pair(tmp_path, capsys):
    out = tmp_path / "engine.json"
    cli.main(
        ["engine", "--draft", str(TINY_DRAFT), "--target", str(TINY_TARGET), "--prompts", "2",
         "--new-tokens", "6", "--methods", "block", "auto", "--k", "1", "--gamma", "3",
         "--temperature", "1.0", "--batch", "1", "--no-hf", "--json", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert [(r["method"], r["k"], r["gamma"]) for r in result["rows"]] == [
        ("none", 1, 0),
        ("block", 1, 3),
        ("auto", 0, 0),
    ]
    assert all(r["tokens"] == 2 * 6 and r["block_efficiency"] >= 1 for r in result["rows"])
    assert result["command"].startswith("blockspec-bench engine --draft")
    table = capsys.readouterr().out
    assert "| block | 1 | 3 | 1.0 | 1 |" in table and "| auto | 0 | 0 | 1.0 | 1 |" in table


def test_the_quality_benchmark_scores_each_dtype_against_float32(tmp_path):
    """Perplexity per dtype and text kind, and the int8 model's distance from float32's law:
    small, but not zero (its weights are rounded)."""
    out = tmp_path / "quality.json"
    cli.main(
        ["quality", "--model", str(TINY_TARGET), "--dtypes", "float32", "int8", "--code", "2",
         "--json", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    for kind in ("everyday", "code"):
        base, rounded = result[kind]["float32"], result[kind]["int8"]
        assert base["tokens"] == rounded["tokens"] > 0 and "tv" not in base
        assert 0.8 < rounded["perplexity"] / base["perplexity"] < 1.25
        assert 0 < rounded["tv"] < 0.2 and 0.5 < rounded["agree"] <= 1


def test_the_llamacpp_benchmarks_bound_counts_the_two_models_phases_only(capsys):
    """A row's models-only bound is its tokens over the draft's and target's phases: above
    the rate the whole step reaches, and printed against llama.cpp's Q4_1, beside the bounds
    with a free draft and with llama.cpp's pass over the row's 1 + Kγ tokens as its target."""
    from blockspec.loadtest.bench import llamacpp
    from blockspec.service.build import build_engine

    engine, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), 1)
    res = llamacpp.engine_rate(engine, [[5, 6, 7, 8]], ("block", 1, 4), 12, 1)
    times = engine.times
    assert res["draft_ms"] * engine.steps == pytest.approx(times.draft * 1e3)
    assert res["target_ms"] * engine.steps == pytest.approx(times.target * 1e3)
    assert res["bound"] == pytest.approx(12 / (times.draft + times.target))
    assert res["tokens_per_step"] == pytest.approx(12 / engine.steps)
    assert res["tree_size"] == 5  # root + γ: the llama.cpp pass its bounds read
    assert res["bound"] > res["rate"] > 0 and res["be"] >= 1
    arm = ("blockspec block K=1 γ=4", "float32", 2)
    row = dict(rate=50.0, be=2.0, draft_ms=4.0, target_ms=6.0, bound=150.0, tokens_per_step=2.0)
    row["tree_size"] = 5
    quantized = [dict(rate=100.0, pass_ms={5: 9.0}), dict(rate=120.0, pass_ms={5: 11.0})]
    runs = {
        ("llama.cpp", "float32", 2): [dict(rate=90.0, pass_ms={5: 8.0, 9: 1.0})] * 2,
        ("llama.cpp", "q4_1", 2): quantized,
        arm: [row] * 2,
    }
    llamacpp.print_bounds(runs, [2])
    # 2 tokens a step: 2000 / 6 ms free-draft, 2000 / (4 + 8) and 2000 / (4 + 10) ms with
    # llama.cpp's 5-token passes, each over Q4_1's median 110 tok/s
    assert (
        "| blockspec block K=1 γ=4 | float32 | 2 | 50.0 | 2.00 | 4.0 | 6.0 | 150.0 | 1.36 | 3.03 "
        "| 8.0 / 10.0 | 1.52 / 1.30 |"
    ) in capsys.readouterr().out
    assert llamacpp.tree_size("gbv", 2, 4) == 9 and llamacpp.tree_size("none", 1, 1) == 1


def test_the_gpu_benchmarks_graphed_rows_run_on_the_fake_device(tmp_path, monkeypatch):
    """engine-gpu's speed section with graphs on, on the fake device that captures (the GPU
    run's path, which no CPU run took: its graphed rows once all crashed on a key clash):
    each engine warms up when built, and its timed rows capture nothing and run nothing
    eagerly."""
    import torch
    from fake_device import FakeCuda

    out = tmp_path / "engine_gpu.json"
    with FakeCuda(graphs=True):
        for name in ("synchronize", "empty_cache", "set_sync_debug_mode"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
        cli.main(
            ["engine-gpu", "--device", "cuda", "--sections", "speed", "--methods", "none",
             "block", "gbv", "--batch", "1", "2", "--prompts", "2", "--batch1-prompts", "1",
             "--new-tokens", "8", "--warmup-tokens", "4", "--no-hf", "--graphs", "on",
             "--dtype", "float32", "--max-len", "320", "--models", str(tmp_path),
             "--json", str(out)]
        )  # fmt: skip
    speed = json.loads(out.read_text())["speed"]
    assert set(speed["warm_up"]) == {"1", "2"} and all(
        w["graphs"] for w in speed["warm_up"].values()
    )
    rows = speed["rows"]
    assert [(r["method"], r["batch"], r["graphs"]) for r in rows] == [
        (m, b, True) for m in ("none", "block", "gbv") for b in (1, 2)
    ]
    for row in rows:
        caches = row["graph_caches"].values()
        assert all(c["timed_captures"] == c["timed_eager_calls"] == 0 for c in caches), row
        assert row["graph_caches"]["target forward"]["replays"] > 0


def test_verify_ab_times_this_checkout_against_a_revision_in_one_process():
    """Two copies of the verifiers (a git worktree's and this checkout's) load side by side,
    their numba loops included, and give the same seeded outputs."""
    done = subprocess.run(
        [sys.executable, "-m", "blockspec.loadtest.bench", "verify-ab", "--baseline", "HEAD",
         "--methods", "block", "gbv", "--shapes", "2x2x500", "--rounds", "2", "--calls", "2",
         "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| gbv")]
    assert len(rows) == 1 and "| True |" in rows[0], done.stdout


def test_cpu_a_step_sums_each_names_processes_alive_at_both_snapshots():
    before = {1: ("ray::DraftActor", 1.0), 2: ("ray::IDLE", 0.5), 3: ("ray::IDLE", 0.2)}
    before[9] = ("gone since", 5.0)
    after = {1: ("ray::DraftActor", 1.6), 2: ("ray::IDLE", 0.6), 3: ("ray::IDLE", 0.3)}
    after[4] = ("started since", 9.0)
    ms = cpu_ms_per_step(before, after, steps=100)
    assert list(ms) == ["ray::DraftActor", "ray::IDLE"]  # the busiest first
    assert ms == pytest.approx({"ray::DraftActor": 6.0, "ray::IDLE": 2.0})
    assert os.getpid() in cpu_by_process()


def test_the_wake_bound_times_each_models_forward_after_each_kind_of_wait():
    """`blockspec-bench bounds --wake`: each model's forward timed after each wait, and each
    wait but "back to back" lasts its gap (the waits on a socket return: its waking thread
    answers every call)."""
    import time

    from blockspec.loadtest.bench import bounds
    from blockspec.workers.models import load_model

    models = {
        "draft": (load_model(TINY_DRAFT).build(), 1),
        "target": (load_model(TINY_TARGET).build(), 5),
    }
    start = time.perf_counter()
    ms = bounds.wake_costs(models, rounds=1, calls=2, gap_s=0.05)
    # 2 models × 3 kinds of wait × 2 calls × 50 ms; the forwards alone take a few ms
    assert time.perf_counter() - start >= 0.6
    assert list(ms) == ["draft", "target"]
    for name in ms:
        assert list(ms[name]) == list(bounds.WAITS)
        assert all(0 < v < 1e3 for v in ms[name].values()), ms
    # a 5-token pass of the target costs more than the draft's one token, after any wait
    assert all(ms["target"][how] > ms["draft"][how] for how in bounds.WAITS)
