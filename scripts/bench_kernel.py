#!/usr/bin/env python3
"""Benchmark the bundled Marlin kernel against torch matmul (same activation dtype) on the dequantized weight.

Exact command (GPU machine, repo root):
    PYTHONPATH=. python3 scripts/bench_kernel.py            # full table: 8 shapes x 8 batch sizes x 2 group sizes
    PYTHONPATH=. python3 scripts/bench_kernel.py --quick    # 4 shapes, m = 1..16 and 64, 128, group 128 only
    PYTHONPATH=. python3 scripts/bench_kernel.py --m 1,2,4,8,16 --groups 128 \\
        --kinds fp16-int4,fp16-int8,fp16-int4-zp,bf16-int4,bf16-int8,bf16-int4-zp,tinygemm   # the other kinds

What is timed: one launch per weight copy, replayed from a CUDA graph (so Python/launch overhead is out of the
numbers), several weight copies rotated so the weight is not L2-resident (L2 is 60 MB on an H200: the copies of each
operand together exceed 4 x 60 MB), CUDA events, median of the repeats after at least 50 ms of warm-up replays. On
Hopper our calls run with programmatic dependent launch by default, so each overlaps the end of the call before it in
the graph (see --pdl; --pdl 0 times them serialized, as torch's are).
Bandwidth arithmetic:
    ours   bytes = B (k * n * bits / 8) + s (k / g * n * 2) [+ zp (k / g * n * bits / 8)] + A (m * k * 2)
                   + C (m * n * 2)
    torch  bytes = W (k * n * 2) + A + C         (torch.matmul in the kind's activation dtype, fp16 or bf16)
    tinygemm bytes = W (k * n / 2) + scales and zeros (k / g * n * 2 * 2) + A + C   (torch._weight_int4pack_mm, bf16;
           its speed-up is over torch's bf16 matmul)
    copy   bytes = 2 * size (read + write) of a 2 GiB device-to-device copy, median of 30 event-timed copies, measured
           in the same run: the ceiling for "% copy".
    launch floor: a one-element fill per call, timed as our calls are (graph replays of back-to-back kernels): the
           time no call can go under, printed once at the start.
    --cfgs 0,1,..  times each m <= 16 kernel configuration (MARLIN_CONVERT_SMALL_CFG: fp16 x 4-bit symmetric in
           kernel/marlin_gemm.cu; in dispatch_kind, kernel/marlin_gemm_impl.cuh, 16 / 17 for the other 4-bit kinds'
           8-strip kernel (skip it / take it channelwise at k >= 16384 too) and 20-22 for 8-bit; for every 4-bit
           kind 24 = no 128-column 8-strip kernel at m = 9..16, 25 = not on its grouped one-wave layers
           (wide_eight_pays); a value a kind does not know gives its default; "-" = unset)
           against the same torch time and prints a geomean per configuration.
    --stream-k 0,1,2   times each value of MARLIN_CONVERT_STREAM_K (benchmark only: 0 = split-K, N = stream-K over N
           blocks per SM at most, kernel/marlin_gemm_impl.cuh launch_config; N > 0 also caps the direct-load kernel's
           stream-K grid at N blocks per SM, direct_plan), crossed with --cfgs.
    --wgmma 0,1,2   times each value of MARLIN_CONVERT_WGMMA (Hopper, m > 32, 4-bit kinds: 0 = the mma.sync kernels,
           1 = the default rule, 2..4 = a fixed wgmma configuration, try_wgmma in kernel/marlin_gemm_impl.cuh), crossed
           with the two above.
    --wgmma-cluster 0,1   times each value of MARLIN_CONVERT_WGMMA_CLUSTER (Hopper: 0 = the wgmma kernel's split-K
           partial sums meet in C under a lock, one contributor after another; 1 = the default, in a thread-block
           cluster's distributed shared memory where cluster_split allows, kernel/marlin_gemm_impl.cuh), crossed with
           the above.
    --direct 0,1,2,3   times each value of MARLIN_CONVERT_DIRECT (Hopper, m <= 16, 4-bit kinds: 0 = the pipelined
           kernels, 1 = the default (the direct-load kernel where direct_pays, kernel/marlin_gemm_direct.cuh; never
           with --split-k), 2 = the direct-load kernel wherever it fits, with --split-k N as its blocks per tile (a
           cluster of N), 3 = its stream-K form wherever it fits), crossed with the above; a --cfgs value other than
           "-" takes the pipelined kernels whatever --direct says.
    --pdl 0,1   times each value of MARLIN_CONVERT_PDL (Hopper: 0 = each launch waits for the kernel before it to end,
           1 = the default, programmatic dependent launch where the kernel's grid allows it: a launch may start while
           the one before runs, and waits for it before its first memory access). The graph replays one call after
           another, so with PDL each call overlaps the end of the call before; torch's matmul gets no such overlap.
           PDL 0 is the kernel-for-kernel comparison; PDL 1 (and a run without --pdl) is what a chain of these calls
           gets.
    --show-launch   ends each row with the configuration of the kernel our call launched (family, tile, strips,
           stages, schedule, grid), as the library notes it.
    --kinds ...   kinds to time (default fp16-int4): {fp16,bf16}-int{4,8}[-zp] and tinygemm; each against torch's matmul
           in its own activation dtype, measured in the same run.
Last, a short table of the geometric-mean speed-up for m = 1..16 and m = 2..16 per kind and group size, and each
kind's m = 1..16 figure relative to fp16-int4's.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096), (8192, 10240), (8192, 8192), (8192, 57344),
          (28672, 8192)]
MS = [1, 2, 4, 8, 16, 32, 64, 128]
GROUPS = [128, -1]
ROTATE_BYTES = 4 * 60 * 2**20  # rotate copies until they exceed 4 x L2


def time_graph(torch, fn, calls: int, repeats: int) -> float:
    """Median seconds per call of `fn(i)` for i in range(calls), from CUDA graph replays timed with events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up (builds, cuBLAS handles, attributes)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        run = graph.replay
    except Exception as exc:  # fall back to plain launches (host overhead included)
        print(f"  (graph capture failed: {exc}; timing plain launches)")
        def run():
            for i in range(calls):
                fn(i)
    # warm-up replays for at least 50 ms of GPU time: the first timed replays after a new shape's weights were
    # allocated ran up to 14 % slow with 3 replays only (8192 x 57344, m = 1: 88 against 77 us, torch 257 against 232)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        run()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) / 1e3 / 3, 1e-6)
    for _ in range(math.ceil(0.05 / one)):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def gpu_state(torch) -> str:
    """The GPU's SM and memory clocks, temperature and power now (``nvidia-smi``), or why they are not known. The
    kernels at m <= 16 are sensitive to the SM clock where torch's memory-bound matmul is not: two lent H200s gave
    the same torch times and direct-kernel times 10 % apart."""
    fields = ("clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw")
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    ids = [str(index)]  # the GPU by its PCI address first (CUDA's device order need not be nvidia-smi's)
    if all(hasattr(props, f) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        ids.insert(0, f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0")
    why = "no answer"
    for gpu in ids:
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader",
                                   f"--id={gpu}"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unknown ({exc})"
        values = done.stdout.strip().split(", ")
        if done.returncode == 0 and len(values) == len(fields):
            return f"GPU {gpu}: " + ", ".join(f"{name} {value}" for name, value in zip(fields, values))
        why = f"nvidia-smi --id={gpu} exit {done.returncode}: {(done.stdout or done.stderr).strip()[:200]}"
    return f"unknown ({why})"


def copy_bandwidth(torch, size: int = 2 * 2**30, repeats: int = 30) -> float:
    """Device-to-device copy rate, bytes read + bytes written per second: a 2 GiB buffer (far beyond L2), plain
    launches (one copy is ~1 ms, so launch overhead is negligible), CUDA events around each copy, median."""
    src = torch.empty(size, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * size / statistics.median(times)


def launch_floor(torch, repeats: int) -> float:
    """Seconds per call of the smallest kernel timed the way our calls are (time_graph): a fill of one element per
    call, so what remains is the gap the GPU leaves between back-to-back kernels of a graph replay. No layer's call can
    take less."""
    cells = [torch.empty(1, dtype=torch.float16, device="cuda") for _ in range(8)]
    return time_graph(torch, lambda i: cells[i].fill_(1.0), len(cells), repeats)


KIND_NAMES = {  # name -> (activation dtype, bits, zero points)
    "fp16-int4": ("float16", 4, False), "fp16-int4-zp": ("float16", 4, True), "fp16-int8": ("float16", 8, False),
    "fp16-int8-zp": ("float16", 8, True), "bf16-int4": ("bfloat16", 4, False), "bf16-int4-zp": ("bfloat16", 4, True),
    "bf16-int8": ("bfloat16", 8, False), "bf16-int8-zp": ("bfloat16", 8, True),
}
TINYGEMM = "tinygemm"  # torch._weight_int4pack_mm: bf16 activations, 4-bit weights with scales and zeros, g 32..256


def operand_bytes(kind: str, k: int, n: int, g: int) -> int:
    """The bytes one call of ``kind`` reads of its weight operands (see the bandwidth arithmetic above)."""
    rows = 1 if g == -1 else k // g
    if kind == TINYGEMM:
        return k * n // 2 + rows * n * 2 * 2
    _, bits, zp = KIND_NAMES[kind]
    return k * n * bits // 8 + rows * n * 2 + (rows * n * bits // 8 if zp else 0)


def operand_copy(torch, kind: str, k: int, n: int, g: int, gen) -> tuple:
    """One random copy of the weight operands of ``kind`` (the kernel's time does not depend on the values; random,
    not zeros), the arguments after A: Marlin (B, s, zp; zp None without zero points) or tinygemm (packed weight,
    scales_and_zeros). Random Marlin words are valid codes for any bits."""
    rows = 1 if g == -1 else k // g
    if kind == TINYGEMM:
        packed = torch._convert_weight_to_int4pack(
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen), 8)
        sz = (torch.rand(rows, n, 2, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        return packed, sz
    dtype_name, bits, zp = KIND_NAMES[kind]
    b = torch.randint(-2**31, 2**31 - 1, (k // 16, n * bits // 2), dtype=torch.int32, device="cuda", generator=gen)
    sc = (torch.rand(rows, n, device="cuda", generator=gen) * 0.02 + 0.002).to(getattr(torch, dtype_name))
    z = (torch.randint(-2**31, 2**31 - 1, (rows, n * bits // 32), dtype=torch.int32, device="cuda", generator=gen)
         if zp else None)
    return b, sc, z


def _operands(torch, kind: str, k: int, n: int, g: int, gen):
    """Weight copies of one kind (:func:`operand_copy`), enough to exceed 4 x L2, and the bytes one call reads of
    them."""
    w_bytes = operand_bytes(kind, k, n, g)
    copies = max(2, math.ceil(ROTATE_BYTES / w_bytes))
    return [operand_copy(torch, kind, k, n, g, gen) for _ in range(copies)], w_bytes


def kernel_ready() -> bool:
    """Build or load the kernel for GPU 0; where it cannot run (no GPU, a CPU build of torch, no nvcc), say why on one
    line of stderr and return False (the scripts then exit 2, not with a traceback)."""
    from marlin_convert.errors import KernelUnavailableError
    from marlin_convert.kernel import ensure_kernel

    try:
        ensure_kernel(0)
    except KernelUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 shapes, m = 1..16, 64, 128, group 128")
    parser.add_argument("--m", type=str, help="comma-separated batch sizes (default: all)")
    parser.add_argument("--shapes", type=str, help="comma-separated KxN, e.g. 4096x4096,8192x57344")
    parser.add_argument("--groups", type=str, help="comma-separated group sizes, -1 = channelwise")
    parser.add_argument("--split-k", type=int, default=0, help="force the split over k (0 = automatic)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cfgs", type=str, help="comma-separated m <= 16 configurations to compare (benchmark only; "
                                                 "fp16-int4 only)")
    parser.add_argument("--stream-k", type=str, help="comma-separated MARLIN_CONVERT_STREAM_K values to compare "
                                                     "(benchmark only; 0 = split-K, N = stream-K at <= N blocks per SM)")
    parser.add_argument("--wgmma", type=str, help="comma-separated MARLIN_CONVERT_WGMMA values to compare "
                                                  "(benchmark only; 0 = mma.sync kernels, N = wgmma variant N)")
    parser.add_argument("--wgmma-cluster", type=str, help="comma-separated MARLIN_CONVERT_WGMMA_CLUSTER values to "
                                                          "compare (0 = lock chain through C, 1 = cluster reduction)")
    parser.add_argument("--direct", type=str, help="comma-separated MARLIN_CONVERT_DIRECT values to compare "
                                                   "(benchmark only; 0 = pipelined kernels, 1 = default, "
                                                   "2 = direct-load kernel wherever it fits, 3 = its stream-K "
                                                   "form)")
    parser.add_argument("--pdl", type=str, help="comma-separated MARLIN_CONVERT_PDL values to compare (0 = off, "
                                                "1 = programmatic dependent launch, the default on Hopper)")
    parser.add_argument("--kinds", type=str, default="fp16-int4",
                        help=f"comma-separated kinds: {', '.join(KIND_NAMES)}, {TINYGEMM} (default fp16-int4)")
    parser.add_argument("--show-launch", action="store_true",
                        help="end each row with the kernel configuration the call launched (note_launch)")
    args = parser.parse_args(argv)

    import torch

    from marlin_convert.kernel import load_kernel, marlin_gemm, required_workspace_ints

    if not kernel_ready():
        return 2
    last_launch = load_kernel(0).last_launch
    shapes, ms, groups = SHAPES, MS, GROUPS
    if args.quick:
        shapes, ms, groups = [(4096, 4096), (4096, 12288), (8192, 8192), (8192, 57344)], [1, 2, 4, 8, 16, 64, 128], [128]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    if args.m:
        ms = [int(v) for v in args.m.split(",")]
    if args.groups:
        groups = [int(v) for v in args.groups.split(",")]
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in KIND_NAMES and kind != TINYGEMM:
            parser.error(f"unknown kind {kind!r}: choose from {', '.join(KIND_NAMES)}, {TINYGEMM}")

    props = torch.cuda.get_device_properties(0)
    x = torch.randn(8192, 8192, device="cuda").half()
    for _ in range(200):  # ~0.5 s of work so clocks are up before anything is timed
        x @ x
    torch.cuda.synchronize()
    del x
    copy_bw = copy_bandwidth(torch)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"D2D copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"GPU state at the start: {gpu_state(torch)}")
    print(f"Launch floor (a one-element fill per call, timed as our calls are): "
          f"{launch_floor(torch, args.repeats) * 1e6:.1f} us")
    print(f"{'kind':>12} {'K':>6} {'N':>6} {'g':>4} {'m':>4} | {'ours us':>8} {'torch us':>8} {'speedup':>7} | "
          f"{'ours GB/s':>9} {'% copy':>6} {'torch GB/s':>10}")
    def variant_values(option):  # "-" = the default (variable unset)
        return [None if v == "-" else int(v) for v in option.split(",")] if option else [None]

    cfgs, sks, wgs = variant_values(args.cfgs), variant_values(args.stream_k), variant_values(args.wgmma)
    dis, pdls, wcs = variant_values(args.direct), variant_values(args.pdl), variant_values(args.wgmma_cluster)
    variants = [(cfg, sk, wg, wc, di, pd) for cfg in cfgs for sk in sks for wg in wgs for wc in wcs for di in dis
                for pd in pdls]
    switches = ("MARLIN_CONVERT_SMALL_CFG", "MARLIN_CONVERT_STREAM_K", "MARLIN_CONVERT_WGMMA",
                "MARLIN_CONVERT_WGMMA_CLUSTER", "MARLIN_CONVERT_DIRECT", "MARLIN_CONVERT_PDL")
    speedups: dict = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in shapes:
        # torch's matmul on a dense weight of each activation dtype, timed once per shape and m
        dtypes = sorted({"bfloat16" if kd == TINYGEMM else KIND_NAMES[kd][0] for kd in kinds})
        torch_us: dict = {}
        w_bytes = k * n * 2
        nw = max(2, math.ceil(ROTATE_BYTES / w_bytes))
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            ws = [(torch.randn(k, n, device="cuda", generator=gen) * 0.01).to(dtype) for _ in range(nw)]
            for m in ms:
                a = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                c2 = torch.empty(m, n, dtype=dtype, device="cuda")
                torch_us[dtype_name, m] = time_graph(torch, lambda i: torch.matmul(a, ws[i], out=c2), nw,
                                                     args.repeats)
            ws = None  # frees the weights (assigned, not del: the lambda above names ws)
            torch.cuda.empty_cache()
        for g in groups:
            for kind in kinds:
                if kind == TINYGEMM and not (g != -1 and 32 <= g <= 256):
                    continue  # tinygemm takes group sizes 32 .. 256 only
                dtype_name = "bfloat16" if kind == TINYGEMM else KIND_NAMES[kind][0]
                dtype = getattr(torch, dtype_name)
                try:
                    ops, op_bytes = _operands(torch, kind, k, n, g, gen)
                except (RuntimeError, AttributeError) as exc:  # tinygemm: an op this torch build may lack
                    print(f"{kind:>12} {k:>6} {n:>6} {g:>4}      | unavailable: {str(exc).splitlines()[0]}")
                    continue
                workspace = torch.zeros(required_workspace_ints(n), dtype=torch.int32, device="cuda")
                for m in ms:
                    a = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                    c = torch.empty(m, n, dtype=dtype, device="cuda")
                    t_torch = torch_us[dtype_name, m]
                    act = m * k * 2 + m * n * 2
                    for values in (variants if kind != TINYGEMM else [(None,) * len(switches)]):
                        for var, value in zip(switches, values):
                            if value is None:
                                os.environ.pop(var, None)
                            else:
                                os.environ[var] = str(value)
                        if kind == TINYGEMM:
                            def call(i):
                                return torch._weight_int4pack_mm(a, ops[i][0], g, ops[i][1])
                        else:
                            bits = KIND_NAMES[kind][1]

                            def call(i):
                                return marlin_gemm(a, ops[i][0], ops[i][1], workspace, out=c, split_k=args.split_k,
                                                   zp=ops[i][2], bits=bits)
                        t_ours = time_graph(torch, call, len(ops), args.repeats)
                        ours_bw = (op_bytes + act) / t_ours
                        torch_bw = (w_bytes + act) / t_torch
                        sp = t_torch / t_ours
                        variant = "/".join(f"{name}{v}" for name, v in zip(("c", "sk", "wg", "wc", "di", "pdl"), values)
                                           if v is not None)
                        speedups.setdefault((kind, variant), {}).setdefault(g, {}).setdefault(m, []).append(sp)
                        tag = f" {variant}" if variant else ""
                        if args.show_launch and kind != TINYGEMM:
                            tag += f"  [{last_launch()}]"
                        print(f"{kind:>12} {k:>6} {n:>6} {g:>4} {m:>4} | {t_ours * 1e6:>8.1f} {t_torch * 1e6:>8.1f} "
                              f"{sp:>6.2f}x | {ours_bw / 1e9:>9.0f} {100 * ours_bw / copy_bw:>5.0f}% "
                              f"{torch_bw / 1e9:>10.0f}{tag}", flush=True)
                    for var in switches:
                        os.environ.pop(var, None)
                assert int(workspace.abs().sum()) == 0, "workspace not left zeroed"
                ops = None  # frees the operands (assigned, not del: call above names ops)
                torch.cuda.empty_cache()

    def geomean(values):
        return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")

    print("\ngeometric-mean speed-up over torch matmul in the same activation dtype (all shapes); "
          "'vs fp16-int4' = this kind's m = 1..16 figure over fp16-int4's (same group and variant, same run; a kind "
          "without variants: over fp16-int4's first variant)")
    print(f"{'kind':>12} {'variant':>8} {'group':>6} | {'m=1..16':>8} {'m=2..16':>8} {'vs fp16-int4':>12} | "
          + " ".join(f"{'m=' + str(m):>7}" for m in ms))
    for (kind, variant), by_group in speedups.items():
        for g in groups:
            sg = by_group.get(g, {})
            if not sg:
                continue
            small = geomean([v for m, vals in sg.items() if 1 <= m <= 16 for v in vals])
            small2 = geomean([v for m, vals in sg.items() if 2 <= m <= 16 for v in vals])
            # the same variant's fp16-int4 row; a kind timed without variants (tinygemm) takes fp16-int4's first
            base = (speedups.get(("fp16-int4", variant)) or speedups.get(("fp16-int4", ""))
                    or next((rows for (k, _), rows in speedups.items() if k == "fp16-int4"), {})).get(g, {})
            base_small = geomean([v for m, vals in base.items() if 1 <= m <= 16 for v in vals])
            per_m = " ".join(f"{geomean(sg.get(m, [])):>6.2f}x" for m in ms)
            print(f"{kind:>12} {variant or '-':>8} {g:>6} | {small:>7.2f}x {small2:>7.2f}x {small / base_small:>11.2f}x | "
                  f"{per_m}")
    print(f"GPU state at the end: {gpu_state(torch)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
