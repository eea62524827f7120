"""The default target's projections as torch's low-bit CPU kernels multiply them, against
packed bfloat16: one pass over every layer's weights, so that they stream from memory as in a
forward (one weight called in a loop stays in the cache, and favours compute over bytes).

    .venv/bin/python scripts/low_bit_products.py [--threads 2] [--rounds 5]

Random weights of SmolLM2-135M's shapes (30 layers: q, k, v, o, gate, up, down; 212 MB in
bfloat16; the head left out), bfloat16 activations of 1, 4, 5 and 9 rows. Layouts: packed
bfloat16 (`workers.llama.Linear` as the engine builds it), int8 with a scale per output feature
(`workers.llama.Int8Linear`, `--dtype int8`), int4 in groups of 32 with a step and a zero
each (`workers.llama.Int4Linear`, `--dtype int4`), and float32 both ways the engine can
multiply it (packed for oneDNN, as it builds it; dense, F.linear's MKL GEMM), with float32
activations. Prints each layout's median ms per pass and bfloat16's over it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockspec.workers.llama import Int4Linear, Int8Linear, Linear, packs_weights

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [0.05 * torch.randn(*shape, dtype=torch.bfloat16) for shape in SHAPES * 30]
    layouts = {
        "bf16 packed": [Linear(w, packed=packs_weights(w)) for w in weights],
        "int8": [Int8Linear(w) for w in weights],
        "int4": [Int4Linear(w) for w in weights],
        "f32 packed": [Linear(w.float(), packed=True) for w in weights],
        "f32 dense": [Linear(w.float()) for w in weights],
    }
    print(f"{len(weights)} weights, threads {args.threads}, ms per pass (bf16 packed / layout)")
    with torch.inference_mode():
        for rows in (1, 4, 5, 9):
            inputs = {
                dtype: {n: torch.randn(rows, n, dtype=dtype) for n in (576, 1536)}
                for dtype in (torch.bfloat16, torch.float32)
            }
            ms: dict[str, list[float]] = {name: [] for name in layouts}
            for _ in range(args.rounds + 1):  # the first round warms, and is dropped
                for name, mods in layouts.items():
                    start = time.perf_counter()
                    by_width = inputs[torch.float32 if name.startswith("f32") else torch.bfloat16]
                    for m, (_, width) in zip(mods, SHAPES * 30, strict=True):
                        m(by_width[width])
                    ms[name].append(1e3 * (time.perf_counter() - start))
            base = statistics.median(ms["bf16 packed"][1:])
            cells = [
                f"{name} {statistics.median(v[1:]):.2f} ({base / statistics.median(v[1:]):.2f}×)"
                for name, v in ms.items()
            ]
            print(f"rows {rows}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
