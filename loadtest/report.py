"""From request records to the numbers a user compares, named as vLLM's `bench serve` and
AIPerf name them. Per (configuration, load) point: output tokens/s with a 95% interval,
requests/s, end-to-end latency, TTFT (time to first token), TPOT (time per output token after
the first, per request), ITL (gaps between stream chunks that carry tokens; a chunk is one
decode step, so a speculative step's tokens arrive together), goodput under an SLO, block
efficiency, acceptance per draft position, batch sizes, where step time went, errors by status
code, and for `auto` the configurations it ran. Across points: speedup over `none` per method
(its best configuration at each load), and `auto` against the best fixed configuration.
Writes JSON, CSV, PNG plots and report.md.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from blockspec.protos import blockspec_pb2 as pb

PHASES = tuple(f.name for f in pb.StepBreakdown.DESCRIPTOR.fields)  # the wire's step phases


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    return float(np.percentile(values, q, method="inverted_cdf")) if values else math.nan


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=0.5,tpot=0.1,e2e=10' (seconds; any subset) -> {'ttft': 0.5, ...}."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--slo: {part!r}; expected {'/'.join(SLO_METRICS)}=seconds")
        slo[name] = float(value)
    return slo


SLO_METRICS = ("ttft", "tpot", "e2e")


def meets(record: dict, slo: dict[str, float]) -> bool:
    """Whether a successful request met every SLO threshold."""
    tpot = _tpot(record)
    observed = dict(ttft=record["ttft_s"], tpot=tpot, e2e=record["latency_s"])
    return all(
        observed[name] is not None and observed[name] <= limit for name, limit in slo.items()
    )


def _tpot(r: dict) -> float | None:
    if r["ttft_s"] is None or r["tokens"] <= 1:
        return None
    return (r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1)


def summarize(records: list[dict], wall_s: float, slo: dict[str, float] | None = None) -> dict:
    """The point's numbers. The interval on tokens/s is the 95% normal interval of the mean
    request latency, relative: at a fixed concurrency and fixed tokens per request, throughput
    is concurrency × tokens / mean latency (Little's law), so it is as uncertain as that mean."""
    ok = [r for r in records if r["code"] == "OK"]
    tokens = sum(r["tokens"] for r in ok)
    calls = sum(r["target_calls"] for r in ok)
    latency = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [t for t in map(_tpot, ok) if t is not None]
    itl = [gap for r in ok for gap in r.get("itl_s", [])]
    ran = Counter()
    for r in ok:
        ran.update(r.get("steps_by_config", {}))
    good = [r for r in ok if meets(r, slo)] if slo else []
    gamma = max((len(r["accepted_per_position"]) for r in ok), default=0)
    accepted = [0] * gamma
    for r in ok:
        for i, n in enumerate(r["accepted_per_position"]):
            accepted[i] += n

    def weighted(value) -> float:  # mean over steps: per-request values weighted by its steps
        return sum(value(r) * r["target_calls"] for r in ok) / max(calls, 1)

    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: math.nan)
    spread = (
        1.96 * float(np.std(latency, ddof=1)) / math.sqrt(len(latency)) / float(np.mean(latency))
        if len(latency) > 1
        else math.nan
    )
    return dict(
        requests=len(records),
        ok=len(ok),
        errors=dict(Counter(r["code"] for r in records if r["code"] != "OK")),
        wall_s=wall_s,
        tokens_per_s=per_s(tokens),
        tokens_per_s_ci=spread,  # relative half-width of the 95% interval
        requests_per_s=per_s(len(ok)),
        goodput_requests_per_s=per_s(len(good)) if slo else math.nan,
        goodput_tokens_per_s=per_s(sum(r["tokens"] for r in good)) if slo else math.nan,
        slo_met=len(good) / max(len(ok), 1) if slo else math.nan,
        latency_p50=percentile(latency, 50),
        latency_p90=percentile(latency, 90),
        latency_p99=percentile(latency, 99),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p90=percentile(tpot, 90),
        tpot_p99=percentile(tpot, 99),
        itl_p50=percentile(itl, 50),
        itl_p90=percentile(itl, 90),
        itl_p99=percentile(itl, 99),
        block_efficiency=tokens / calls if calls else math.nan,
        acceptance_per_position=[a / max(calls, 1) for a in accepted],
        mean_batch_size=weighted(lambda r: r["mean_batch_size"]),
        step_ms={p: weighted(lambda r, p=p: r["step_ms"].get(p, 0.0)) for p in PHASES},
        steps_by_config={c: n / max(calls, 1) for c, n in ran.most_common()},  # step shares
    )


