#!/usr/bin/env python3
"""Launch the kernel a few times on one shape, for Nsight Compute (``ncu``) to profile; prints nothing useful itself.

    ncu --kernel-name regex:marlin_gemm_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python3 scripts/profile_kernel.py --shape 8192x57344 --m 1 --group 128 --bits 4 [--cfg 10]

The operands are bench_kernel.py's (one copy of them): B random int32 (random Marlin words are valid codes for
any bits), small random scales, random zero points with --zp. Three launches: the first two warm up (and build the
kernel), ``--launch-skip 2`` profiles the third.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernel import KIND_NAMES, operand_copy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8192x57344", help="KxN")
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--group", type=int, default=128, help="-1 = channelwise")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--zp", action="store_true", help="with zero points (random, as bench_kernel.py's)")
    parser.add_argument("--cfg", type=int, default=None, help="MARLIN_CONVERT_SMALL_CFG (fp16 4-bit, m <= 16)")
    args = parser.parse_args()
    if args.cfg is not None:
        os.environ["MARLIN_CONVERT_SMALL_CFG"] = str(args.cfg)

    import torch

    from marlin_convert.kernel import ensure_kernel, marlin_gemm, required_workspace_ints

    ensure_kernel(0)
    k, n = (int(v) for v in args.shape.lower().split("x"))
    kind = next(name for name, value in KIND_NAMES.items() if value == (args.dtype, args.bits, args.zp))
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, s, zp = operand_copy(torch, kind, k, n, args.group, gen)
    A = torch.randn(args.m, k, device="cuda", dtype=s.dtype, generator=gen)
    workspace = torch.zeros(required_workspace_ints(n), device="cuda", dtype=torch.int32)
    for _ in range(3):
        marlin_gemm(A, B, s, workspace, zp=zp, bits=args.bits)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
