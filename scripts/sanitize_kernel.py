#!/usr/bin/env python3
"""Small kernel calls for compute-sanitizer: every kind, group size and m-path on tiny shapes, each checked.

Run under the sanitizer (after the kernel is built, so that the JIT build is not instrumented), e.g.
    compute-sanitizer --tool memcheck --kernel-name kns=marlin_gemm_kernel --error-exitcode 3 \\
        python3 scripts/sanitize_kernel.py
    compute-sanitizer --tool racecheck ... python3 scripts/sanitize_kernel.py --few
    compute-sanitizer --tool synccheck ... python3 scripts/sanitize_kernel.py --few
    compute-sanitizer --tool initcheck ... python3 scripts/sanitize_kernel.py --host-inputs
    python3 scripts/sanitize_kernel.py --few --wgmma any --isolate racecheck   # one call per process, a line each
``scripts/gpu_check.sh`` runs memcheck, racecheck, synccheck and initcheck this way. Each call gets fresh random
inputs and a NaN-poisoned output, and is compared with an fp32 reference (mean relative error < 1e-2: this is a memory
and race check, the accuracy bounds are in tests/test_kernel_gpu.py); exit status 1 on a wrong result.
Shapes: n = 64 (one 64-column tile, the most k-splits: the lock chain) and 192, group 16 (a warp's strips cross
groups; an unexplained segfault was once seen at group 16, n = 64), 32, 64, 128 and channelwise, act-order,
m = 1, 9, 17 (m <= 8, 9..16 and > 16 kernels), forced k-splits, n = 10240, 17408, 34816 (and 4352 with k = 16448)
for the m <= 16 kernels of larger n, stream-K grids (MARLIN_CONVERT_STREAM_K), the Hopper wgmma kernel
(MARLIN_CONVERT_WGMMA) and the Hopper direct-load kernel (MARLIN_CONVERT_DIRECT = 2: m <= 32, clusters of 3, 5 and 8 blocks; = 3: its stream-K form, blocks
of two segments, a tile over 4 blocks; every wgmma and direct case kept by --few).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = [(dtype, bits, asym) for dtype in ("float16", "bfloat16") for bits in (4, 8) for asym in (False, True)]


def main(argv=None) -> int:
    # (no abbreviations: --isolate's children get their options rebuilt from these, never an '--iso' of their own)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--few", action="store_true", help="fewer calls (for racecheck and synccheck, which are slow)")
    parser.add_argument("--host-inputs", action="store_true",
                        help="make every tensor the kernel reads on the host and copy it over, and gather act-order "
                             "columns on the host (for initcheck with --kernel-name: writes of uninstrumented torch "
                             "kernels are not tracked, so their outputs would read as uninitialized)")
    parser.add_argument("--wgmma", type=str,
                        help="only the calls with this MARLIN_CONVERT_WGMMA value (a quick pass over one variant; "
                             "'any': every call that sets one, i.e. the Hopper wgmma kernel's)")
    parser.add_argument("--list", action="store_true", help="print the selected calls with their index; run none")
    parser.add_argument("--index", type=int, metavar="I", help="only the I-th of the selected calls (0-based)")
    parser.add_argument("--isolate", metavar="TOOL",
                        help="run each selected call in a process of its own under 'compute-sanitizer --tool TOOL' "
                             "and print one line per call (racecheck: a hazard reported inside one launch, rather "
                             "than across the launches of one process); exit 1 if any call's run fails")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from marlin_convert import layout
    from marlin_convert.kernel import ensure_kernel, marlin_gemm, required_workspace_ints

    rng = np.random.default_rng(0)
    cases = []  # (kind, m, k, n, group, act_order, split_k)
    for kind in KINDS:
        for group in (16, 32, 64, 128, -1):
            for m in (1, 9, 17):
                cases.append((kind, m, 256, 64, group, False, 0))
        cases += [(kind, 3, 512, 192, 64, True, 0), (kind, 12, 512, 64, 16, False, 4),
                  (kind, 5, 128, 17408, 32, False, 0), (kind, 10, 128, 17408, -1, False, 0),
                  (kind, 40, 256, 192, 128, False, 3), (kind, 6, 128, 10240, 64, False, 0),
                  (kind, 2, 128, 34816, 32, False, 0),  # n / 256 >= SMs: fp16 4-bit 4 strips x 2 stages
                  (kind, 14, 272, 10240, 16, False, 0),  # 4-bit zero points, grouped, n / 64 > SMs: 4 strips x 2
                                                         # stages, two batch blocks, group 16, a partial last stage
                  (kind, 13, 256, 8192, 128, False, 0),  # m = 9..16, SMs / 2 < n / 64 <= SMs: 4 strips x 2
                                                         # stages split in two over k (fp16 4-bit: 8 strips x 2)
                  (kind, 5, 1040, 8192, 16, False, 0),   # fp16 4-bit, the same with a partial stage: 8 strips x 2
                  (kind, 70, 528, 256, 16, False, 0),    # m = 65..96 (4-bit: three 32-row chunks, 8 strips x 2
                                                         # stages, 128 columns; 8-bit: 64-row chunks),
                  (kind, 100, 528, 256, 16, False, 0),   # m > 96 (fp16 4-bit: 64-row chunks, 8 strips x 2 stages),
                  (kind, 100, 528, 2304, 16, False, 0),  # but one wave of 128-column blocks with k <= 4096 (4-bit:
                                                         # four 32-row chunks, 8 strips x 2 stages, 128 columns),
                  (kind, 36, 16448, 128, 64, False, 0),  # and m = 33..64 with long k; partial last stages
                  (kind, 12, 512, 34816, 64, False, 0),  # m = 9..16, n / 128 >= 2 SMs (4-bit kinds: 128-column
                                                         # tiles, 8 strips x 2 stages)
                  (kind, 15, 256, 17408, 128, False, 0),  # and SMs < n / 128 with group scales
                  (kind, 24, 1152, 8192, 128, False, 0),  # m = 17..32 (4-bit), one wave of 64-column tiles: 8 strips
                                                          # x 2 stages, a partial last stage
                  (kind, 32, 640, 12672, 64, False, 0)]  # and n / 128 <= SMs < n / 64: 128-column tiles, 8 strips
    # fp16 4-bit, m = 9..16, SMs / 2 < n / 64 <= SMs with k >= 16384: the same kernel split in two, a partial stage
    cases.append((("float16", 4, False), 16, 16448, 4352, 64, False, 0))
    cases = [c + (None, None) for c in cases]  # MARLIN_CONVERT_STREAM_K and _WGMMA unset: split-K, default kernels
    for kind in KINDS:  # stream-K grids (the 2-stage kernels of >= 4 strips): blocks that end one tile and start the
        # next (m <= 16 and the 32-row m > 16 kernel), one tile row over many blocks (the 64-row kernel, capped)
        cases += [(kind, 1, 1040, 10240, 16, False, 0, "2", None), (kind, 12, 528, 10240, -1, False, 0, "2", None),
                  (kind, 12, 1536, 17408, 128, False, 0, "2", None),  # the 128-column 8-strip kernel (bf16
                                                                      # x 4-bit symmetric: no stream-K form, split-K)
                  (kind, 40, 512, 4096, 64, True, 0, "1", None), (kind, 40, 16384, 256, 128, False, 0, "1", None),
                  (kind, 72, 2048, 1280, 128, False, 0, "1", None)]  # 4-bit: three 32-row chunks, 8 strips
    # the Hopper wgmma kernel (4-bit kinds, m > 32, n a multiple of 256; MARLIN_CONVERT_WGMMA 2 / 3 / 4 force
    # its configurations; elsewhere the mma.sync kernels run): 64- and 128-row chunks, partial stages (channelwise)
    # and chunks, group 64 and 128 (grouped, the wgmma kernel takes groups of a multiple of its stage's k), act-order,
    # split-K: [RED] in a cluster where the tiles leave SMs idle and m <= 128 (132 SMs: clusters of 6 blocks on 3 tiles
    # of 17 stages, 4 on 2 tiles of 8, 8 on 4 and 3 tiles of 32 and 16), the lock chain where the split is forced or
    # m > 128
    for kind in [kd for kd in KINDS if kd[1] == 4]:
        cases += [(kind, 33, 64, 256, -1, False, 0, None, "2"), (kind, 65, 1040, 768, -1, False, 0, None, "3"),
                  (kind, 100, 512, 512, 64, True, 0, None, "4"), (kind, 130, 1024, 256, 128, False, 3, None, "2"),
                  (kind, 64, 2048, 1024, -1, False, 0, None, "3"), (kind, 65, 1024, 768, 64, False, 0, None, "3"),
                  (kind, 40, 2048, 512, 128, False, 2, None, "2"),
                  # the 64-row wgmma kernel in stream-K, blocks of two segments (132 SMs): 5 tiles of 32 stages over
                  # blocks of 3 (fp16) / 5 (bf16: at most 8 contributors); 4 x 6 with act-order, 3 tiles of 25 stages
                  # over blocks of 2 / 4; channelwise, 10 tiles of 34 stages over blocks of 3 / 5
                  (kind, 64, 4096, 1280, 128, False, 0, "1", "2"), (kind, 40, 1600, 768, 64, True, 0, "1", "3"),
                  (kind, 64, 4352, 2560, -1, False, 0, "1", "2")]
    # the Hopper direct-load kernel (4-bit kinds, m <= 32, k a multiple of 128, group size a multiple of 128 or
    # channelwise; forced: MARLIN_CONVERT_DIRECT = 2): one chunk, clusters of 3, 5 and 8 blocks with uneven chunks
    # (blocks whose warps have none), one block per tile (split 1: no cluster), two and four batch blocks, act-order
    direct_cases = [(kind, 1, 128, 64, -1, False, 0, None, None) for kind in KINDS if kind[1] == 4]
    for kind in [kd for kd in KINDS if kd[1] == 4]:
        direct_cases += [(kind, 9, 1024, 256, 128, False, 8, None, None),
                         (kind, 3, 4096, 512, 128, True, 3, None, None), (kind, 16, 640, 128, -1, False, 5, None, None),
                         (kind, 5, 1024, 256, 128, False, 1, None, None),
                         (kind, 32, 1024, 256, 128, False, 3, None, None), (kind, 19, 640, 128, -1, True, 5, None, None)]
    # its stream-K form (MARLIN_CONVERT_DIRECT = 3), with 132 SMs: 3 tiles of 8 units over blocks of 3 (a block with
    # two segments: the next segment's A copied while one is reduced; a tile over 4 blocks: a chain of 4 through its
    # lock), the same with two batch blocks and a last unit of one chunk (warps with none), act-order, four batch
    # blocks (m = 27: rows 27..31 of the last one empty)
    direct_sk_cases = []
    for kind in [kd for kd in KINDS if kd[1] == 4]:
        direct_sk_cases += [(kind, 1, 8192, 192, 128, False, 0, None, None),
                            (kind, 9, 7296, 192, -1, False, 0, None, None),
                            (kind, 4, 1152, 128, 128, True, 0, None, None),
                            (kind, 27, 7296, 192, 128, False, 0, None, None)]
    cases += direct_cases + direct_sk_cases
    all_cases = list(cases)
    if args.few:
        cases = [c for i, c in enumerate(cases)
                 if i % 3 == 0 or c[3] == 64 and c[4] == 16 or c[8] is not None or c in direct_cases
                 or c in direct_sk_cases]
    if args.wgmma is not None:
        cases = [c for c in cases if (c[8] is not None if args.wgmma == "any" else c[8] == args.wgmma)]
    # a case whose k the group size does not divide is not a layer the converter emits (the reference below fails)
    bad = [c for c in cases if c[4] != -1 and c[2] % c[4] != 0]
    if bad:
        raise SystemExit(f"sanitize_kernel: k is not a multiple of the group size in {bad}")
    if not cases:
        raise SystemExit("sanitize_kernel: no call is selected (--wgmma: the values the calls set are "
                         f"{sorted({c[8] for c in all_cases if c[8] is not None})}, or 'any')")
    numbered = list(enumerate(cases))  # (index among the selected calls, call)
    if args.index is not None:
        if not 0 <= args.index < len(cases):
            raise SystemExit(f"sanitize_kernel: --index {args.index}: {len(cases)} calls are selected, "
                             f"0..{len(cases) - 1}")
        numbered = [numbered[args.index]]
    if args.list:
        for i, case in numbered:
            print(i, _describe(case))
        return 0
    if args.isolate:
        return _isolated(args, numbered)
    cases = [case for _, case in numbered]
    ensure_kernel(0)
    failures = 0
    for case in cases:
        (dtype_name, bits, asym), m, k, n, group, act, split_k, stream_k, wgmma = case
        # (m = 9..32 takes the direct kernel only when forced)
        direct = "3" if case in direct_sk_cases else "2" if case in direct_cases else None
        for var, value in (("MARLIN_CONVERT_STREAM_K", stream_k), ("MARLIN_CONVERT_WGMMA", wgmma),
                           ("MARLIN_CONVERT_DIRECT", direct)):
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        dtype = getattr(torch, dtype_name)
        g = k if group == -1 else group
        q = rng.integers(0, 2**bits, size=(k, n), dtype=np.uint8)
        scales = torch.from_numpy(rng.random((k // g, n), dtype=np.float32) * 0.02 + 0.002).to(dtype)
        z = (rng.integers(0, 2**bits, size=(k // g, n), dtype=np.uint8) if asym
             else np.full((k // g, n), 2 ** (bits - 1)))
        g_idx = layout.trivial_g_idx(k, g)
        perm = None
        if act:
            g_idx = rng.permutation(g_idx).astype(np.int32)
            perm, _ = layout.act_order_perm(g_idx)
        b = torch.from_numpy(layout.gptq_to_marlin_weight(layout.pack_gptq_qweight(q, bits=bits), perm, bits=bits))
        s = torch.from_numpy(layout.permute_scales(scales.view(torch.int16).numpy())).view(dtype)
        zp = torch.from_numpy(layout.marlin_zero_points(z.astype(np.uint8), bits)).cuda() if asym else None
        rows = torch.from_numpy(g_idx.astype(np.int64))
        zero = torch.from_numpy(z.astype(np.float32))
        w = (torch.from_numpy(q.astype(np.float32)) - zero[rows]) * scales.float()[rows]
        a_host = torch.randn(m, k).to(dtype)
        if args.host_inputs:
            ws = torch.zeros(required_workspace_ints(n), dtype=torch.int32).cuda()
            gathered = (a_host[:, torch.from_numpy(perm).long()] if act else a_host).cuda()
            perm_arg = None  # A[:, perm] already gathered
        else:
            ws = torch.zeros(required_workspace_ints(n), dtype=torch.int32, device="cuda")
            gathered = a_host.cuda()
            perm_arg = torch.from_numpy(perm).cuda() if act else None
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        marlin_gemm(gathered, b.cuda(), s.cuda(), ws, perm=perm_arg, out=out, split_k=split_k, zp=zp, bits=bits)
        torch.cuda.synchronize()
        # checked on the host: the only device reads are of what the kernel wrote (initcheck flags any element of
        # `out` it left unwritten) and of the workspace it re-zeroed
        out_host, ws_host = out.cpu().float(), ws.cpu()
        ref = a_host.float() @ w
        rel = float((out_host - ref).abs().mean() / ref.abs().mean())
        ok = rel < 1e-2 and not torch.isnan(out_host).any() and int(ws_host.abs().sum()) == 0
        failures += not ok
        if not ok:
            print(f"WRONG {_describe(case)}: mean-rel {rel:.2e}")
    print(f"sanitize_kernel: {len(cases)} calls, {failures} wrong")
    return 1 if failures else 0


def _describe(case) -> str:
    (dtype_name, bits, asym), m, k, n, group, act, split_k, stream_k, wgmma = case
    return (f"{dtype_name} b{bits} zp={asym} m={m} k={k} n={n} g={group} act={act} split={split_k} "
            f"stream-K={stream_k} wgmma={wgmma}")


def _isolated(args, numbered: list[tuple[int, tuple]]) -> int:
    """Each selected call (``numbered``: its index among the selected calls, the call) in a child process under
    compute-sanitizer (the kernel built first, outside it), the child's options rebuilt from ``args`` (the
    selection, then ``--index``); a line per call: its index, its exit status, the tool's summary line, the call."""
    import re
    import subprocess

    from marlin_convert.kernel import ensure_kernel

    ensure_kernel(0)
    selection = [*(["--few"] if args.few else []), *(["--host-inputs"] if args.host_inputs else []),
                 *(["--wgmma", args.wgmma] if args.wgmma is not None else [])]
    bad = 0
    for i, case in numbered:
        run = subprocess.run(["compute-sanitizer", "--tool", args.isolate, "--kernel-name", "kns=marlin_",
                              "--error-exitcode", "3", sys.executable, __file__, *selection, "--index", str(i)],
                             capture_output=True, text=True)
        found = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: [^\n]*", run.stdout + run.stderr)
        bad += run.returncode != 0
        print(f"{i:4d} rc={run.returncode} {found[-1] if found else 'no summary'} | {_describe(case)}", flush=True)
    print(f"sanitize_kernel --isolate {args.isolate}: {len(numbered)} calls, {bad} with a failing run")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