COLUMNS = [
    ("config", "{}"),
    ("load", "{}"),
    ("ok", "{}"),
    ("tokens_per_s", "{:.1f}"),
    ("tokens_per_s_ci", "±{:.0%}"),
    ("requests_per_s", "{:.2f}"),
    ("goodput_requests_per_s", "{:.2f}"),
    ("latency_p50", "{:.2f}"),
    ("latency_p90", "{:.2f}"),
    ("latency_p99", "{:.2f}"),
    ("ttft_p50", "{:.3f}"),
    ("tpot_p50", "{:.4f}"),
    ("itl_p50", "{:.4f}"),
    ("itl_p99", "{:.4f}"),
    ("block_efficiency", "{:.2f}"),
    ("mean_batch_size", "{:.1f}"),
]


def _method(config: str) -> str:
    return config.split()[0]


def _temperature(config: str) -> str:
    return config.rsplit("T=", 1)[1]


def best_per_method(points: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """{(T, load): {method: its point with the most tokens/s there}}."""
    best: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for p in points:
        at = best[(_temperature(p["config"]), p["load"])]
        method = _method(p["config"])
        if method not in at or p["tokens_per_s"] > at[method]["tokens_per_s"]:
            at[method] = p
    return best


def auto_versus_fixed(points: list[dict]) -> list[dict]:
    """Per temperature that `auto` ran at: at each load, auto's tokens/s against the best fixed
    configuration there; and against the best *single* fixed configuration of the sweep (the
    highest geometric mean of tokens/s over auto's loads), as a geometric mean of ratios.

    `headroom` is the same ratio for an oracle that runs, at every load, the fixed
    configuration that was best there: what choosing per load can gain over never choosing.
    A policy choosing among the swept configurations exceeds it only by noise."""
    out = []
    for T in sorted({_temperature(p["config"]) for p in points if _method(p["config"]) == "auto"}):
        auto = {p["load"]: p["tokens_per_s"] for p in points if p["config"] == f"auto T={T}"}
        fixed: dict[str, dict[str, float]] = defaultdict(dict)
        for p in points:
            if _temperature(p["config"]) == T and _method(p["config"]) != "auto":
                fixed[p["config"]][p["load"]] = p["tokens_per_s"]
        complete = {c: v for c, v in fixed.items() if set(auto) <= set(v)}
        if not complete:
            continue
        single = max(complete, key=lambda c: _geomean([complete[c][load] for load in auto]))
        loads = []
        for load, tps in auto.items():
            best = max(fixed, key=lambda c: fixed[c].get(load, -1.0))
            loads.append(
                dict(load=load, auto=tps, best=best, best_tps=fixed[best][load],
                     ratio=tps / fixed[best][load], single_tps=complete[single][load])
            )  # fmt: skip
        out.append(
            dict(temperature=T, loads=loads, single=single,
                 geomean_vs_single=_geomean([r["auto"] / r["single_tps"] for r in loads]),
                 headroom=_geomean([r["best_tps"] / r["single_tps"] for r in loads]),
                 worst_vs_best=min(r["ratio"] for r in loads))
        )  # fmt: skip
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def _cell(fmt: str, value) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def write_outputs(out: Path, points: list[dict], records: list[dict], meta: dict) -> None:
    """points: [{config, load, **summary}], records: raw per-request dicts."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(dict(meta=meta, points=points, records=records), indent=1)
    )
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        names = [c for c, _ in COLUMNS] + ["errors"] + [f"step_ms_{p}" for p in PHASES]
        writer.writerow(names)
        for p in points:
            row = [p[c] for c, _ in COLUMNS] + [json.dumps(p["errors"])]
            writer.writerow(row + [round(p["step_ms"][ph], 3) for ph in PHASES])
    plots = _plots(out, points)
    _report(out, points, meta, plots)


def _load_of(p: dict) -> float:
    """The point's load level: N of "c=N" or "rate=N"."""
    return float(p["load"].split("=")[1])


def _plots(out: Path, points: list[dict]) -> list[str]:
    """One panel per method (its K/γ/T configurations as lines), so a full grid stays legible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        by_method[_method(p["config"])][p["config"]].append(p)
    files = _speedup_plots(plt, out, points)
    for kind in ("c", "rate"):
        panels = {
            m: {
                c: sorted((p for p in ps if p["load"].startswith(kind + "=")), key=_load_of)
                for c, ps in configs.items()
            }
            for m, configs in by_method.items()
        }
        panels = {m: {c: ps for c, ps in cs.items() if ps} for m, cs in panels.items()}
        panels = {m: cs for m, cs in panels.items() if cs}
        if not panels:
            continue
        xlabel = "concurrent clients" if kind == "c" else "arrival rate (requests/s)"
        for metric, ylabel, name in (
            ("tokens_per_s", "output tokens/s", f"throughput_{kind}.png"),
            ("latency", "latency p50 (solid) / p99 (dashed), s", f"latency_{kind}.png"),
        ):
            fig, axes = _grid(plt, len(panels))
            for ax, (method, configs) in zip(axes, panels.items(), strict=False):
                for config, ps in configs.items():
                    x = [_load_of(p) for p in ps]
                    label = config.removeprefix(method).strip()
                    if metric == "latency":
                        (line,) = ax.plot(x, [p["latency_p50"] for p in ps], "o-", label=label)
                        ax.plot(x, [p["latency_p99"] for p in ps], "--", color=line.get_color())
                    else:
                        ax.plot(x, [p[metric] for p in ps], "o-", label=label)
                ax.set_title(method)
                ax.set_xscale("log", base=2)
                ax.set_xlabel(xlabel)
                ax.set_ylabel(ylabel)
                ax.legend(fontsize=6)
            for ax in axes[len(panels) :]:
                ax.set_visible(False)
            fig.tight_layout()
            fig.savefig(out / name, dpi=90)
            plt.close(fig)
            files.append(name)

    # Block efficiency per method and K (mean over T, γ and load: bars grouped by method).
    be: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        if math.isnan(p["block_efficiency"]):
            continue
        words = p["config"].split()
        k = next((w for w in words if w.startswith("K=")), "K=1")
        gamma = next((w for w in words if w.startswith("γ=")), "")
        be[words[0]][f"{k} {gamma}".strip()].append(p["block_efficiency"])
    labels = sorted({lab for d in be.values() for lab in d})
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(len(labels), 1)
    for i, lab in enumerate(labels):
        xs = [j + i * width for j, m in enumerate(be) if lab in be[m]]
        ys = [sum(be[m][lab]) / len(be[m][lab]) for m in be if lab in be[m]]
        ax.bar(xs, ys, width, label=lab)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(be))], list(be))
    ax.set(ylabel="tokens per target call", title="Block efficiency by method, K and γ")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(out / "block_efficiency.png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    files.append("block_efficiency.png")
    return files


def _speedup_plots(plt, out: Path, points: list[dict]) -> list[str]:
    """Tokens/s over `none`'s at the same load and T, each method at its best configuration
    there (auto as it ran): one panel per temperature, per load kind."""
    best = best_per_method(points)
    files = []
    for kind, xlabel in (("c", "concurrent clients"), ("rate", "arrival rate (requests/s)")):
        temps = sorted({T for T, load in best if load.startswith(kind + "=") and
                        "none" in best[(T, load)]})  # fmt: skip
        if not temps:
            continue
        fig, axes = _grid(plt, len(temps))
        for ax, T in zip(axes, temps, strict=False):
            loads = sorted(
                (load for t, load in best if t == T and load.startswith(kind + "=")),
                key=lambda load: float(load.split("=")[1]),
            )
            methods = sorted({m for load in loads for m in best[(T, load)]} - {"none"})
            for method in methods:
                xs, ys = [], []
                for load in loads:
                    at = best[(T, load)]
                    if method in at and "none" in at and at["none"]["tokens_per_s"] > 0:
                        xs.append(float(load.split("=")[1]))
                        ys.append(at[method]["tokens_per_s"] / at["none"]["tokens_per_s"])
                style = "k*-" if method == "auto" else "o-"
                ax.plot(xs, ys, style, label=method, linewidth=2.5 if method == "auto" else 1)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set(xlabel=xlabel, ylabel="tokens/s ÷ none", title=f"best per method, T={T}")
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=6)
        for ax in axes[len(temps) :]:
            ax.set_visible(False)
        fig.tight_layout()
        name = f"speedup_{kind}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        files.append(name)
    return files


def _grid(plt, n: int):
    cols = min(n, 5)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    return fig, list(axes.flat)


def _report(out: Path, points: list[dict], meta: dict, plots: list[str]) -> None:
    lines = [
        "# blockspec load test",
        "",
        f"Command: `{meta['command']}`",
        "",
        "## Environment",
        "",
        *[f"- {k}: {v}" for k, v in meta["environment"].items()],
        "",
        "## Results",
        "",
        "Per point: requests that succeeded, output tokens/s over the point's wall time with the "
        "relative half-width of its 95% interval, requests/s, goodput (requests/s that met the "
        f"SLO {meta.get('slo') or '(none given)'}), end-to-end latency and time-to-first-token "
        "percentiles (s), median time per output token after the first (TPOT, s), inter-chunk "
        "gaps p50/p99 (ITL, s), block efficiency (tokens per target call), mean batch size of the "
        "steps that served the requests, and the mean step time by phase (ms).",
        "",
        "| "
        + " | ".join(c for c, _ in COLUMNS)
        + " | errors | step ms: "
        + " / ".join(PHASES)
        + " |",
        "|" + "---|" * (len(COLUMNS) + 2),
    ]
    for p in points:
        cells = [_cell(fmt, p[c]) for c, fmt in COLUMNS]
        errors = ", ".join(f"{k} {v}" for k, v in p["errors"].items()) or "-"
        step = " / ".join(f"{p['step_ms'][ph]:.1f}" for ph in PHASES)
        lines.append("| " + " | ".join(cells) + f" | {errors} | {step} |")
    versus = auto_versus_fixed(points)
    if versus:
        lines += ["", "## `auto` against fixed configurations", ""]
    for v in versus:
        lines += [
            f"T = {v['temperature']}. Best single fixed configuration over the sweep (highest "
            f"geometric mean of tokens/s): `{v['single']}`. `auto` ÷ it, geometric mean over "
            f"loads: **{v['geomean_vs_single']:.3f}**; `auto` ÷ the best fixed configuration "
            f"of each load, worst load: **{v['worst_vs_best']:.3f}**. Headroom (the best fixed "
            f"configuration of each load ÷ the single one, geometric mean): "
            f"**{v['headroom']:.3f}**, the most a per-load choice among these gains.",
            "",
            "| load | auto tok/s | best fixed there | its tok/s | auto ÷ best | auto ÷ single |",
            "|---|---|---|---|---|---|",
        ]
        for r in v["loads"]:
            lines.append(
                f"| {r['load']} | {r['auto']:.1f} | {r['best']} | {r['best_tps']:.1f} | "
                f"{r['ratio']:.3f} | {r['auto'] / r['single_tps']:.3f} |"
            )
        lines.append("")
    ran = [p for p in points if p.get("steps_by_config") and _method(p["config"]) == "auto"]
    if ran:
        lines += ["", "## What `auto` ran (share of its steps)", ""]
        lines += ["| config | load | steps |", "|---|---|---|"]
        for p in ran:
            shares = ", ".join(f"{c} {s:.0%}" for c, s in p["steps_by_config"].items())
            lines.append(f"| {p['config']} | {p['load']} | {shares} |")
    if meta.get("compare"):
        lines += ["", "## Comparison (B / A, same run, interleaved)", ""]
        lines += ["| load | metric | A | B | B/A |", "|---|---|---|---|---|"]
        for row in meta["compare"]:
            lines.append(
                f"| {row['load']} | {row['metric']} | {row['a']:.4g} | {row['b']:.4g} "
                f"| {row['ratio']:.3f} |"
            )
    lines += ["", "## Acceptance per draft position", ""]
    lines += ["| config | load | accepted fraction of steps, position 1..γ |", "|---|---|---|"]
    for p in points:
        acc = ", ".join(f"{a:.2f}" for a in p["acceptance_per_position"]) or "-"
        lines.append(f"| {p['config']} | {p['load']} | {acc} |")
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
