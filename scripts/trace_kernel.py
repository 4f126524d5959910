#!/usr/bin/env python3
"""Where one call's time goes: every block's phases, stamped by a development build of the kernel.

Exact command (GPU machine, repo root):
    MARLIN_CONVERT_TRACE=1 PYTHONPATH=. python3 scripts/trace_kernel.py --shapes 4096x4096,4096x12288 --m 1,16

MARLIN_CONVERT_TRACE=1 builds the kernel with -DMARLIN_CONVERT_TRACE (its own cache entry; the release build is
untouched): thread 0 of every block notes %globaltimer at seven phases of its last segment, in registers, and writes
them at the block's end ([TRACE] in kernel/marlin_gemm_impl.cuh):
    0 entry          1 first loads issued (after the [PDL] wait)   2 warp 0's first chunk / stage computed
    3 warp 0's main loop done   4 the block's warps all done (barrier before [RED])
    5 the cross-block wait of the reduction done (cluster barrier or lock; the direct kernel's includes its own sum
      over the warps)   6 the segment's end
For a block of several segments (stream-K), phases 2 .. 6 are those of the segment it takes last (a tile's tail), and
phase 2 counts from phase 1, so it holds every segment before that one. A phase a block never reached (phase 2 where
warp 0 had no chunk) is left out of that phase's figures. Traced kernels run as in release, except that six of them
spill a few bytes for the stamps' registers (the [TRACE] comment in kernel/marlin_gemm_impl.cuh).
Each case is timed as scripts/bench_kernel.py times it (CUDA-graph replays over weight copies larger than L2), with
--pdl 0 by default here (each call waits for the one before); the stamps are those of the last call of the last
replay. Printed per case (variant: split = --split-k, di = MARLIN_CONVERT_DIRECT, pdl = MARLIN_CONVERT_PDL):
    call     the time per call of the graph replay (what bench_kernel.py reports), us
    span     the traced call on the GPU: the first block's entry to the last block's end (%globaltimer), us
    gap      call - span: what the GPU spends between two kernels of the replay (launch, ramp-down, ramp-up); with
             --pdl 1 the entries come before the wait for the kernel before, so span can exceed the call and gap is
             negative
    entry    spread of the blocks' entries (last entry - first); end: spread of their ends
    blk, sm  blocks, SMs they ran on; b/sm: most blocks on one SM; pair: the share of blocks b < SMs whose SM also ran
             block b + SMs (the block scheduler's second round on the same SM)
    ends     when the blocks end, from the first entry: 10th, 50th and 90th percentile (nearest rank), us; lone: the
             blocks alone on their SM (count, median end) against the median end of the others
    phases   per phase, the median and the largest duration over the blocks, ns
A build without the trace define has no `trace_set`: the script says so and stops (exit 2).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernel as bench  # noqa: E402  (time_graph, operand copies, kinds)

PHASES = ("load issue", "first chunk", "main loop", "block done", "cross-block", "out + end")


def summarize(rows, grid: int, sms: int) -> dict:
    """Statistics of one traced call from its stamp rows (a [blocks, 16] list of int lists, as trace_set's buffer
    holds them): span, entry and end spreads, SMs used and how blocks shared them, each phase's durations."""
    rows = [r for r in rows[:grid]]
    done = [r for r in rows if r[0] != 0 and r[6] != 0]
    if not done:
        return {}
    first = min(r[0] for r in done)
    per_sm: dict = {}
    for r in done:
        per_sm[r[7]] = per_sm.get(r[7], 0) + 1
    paired = [b for b in range(min(sms, len(rows))) if b + sms < len(rows) and rows[b][0] and rows[b + sms][0]]
    out = {
        "blocks": len(done),
        "sms": len(per_sm),
        "per_sm": max(per_sm.values()),
        "pair": (sum(rows[b][7] == rows[b + sms][7] for b in paired) / len(paired)) if paired else float("nan"),
        "span": max(r[6] for r in done) - first,
        "entry": max(r[0] for r in done) - first,
        "end": max(r[6] for r in done) - min(r[6] for r in done),
    }
    for i, name in enumerate(PHASES, start=1):
        ns = [r[i] - r[i - 1] for r in done if r[i] and r[i - 1]]  # (a phase never reached stays 0)
        out[name] = (statistics.median(ns), max(ns)) if ns else (float("nan"), float("nan"))
    # when the blocks end (from the first entry): percentiles, and the blocks alone on their SM against the others
    ends = sorted(r[6] - first for r in done)
    out["ends"] = [ends[max(0, math.ceil(q * len(ends)) - 1)] for q in (0.1, 0.5, 0.9)]  # nearest rank
    lone = [r[6] - first for r in done if per_sm[r[7]] == 1]
    shared = [r[6] - first for r in done if per_sm[r[7]] > 1]
    out["lone"] = (len(lone), statistics.median(lone) if lone else float("nan"),
                   statistics.median(shared) if shared else float("nan"))
    return out


