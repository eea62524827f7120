"""From request records to the numbers a user compares: per (configuration, load) point
throughput, latency / time-to-first-token percentiles, time per output token, block efficiency,
acceptance per draft position, the batch sizes the coordinator ran, where step time went, and
errors by status code. Writes JSON, CSV, PNG plots and report.md.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from protos import blockspec_pb2 as pb

PHASES = tuple(f.name for f in pb.StepBreakdown.DESCRIPTOR.fields)  # the wire's step phases


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    return float(np.percentile(values, q, method="inverted_cdf")) if values else math.nan


def summarize(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if r["code"] == "OK"]
    tokens = sum(r["tokens"] for r in ok)
    calls = sum(r["target_calls"] for r in ok)
    latency = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [
        (r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1)
        for r in ok
        if r["ttft_s"] is not None and r["tokens"] > 1
    ]
    gamma = max((len(r["accepted_per_position"]) for r in ok), default=0)
    accepted = [0] * gamma
    for r in ok:
        for i, n in enumerate(r["accepted_per_position"]):
            accepted[i] += n

    def weighted(value) -> float:  # mean over steps: per-request values weighted by its steps
        return sum(value(r) * r["target_calls"] for r in ok) / max(calls, 1)

    return dict(
        requests=len(records),
        ok=len(ok),
        errors=dict(Counter(r["code"] for r in records if r["code"] != "OK")),
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else math.nan,
        latency_p50=percentile(latency, 50),
        latency_p90=percentile(latency, 90),
        latency_p99=percentile(latency, 99),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        block_efficiency=tokens / calls if calls else math.nan,
        acceptance_per_position=[a / max(calls, 1) for a in accepted],
        mean_batch_size=weighted(lambda r: r["mean_batch_size"]),
        step_ms={p: weighted(lambda r, p=p: r["step_ms"].get(p, 0.0)) for p in PHASES},
    )


COLUMNS = [
    ("config", "{}"),
    ("load", "{}"),
    ("ok", "{}"),
    ("tokens_per_s", "{:.1f}"),
    ("latency_p50", "{:.2f}"),
    ("latency_p90", "{:.2f}"),
    ("latency_p99", "{:.2f}"),
    ("ttft_p50", "{:.3f}"),
    ("tpot_p50", "{:.4f}"),
    ("block_efficiency", "{:.2f}"),
    ("mean_batch_size", "{:.1f}"),
]


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
        by_method[p["config"].split()[0]][p["config"]].append(p)
    files = []
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
        "Per point: requests that succeeded, output tokens/s over the point's wall time, request "
        "latency and time-to-first-token percentiles (s), median time per output token after the "
        "first (s), block efficiency (tokens per target call), mean batch size of the steps that "
        "served the requests, and the mean step time by phase (ms).",
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
