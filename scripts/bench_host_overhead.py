#!/usr/bin/env python3
"""Host time of eager kernel calls: what a call costs the CPU when an engine calls it without a CUDA graph.

Exact command (GPU machine, repo root):
    PYTHONPATH=. python3 scripts/bench_host_overhead.py

For each layer (K, N, m), fp16 x 4-bit group 128 (random Marlin tiles, scripts/bench_kernel.py's operand_copy), after
200 warm-up calls: 3,000 calls of ``marlin_gemm(A, B, s, workspace, out=C)`` in a Python loop, then a synchronize;
printed per call: the time to issue them (the host's cost: argument checks, the launch-shape queries, the launch) and
the time until the GPU had run them all. torch.matmul on a dense fp16 weight of the same shape, the same way, as the
reference. The layers are small, so that the GPU keeps up with the host and the issue time is the host's alone.
"""

from __future__ import annotations

import sys
import time

from bench_kernel import kernel_ready, operand_copy

LAYERS = [(2048, 768, 1), (768, 2048, 16), (4096, 4096, 1), (4096, 4096, 128)]  # (K, N, m)
WARMUP, CALLS = 200, 3000


def per_call_us(torch, call) -> tuple[float, float]:
    """(issue, total) microseconds per call of ``call`` over CALLS calls after WARMUP."""
    for _ in range(WARMUP):
        call()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(CALLS):
        call()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    ended = time.perf_counter()
    return 1e6 * (issued - began) / CALLS, 1e6 * (ended - began) / CALLS


def main() -> int:
    if not kernel_ready():
        return 2
    import torch

    from marlin_convert.kernel import marlin_gemm, required_workspace_ints

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'call':13s} {'K':>5s} {'N':>5s} {'m':>4s} | issue us/call | total us/call")
    for k, n, m in LAYERS:
        b, s, _ = operand_copy(torch, "fp16-int4", k, n, 128, gen)
        workspace = torch.zeros(required_workspace_ints(n), dtype=torch.int32, device="cuda")
        a = torch.randn(m, k, device="cuda", generator=gen).half()
        w = torch.randn(k, n, device="cuda", generator=gen).half()
        c = torch.empty(m, n, dtype=torch.half, device="cuda")
        for name, call in (("marlin_gemm", lambda: marlin_gemm(a, b, s, workspace, out=c)),
                           ("torch.matmul", lambda: torch.matmul(a, w, out=c))):
            issue, total = per_call_us(torch, call)
            print(f"{name:13s} {k:5d} {n:5d} {m:4d} | {issue:13.1f} | {total:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
