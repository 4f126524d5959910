#!/usr/bin/env python3
"""Time the weight repack (marlin_convert.layout) on one matrix: the C fast path, the numpy fallback and the inverse.

    python scripts/bench_repack.py                       # 4096 x 11008 (a Llama-7B up/gate projection), 4 and 8 bits
    python scripts/bench_repack.py --k 14336 --n 4096 --bits 8 --repeat 9

Each figure is the fastest and the median of --repeat runs on the same random words, writing into one preallocated
output (as the converter does); MiB/s counts the qweight bytes read. The C and numpy outputs are compared first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from marlin_convert import layout  # noqa: E402


def _seconds(run, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=11008)
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for bits in args.bits:
        qweight = rng.integers(0, 2**32, size=(args.k * bits // 32, args.n), dtype=np.uint32).view(np.int32)
        out = np.empty((args.k // layout.TILE, args.n * bits // 2), dtype=np.int32)
        b = layout.gptq_to_marlin_weight_numpy(qweight, bits=bits)
        runs = {"numpy": lambda: layout.gptq_to_marlin_weight_numpy(qweight, out=out, bits=bits),
                "inverse (numpy)": lambda: layout.marlin_to_gptq_weight(b, bits=bits)}
        if layout.fast_repack_available(bits):
            if not np.array_equal(layout.gptq_to_marlin_weight(qweight, bits=bits), b):
                raise SystemExit(f"{bits}-bit: the C fast path and the numpy code disagree")
            runs = {"C": lambda: layout.gptq_to_marlin_weight(qweight, out=out, bits=bits), **runs}
        else:
            print(f"{bits}-bit: no C fast path here (not built, or MARLIN_CONVERT_PURE_NUMPY=1)")
        mib = qweight.nbytes / 2**20
        for name, run in runs.items():
            best, median = _seconds(run, args.repeat)
            print(f"{bits}-bit {args.k} x {args.n} ({mib:.0f} MiB)  {name:16s} min {best * 1e3:7.1f} ms  "
                  f"median {median * 1e3:7.1f} ms  {mib / best:6.0f} MiB/s")


if __name__ == "__main__":
    main()