def row_text(seconds: float, s: dict) -> str:
    """The table's columns after the case's name, from the call's time and :func:`summarize`'s statistics."""
    call_us, span_us = seconds * 1e6, s["span"] / 1e3
    ends = "/".join(f"{e / 1e3:.1f}" for e in s["ends"])
    lone = f"{s['lone'][0]:>4}/{s['lone'][1] / 1e3:>5.1f}/{s['lone'][2] / 1e3:>5.1f}"
    phases = " ".join(f"{s[p][0]:>6.0f}/{s[p][1]:>6.0f}" for p in PHASES)
    spreads = f"{s['entry'] / 1e3:>5.1f} {s['end'] / 1e3:>5.1f}"
    return (f"{call_us:>6.1f} {span_us:>6.1f} {call_us - span_us:>5.1f} {spreads} "
            f"{s['blocks']:>4} {s['sms']:>3} {s['per_sm']:>4} {s['pair']:>4.2f} | {ends:>16} {lone:>18} | {phases}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=str, default="4096x4096,4096x12288", help="comma-separated KxN")
    parser.add_argument("--m", type=str, default="1,8,16", help="comma-separated batch sizes")
    parser.add_argument("--groups", type=str, default="128", help="comma-separated group sizes, -1 = channelwise")
    parser.add_argument("--kind", type=str, default="fp16-int4", help=f"one of {', '.join(bench.KIND_NAMES)}")
    parser.add_argument("--split-k", type=str, default="0", help="comma-separated split_k values (0 = automatic)")
    parser.add_argument("--direct", type=str, default="-", help="comma-separated MARLIN_CONVERT_DIRECT values "
                                                                "('-' = unset), as in bench_kernel.py")
    parser.add_argument("--pdl", type=str, default="0", help="comma-separated MARLIN_CONVERT_PDL values")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if os.environ.get("MARLIN_CONVERT_TRACE") != "1":
        print("error: set MARLIN_CONVERT_TRACE=1 (the trace build); see --help", file=sys.stderr)
        return 2
    if args.kind not in bench.KIND_NAMES:
        parser.error(f"unknown kind {args.kind!r}")

    import torch

    from marlin_convert.kernel import load_kernel, marlin_gemm, required_workspace_ints

    if not bench.kernel_ready():
        return 2
    module = load_kernel(0)
    if not hasattr(module, "trace_set"):
        print("error: the loaded kernel build has no trace_set (not a MARLIN_CONVERT_TRACE build)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    floor = bench.launch_floor(torch, args.repeats)
    print(f"Launch floor (a one-element fill per call, graph replays): {floor * 1e6:.1f} us")
    dtype_name, bits, _ = bench.KIND_NAMES[args.kind]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    buffer = torch.zeros(1 << 16, 16, dtype=torch.int64, device="cuda")
    module.trace_set(buffer)
    head = " ".join(f"{name:>13}" for name in PHASES)
    print(f"{'K':>6} {'N':>6} {'g':>4} {'m':>3} {'variant':>16} | {'call':>6} {'span':>6} {'gap':>5} {'entry':>5} "
          f"{'end':>5} {'blk':>4} {'sm':>3} {'b/sm':>4} {'pair':>4} | {'ends p10/50/90':>16} "
          f"{'lone n/end/others':>18} | {head}   (phases: median / max ns)")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        for g in (int(v) for v in args.groups.split(",")):
            ops, _ = bench._operands(torch, args.kind, k, n, g, gen)
            workspace = torch.zeros(required_workspace_ints(n), dtype=torch.int32, device="cuda")
            for m in (int(v) for v in args.m.split(",")):
                a = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                c = torch.empty(m, n, dtype=dtype, device="cuda")
                for split in (int(v) for v in args.split_k.split(",")):
                    for direct in args.direct.split(","):
                        for pdl in args.pdl.split(","):
                            for var, value in (("MARLIN_CONVERT_DIRECT", direct), ("MARLIN_CONVERT_PDL", pdl)):
                                if value == "-":
                                    os.environ.pop(var, None)
                                else:
                                    os.environ[var] = value

                            def call(i):
                                return marlin_gemm(a, ops[i][0], ops[i][1], workspace, out=c, split_k=split,
                                                   zp=ops[i][2], bits=bits)
                            buffer.zero_()
                            t = bench.time_graph(torch, call, len(ops), args.repeats)
                            launch = module.last_launch()
                            grid = int(re.search(r"grid=(\d+)", launch).group(1))
                            s = summarize(buffer[:grid].cpu().tolist(), grid, props.multi_processor_count)
                            variant = f"split{split}/di{direct}/pdl{pdl}"
                            if not s:
                                print(f"{k:>6} {n:>6} {g:>4} {m:>3} {variant:>16} | {t * 1e6:>6.1f}  no stamps "
                                      f"[{launch}]")
                                continue
                            print(f"{k:>6} {n:>6} {g:>4} {m:>3} {variant:>16} | {row_text(t, s)}  [{launch}]",
                                  flush=True)
            for var in ("MARLIN_CONVERT_DIRECT", "MARLIN_CONVERT_PDL"):
                os.environ.pop(var, None)
            ops = None  # (the copies are freed before the next shape's)
            torch.cuda.empty_cache()
    module.trace_set(None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
