"""GPU tests of the bundled Marlin kernel (``kernel/``) against an fp32 reference.

Skipped, with the reason, where there is no CUDA build of torch, no GPU, a GPU older than compute capability 8.0,
or no nvcc / ninja. Test data comes from the package's own layout functions (``marlin_convert.layout``): random
GPTQ codes q in 0 .. 2^bits - 1, scales and (asymmetric) zero points, packed and repacked exactly as the converter
does (``gptq_to_marlin_weight``, ``permute_scales``, ``marlin_zero_points``); the reference is
``A.float() @ ((q - z) * scales)[g_idx]`` in fp32 (TF32 off), z = 2^(bits-1) when symmetric. Every call gets fresh
random inputs and an output buffer poisoned with NaN, so an element the kernel never writes fails the test.
Bound: fp16 mean relative error < 1e-3; bf16 < max(2e-3, twice that of torch's bf16 matmul on the same weights).

Run: ``python -m pytest -m gpu -v tests/test_kernel_gpu.py``
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

from marlin_convert import layout
from marlin_convert.errors import KernelError
from marlin_convert.kernel import load_kernel, marlin_gemm, required_workspace_ints, unavailable_reason

_REASON = unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"GPU kernel unavailable: {_REASON}")]

#: mean |C - C_ref| / mean |C_ref| must stay below this (fp16; bf16: see _bound)
REL_BOUND = 1e-3
#: bf16 floor: one bf16 rounding of the weights and one of the output already give about 1e-3
REL_BOUND_BF16 = 2e-3


def _bound(dtype_name: str, rel_torch: float) -> float:
    """fp16: the fixed bound; bf16: twice torch's own bf16 error on the same weights (never below the floor)."""
    return REL_BOUND if dtype_name == "float16" else max(REL_BOUND_BF16, 2.0 * rel_torch)


class Problem:
    """One random layer: GPTQ codes, scales and (``asym``) zero points, their Marlin form on the GPU, and the fp32
    dense weight ``W = (q - z) * s`` (z = 2^(bits-1) when symmetric). ``dtype``: "float16" or "bfloat16", the
    activation and scale type (scales are drawn in fp32 and rounded to it; the reference uses the rounded values)."""

    def __init__(self, k: int, n: int, group: int, act_order: bool, rng: np.random.Generator, torch, device="cuda",
                 bits: int = 4, asym: bool = False, dtype: str = "float16"):
        g = k if group == -1 else group
        groups = k // g
        self.bits, self.dtype_name = bits, dtype
        self.dtype = getattr(torch, dtype)
        q = rng.integers(0, 2**bits, size=(k, n), dtype=np.uint8)
        scales = torch.from_numpy(rng.random((groups, n), dtype=np.float32) * 0.02 + 0.002).to(self.dtype)
        g_idx = layout.trivial_g_idx(k, g)
        perm = None
        if act_order:
            g_idx = rng.permutation(g_idx).astype(np.int32)
            perm, _sorted = layout.act_order_perm(g_idx)
        qweight = layout.pack_gptq_qweight(q, bits=bits)
        b = layout.gptq_to_marlin_weight(qweight, perm, bits=bits)
        # permute_scales is a pure reordering that keeps the dtype: apply it to the 16-bit patterns (numpy has no bf16)
        s = layout.permute_scales(scales.view(torch.int16).numpy())
        self.k, self.n = k, n
        self.B = torch.from_numpy(b).to(device)
        self.s = torch.from_numpy(s).view(self.dtype).to(device)
        self.zp = None
        if asym:
            z = rng.integers(0, 2**bits, size=(groups, n), dtype=np.uint8)
            self.zp = torch.from_numpy(layout.marlin_zero_points(z, bits)).to(device)
            zero = torch.from_numpy(z.astype(np.float32))
        else:
            zero = torch.full((groups, n), float(2 ** (bits - 1)))
        self.perm = torch.from_numpy(perm).to(device) if perm is not None else None
        rows = torch.from_numpy(g_idx.astype(np.int64))
        w = (torch.from_numpy(q.astype(np.float32)) - zero[rows]) * scales.float()[rows]
        self.W = w.to(device)
        self.workspace = torch.zeros(required_workspace_ints(n), dtype=torch.int32, device=device)

    def gemm(self, a, **kwargs):
        return marlin_gemm(a, self.B, self.s, self.workspace, perm=self.perm, zp=self.zp, bits=self.bits, **kwargs)


def _check(torch, p: Problem, a, c, label: str) -> None:
    """c (the kernel's output for activations a) against the fp32 reference; NaN (unwritten) fails."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = a.float() @ p.W
        same_dtype = (a @ p.W.to(p.dtype)).float()  # what torch gets in the activation dtype, for scale
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    c32 = c.float()
    nan = int(torch.isnan(c32).sum())
    diff = (c32 - ref).abs()
    rel = float(diff.mean() / ref.abs().mean())
    rel_torch = float((same_dtype - ref).abs().mean() / ref.abs().mean())
    bound = _bound(p.dtype_name, rel_torch)
    print(f"{label}: max {float(diff.max()):.3e} mean-rel {rel:.2e} (torch {p.dtype_name} {rel_torch:.2e}, "
          f"bound {bound:.1e}) nan={nan}")
    assert nan == 0, f"{nan} outputs are NaN or were never written"
    assert rel < bound, f"relative error {rel:.2e} >= {bound:.1e}"
    assert int(p.workspace.abs().sum()) == 0, "workspace not left zeroed"


def _run_case(torch, m, k, n, group, act_order, seed, split_k=0, calls=1, bits=4, asym=False, dtype="float16",
              a_mean=0.0):
    rng = np.random.default_rng(seed)
    p = Problem(k, n, group, act_order, rng, torch, bits=bits, asym=asym, dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(calls):
        a = (torch.randn(m, k, generator=gen, device="cuda", dtype=torch.float32) + a_mean).to(p.dtype)
        out = torch.full((m, n), float("nan"), dtype=p.dtype, device="cuda")  # poison
        c = p.gemm(a, out=out, split_k=split_k)
        torch.cuda.synchronize()
        assert c.data_ptr() == out.data_ptr() and c.shape == (m, n) and c.dtype == p.dtype
        _check(torch, p, a, c, f"{dtype} b{bits}{' zp' if asym else ''} m={m} k={k} n={n} g={group} "
                               f"act={act_order} split={split_k}")


def _skip_unless_hopper_132(torch, reason: str) -> None:
    """Skip unless GPU 0 is compute capability 9.0 with >= 132 SMs (where the Hopper kernels' defaults are measured)."""
    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) != (9, 0) or props.multi_processor_count < 132:
        pytest.skip(reason)


def _check_switch_changes_kernel(torch, monkeypatch, p: Problem, a, var: str, value, off_label: str, on_label: str):
    """p.gemm(a) with the switch `var` at 0 and at `value` (None: unset, the default): both right, and not the same
    bit for bit. The two kernels add in other orders, so over thousands of outputs some roundings differ; identical
    outputs would mean the same kernel ran."""
    monkeypatch.setenv(var, "0")
    c_off = p.gemm(a)
    if value is None:
        monkeypatch.delenv(var)
    else:
        monkeypatch.setenv(var, value)
    c_on = p.gemm(a)
    torch.cuda.synchronize()
    _check(torch, p, a, c_off, off_label)
    _check(torch, p, a, c_on, on_label)
    assert not torch.equal(c_off, c_on), f"the same outputs bit for bit: the {on_label} kernel did not run"


@pytest.fixture(scope="module")
def torch():
    import torch as _torch

    return _torch


# (m, k, n, group, act_order): small and odd m, n = 64 / 192 / 320 (not a multiple of 128) / 4096, k == group size,
# every group size class, act-order.
CASES = [
    (1, 128, 64, -1, False),
    (1, 128, 64, 128, False),   # k == group size: one scale row, channelwise table
    (3, 64, 64, 64, False),     # k == group size == 64
    (5, 32, 128, 32, False),    # k == group size == 32
    (1, 4096, 4096, 128, False),
    (2, 4096, 4096, -1, False),
    (7, 1024, 192, 32, False),
    (16, 1024, 192, 64, False),
    (17, 2048, 320, 128, False),
    (31, 512, 256, -1, False),
    (33, 1024, 320, 64, False),
    (64, 4096, 4096, 128, False),
    (65, 768, 512, 32, False),
    (127, 1024, 192, -1, False),
    (130, 2048, 4096, 128, False),
    (1, 256, 64, 16, False),
    (9, 4096, 12288, 128, False),
    (4, 11008, 4096, 128, False),
    (1, 1024, 256, 128, True),
    (13, 2048, 512, 32, True),
    (40, 1024, 384, 64, True),
    (100, 4096, 1024, 128, True),
    (8, 1040, 128, -1, False),  # k = 65 strips: a partial last stage
    (3, 1040, 128, 16, False),
    # m > 16: 32-row chunks at 4 strips x 2 stages; 64-row chunks at 8 strips x 2 stages (m > 96, or 33..64 with
    # k >= 16384 or n >= 32768); 4-bit m = 65..96 (72, 96), and m = 97..128 on one wave of 128-column blocks with
    # k <= 4096 (112 x 1040 x 2304): three / four 32-row chunks at 8 strips x 2 stages: partial last stages, group 16
    # (strips of one warp cross groups), group 48 (not a power of two: a division), act-order, n % 128 != 0
    (20, 1040, 192, 16, False),
    (40, 16400, 256, 16, False),
    (48, 2048, 32768, -1, False),
    (129, 1536, 256, 48, False),
    (72, 2048, 320, 32, True),
    (96, 1040, 384, 16, True),
    (112, 1040, 2304, 16, True),
    # m = 9..16, SMs / 2 < n / 64 <= SMs on a 132-SM GPU (any GPU: test_split_in_two_for_long_k_or_two_batch_blocks):
    # 4 strips x 2 stages split in two over k (a partial last stage)
    (13, 2048, 8192, 128, False),
    (16, 1040, 6400, -1, False),
    # the m > 16 kernels' one-group stages (a warp's 128 / 64 rows inside one group of 128) with a partial last stage,
    # and group 80 (not a power of two; some warps' 64 rows straddle two groups, others do not)
    (70, 1152, 256, 128, False),
    (24, 1040, 192, 80, False),
    # more tiles than one wave at one / two blocks per SM (132 SMs)
    (70, 4096, 10240, 128, False),
    (40, 8192, 10240, -1, False),
]


@pytest.mark.parametrize("m,k,n,group,act_order", CASES)
def test_against_fp32_reference(torch, m, k, n, group, act_order):
    _run_case(torch, m, k, n, group, act_order, seed=hash((m, k, n, group, act_order)) % 2**31)


@pytest.mark.parametrize("seed", range(24))
def test_random_shapes(torch, seed):
    rng = np.random.default_rng(1000 + seed)
    m = int(rng.integers(1, 131))
    group = int(rng.choice([-1, 32, 64, 128]))
    k = 128 * int(rng.integers(1, 33))
    n = 64 * int(rng.integers(1, 49))
    act = bool(rng.integers(0, 2)) and group != -1
    _run_case(torch, m, k, n, group, act, seed=seed)


@pytest.mark.parametrize("split_k", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("m", [1, 20, 70])
def test_forced_split_k_reduction(torch, m, split_k):
    """The cross-block reduction through C (locks in the workspace), for several chain lengths."""
    _run_case(torch, m, 4096, 256, 128, False, seed=split_k * 1000 + m, split_k=split_k)


def test_workspace_is_reusable(torch, monkeypatch):
    """Several calls on one workspace: it is zero after each, and every result is right. (The pipelined kernels: on
    Hopper the direct kernel would take this layer in cluster mode, which uses no workspace; its stream-K form's locks
    are checked by every _run_case call of test_direct_kernel with MARLIN_CONVERT_DIRECT = 3.)"""
    monkeypatch.setenv("MARLIN_CONVERT_DIRECT", "0")
    _run_case(torch, 5, 4096, 192, 128, False, seed=7, calls=4)


def test_expert_slice_of_a_stacked_buffer(torch):
    """B and s given as views B_all[e], s_all[e] of stacked [E, ...] buffers: used in place, no copy."""
    rng = np.random.default_rng(3)
    experts = [Problem(512, 192, 64, False, rng, torch) for _ in range(3)]
    b_all = torch.stack([p.B for p in experts])
    s_all = torch.stack([p.s for p in experts])
    ws = torch.zeros(required_workspace_ints(192), dtype=torch.int32, device="cuda")
    for e, p in enumerate(experts):
        a = torch.randn(6, 512, device="cuda").half()
        out = torch.full((6, 192), float("nan"), dtype=torch.float16, device="cuda")
        c = marlin_gemm(a, b_all[e], s_all[e], ws, out=out)
        ref = a.float() @ p.W
        rel = float((c.float() - ref).abs().mean() / ref.abs().mean())
        assert not torch.isnan(c).any() and rel < REL_BOUND
    assert int(ws.abs().sum()) == 0


def test_allocates_output_when_none_given(torch):
    rng = np.random.default_rng(11)
    p = Problem(256, 128, 128, False, rng, torch)
    a = torch.randn(3, 256, device="cuda").half()
    c = marlin_gemm(a, p.B, p.s, p.workspace)
    assert c.shape == (3, 128) and c.dtype == torch.float16 and c.is_cuda
    ref = a.float() @ p.W
    assert float((c.float() - ref).abs().mean() / ref.abs().mean()) < REL_BOUND


# ------------------------------------------------------------------------------------------------ rejections


def _args(torch, m=4, k=256, n=128, rows=2, ws=None, device="cuda"):
    a = torch.randn(m, k, device=device).half()
    b = torch.zeros(k // 16, 2 * n, dtype=torch.int32, device=device)
    s = torch.ones(rows, n, dtype=torch.float16, device=device)
    w = torch.zeros(required_workspace_ints(n) if ws is None else ws, dtype=torch.int32, device=device)
    return a, b, s, w


def test_rejects_k_not_multiple_of_16(torch):
    a = torch.randn(4, 40, device="cuda").half()
    b = torch.zeros(2, 256, dtype=torch.int32, device="cuda")
    s = torch.ones(1, 128, dtype=torch.float16, device="cuda")
    w = torch.zeros(required_workspace_ints(128), dtype=torch.int32, device="cuda")
    with pytest.raises(KernelError, match=r"k = 40 columns.*not a multiple of 16"):
        marlin_gemm(a, b, s, w)


def test_rejects_n_not_multiple_of_64(torch):
    a, b, s, w = _args(torch, n=100, rows=1, ws=1024)
    with pytest.raises(KernelError, match=r"n = 100 is not divisible by 64 \(thread tile width\)"):
        marlin_gemm(a, b, s, w)


def test_rejects_group_size_not_dividing_k(torch):
    a, b, s, w = _args(torch, k=256, rows=3)
    with pytest.raises(KernelError, match=r"k = 256 is not divisible by the 3 scale rows"):
        marlin_gemm(a, b, s, w)


def test_rejects_group_size_not_multiple_of_16(torch):
    a, b, s, w = _args(torch, k=256, rows=32)
    with pytest.raises(KernelError, match=r"group size 8 .*not a multiple of 16"):
        marlin_gemm(a, b, s, w)


def test_rejects_small_workspace_naming_both_sizes(torch):
    a, b, s, w = _args(torch, n=4096, rows=2, ws=16)
    with pytest.raises(KernelError, match=r"workspace has 16 ints, but n = 4096 needs at least 1024"):
        marlin_gemm(a, b, s, w)


@pytest.mark.parametrize("which", ["A", "B", "s", "workspace"])
def test_rejects_wrong_dtype(torch, which):
    a, b, s, w = _args(torch)
    wrong = {"A": (a.float(), b, s, w), "B": (a, b.to(torch.int16), s, w), "s": (a, b, s.float(), w),
             "workspace": (a, b, s, w.to(torch.int64))}[which]
    with pytest.raises(KernelError, match=rf"{which} must be (Half|Int)"):
        marlin_gemm(*wrong)


@pytest.mark.parametrize("which", ["A", "B", "s"])
def test_rejects_cpu_tensor(torch, which):
    a, b, s, w = _args(torch)
    args = {"A": (a.cpu(), b, s, w), "B": (a, b.cpu(), s, w), "s": (a, b, s.cpu(), w)}[which]
    with pytest.raises(KernelError, match=rf"{which} must be a CUDA tensor"):
        marlin_gemm(*args)


def test_rejects_mismatched_b_shape(torch):
    a, b, s, w = _args(torch, k=256)
    with pytest.raises(KernelError, match=r"B has shape .* but A has k = 512"):
        marlin_gemm(torch.randn(4, 512, device="cuda").half(), b, s, w)


def test_rejects_bad_out_shape(torch):
    a, b, s, w = _args(torch)
    with pytest.raises(KernelError, match=r"out has shape"):
        marlin_gemm(a, b, s, w, out=torch.empty(3, 3, dtype=torch.float16, device="cuda"))


@pytest.mark.parametrize("which", ["A", "s", "workspace"])
def test_rejects_out_sharing_memory_with_an_operand(torch, which):
    """out may not overlap an operand: the kernel writes out while other blocks still read them."""
    a, b, s, w = _args(torch, m=2, k=256, n=256, rows=2, ws=1024)
    operand = {"A": a, "s": s, "workspace": w}[which]
    out = operand.view(torch.float16).view(-1)[: 2 * 256].view(2, 256) if which != "A" else a[:, :256]
    with pytest.raises(KernelError, match=rf"out shares memory with {which}: pass a separate buffer"):
        marlin_gemm(a, b, s, w, out=out)


# m = 9..16 takes the swapped kernel with two 8-row batch blocks, 4 strips at 4 stages when n / 64 <= SMs, 4 strips at
# 2 stages when n / 64 > SMs grouped or n / 64 <= 2 SMs channelwise (n = 10240, 12288 on 132 SMs), else the
# unswapped 2-strip kernel (channelwise n = 22016); a partial last stage, odd m, channelwise and grouped, forced
# splits. The swapped kernels at 2 strips / 6 stages are reached through the benchmark configs below.
@pytest.mark.parametrize("m,k,n,group", [
    (16, 4096, 4096, 128),
    (9, 2048, 1024, -1),
    (12, 1040, 192, 16),
    (15, 4096, 12288, -1),
    (16, 1056, 128, 32),
    (10, 3072, 640, 64),
    (12, 2048, 10240, 128),
    (16, 1040, 12288, 16),
    (5, 1040, 10240, -1),
    (14, 1024, 22016, 64),
    (16, 1536, 256, 192),  # group 192 (division): 64-k warp ranges never cross a group -> fp32 group scales
    (11, 1536, 256, 48),   # group 48: they do cross -> fp16 scales on B
    (6, 1536, 256, 192),
    (3, 1536, 10240, 48),
    (4, 1024, 22016, 128),  # m <= 8, n / 64 > 2 SMs: swapped 2 strips, fp32 group scales
    (7, 1056, 17408, 32),
    (2, 1040, 17408, 16),   # 32-k warp ranges cross 16-row groups: fp16 scales on B
])
def test_two_batch_block_swapped_path(torch, monkeypatch, m, k, n, group):
    monkeypatch.setenv("MARLIN_CONVERT_DIRECT", "0")  # (on Hopper the direct kernel takes n / 64 <= SMs / 2 by default)
    _run_case(torch, m, k, n, group, False, seed=m * 7919 + n)


@pytest.mark.parametrize("split_k", [2, 5, 16])
@pytest.mark.parametrize("m", [9, 16])
def test_two_batch_block_forced_split_k(torch, m, split_k):
    _run_case(torch, m, 4096, 256, 128, False, seed=split_k * 31 + m, split_k=split_k)


@pytest.mark.parametrize("cfg", ["0", "1", "2", "3", "4", "6", "7", "8", "10", "11", "12", "13", "14", "23", "24",
                                 "25"])
@pytest.mark.parametrize("m,group", [(4, 128), (13, 128), (16, -1)])
def test_small_m_benchmark_configs(torch, monkeypatch, cfg, m, group):
    """Every MARLIN_CONVERT_SMALL_CFG kernel (benchmark switch) gives the right result."""
    monkeypatch.setenv("MARLIN_CONVERT_SMALL_CFG", cfg)
    _run_case(torch, m, 2048, 512, group, False, seed=int(cfg) * 100 + m)


# fp16 x 4-bit, m = 9..16, on a GPU of 132 SMs: the 128-column, 8-strip, 2-stage kernel the default takes where n / 128
# >= 2 SMs (n = 34816) or SMs / 2 < n / 64 <= SMs with k >= 16384 (n = 4352) (the rule itself:
# test_wide_eight_rule_picks_its_layers); elsewhere these shapes take the other kernels and pass too. Group 128 and
# channelwise, group 16 and 64 (a warp's 128 k of a stage cross groups: scales on B), act-order, a partial last stage,
# split in two over k (the one-wave layers).
@pytest.mark.parametrize("m,k,n,group,act_order", [(12, 1024, 34816, 128, False), (16, 512, 34816, -1, False),
                                                   (9, 1040, 34816, 16, False), (13, 2048, 34816, 64, True),
                                                   (16, 16384, 4352, 128, False), (10, 16448, 4352, -1, False)])
def test_wide_eight_strip_kernel(torch, m, k, n, group, act_order):
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr((m, k, n, group)).encode()), calls=2)


def _last_launch(torch) -> str:
    """The configuration of the last kernel this thread launched (note_launch in kernel/marlin_gemm_impl.cuh)."""
    return load_kernel(torch.cuda.current_device()).last_launch()


WIDE_EIGHT = "pipelined MB=1 WN=2 STRIPS=8 STAGES=2 SWAP=2 "


# The rule itself (wide_eight_pays, kernel/marlin_gemm_impl.cuh), for every 4-bit kind at m = 9..16, read back from
# the launch: n / 128 >= 2 SMs; SMs / 2 < n / 64 <= SMs with k >= 16384 (fp16 x 4-bit symmetric only), not with short
# k; SMs < n / 128 with group scales only; SMs < n / 64 with n / 128 <= SMs never; never grouped with zero points (two
# blocks do not fit an SM). Hopper with 132 SMs or more, where it was measured.
@pytest.mark.parametrize("dtype,asym", [("float16", False), ("bfloat16", False), ("float16", True),
                                        ("bfloat16", True)])
@pytest.mark.parametrize("layer", ["wide", "one_wave_long_k", "one_wave_short_k", "over_one_wave", "between"])
@pytest.mark.parametrize("group", [128, -1])
def test_wide_eight_rule_picks_its_layers(torch, dtype, asym, layer, group):
    _skip_unless_hopper_132(torch, "the rule's layers are sized for a Hopper GPU of >= 132 SMs")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fits = not (asym and group != -1)
    k, n, expected = {
        "wide": (512, 256 * sms, fits),
        "one_wave_long_k": (16384, 128 * (sms // 4 + 1), dtype == "float16" and not asym),
        "one_wave_short_k": (2048, 128 * (sms // 4 + 1), False),
        "over_one_wave": (1024, 128 * (sms + 4), fits and group != -1),
        "between": (1024, 64 * (sms + 10) // 128 * 128, False),
    }[layer]
    m = 16 if layer != "between" else 12
    _run_case(torch, m, k, n, group, False, seed=zlib.crc32(repr((dtype, asym, layer, group)).encode()), asym=asym,
              dtype=dtype)
    launch = _last_launch(torch)
    assert launch.startswith(WIDE_EIGHT) == expected, f"k = {k}, n = {n} ({sms} SMs): {launch}"


@pytest.mark.parametrize("cfg", ["20", "21", "22"])
@pytest.mark.parametrize("dtype,asym", [("float16", False), ("bfloat16", True)])
@pytest.mark.parametrize("m,group", [(3, 128), (16, -1)])
def test_8bit_benchmark_configs(torch, monkeypatch, cfg, dtype, asym, m, group):
    """Every 8-bit MARLIN_CONVERT_SMALL_CFG kernel (benchmark switch, dispatch_kind) gives the right result."""
    monkeypatch.setenv("MARLIN_CONVERT_SMALL_CFG", cfg)
    _run_case(torch, m, 2048, 512, group, False, seed=int(cfg) * 100 + m, bits=8, asym=asym, dtype=dtype)


@pytest.mark.parametrize("m,group,act_order", [(1, 128, False), (8, -1, False), (5, 32, True)])
@pytest.mark.parametrize("cfg", [None, "11"])
def test_wide_tiles_on_very_wide_layers(torch, monkeypatch, cfg, m, group, act_order):
    """m <= 8 with n / 256 >= SMs (dispatch_fp16_int4: the 4-strip, 2-stage kernel by default; the 256-column tiles
    with cfg 11): right there."""
    if cfg is not None:
        monkeypatch.setenv("MARLIN_CONVERT_SMALL_CFG", cfg)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _run_case(torch, m, 512, 256 * sms, group, act_order, seed=700 + m)


@pytest.mark.parametrize("m,group", [(1, 128), (12, -1)])
def test_split_in_two_when_tiles_exceed_the_sms(torch, m, group):
    """SMs < n / 64 <= 1.5 SMs: the 4-strip, 2-stage kernel, with the stream-K schedule where launch_config picks it
    (dispatch_fp16_int4; the 2-strip kernel split in two before the fifth session)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _run_case(torch, m, 1024, 64 * (sms + sms // 4), group, False, seed=800 + m)


@pytest.mark.parametrize("m,k,group,act_order", [(12, 1024, 128, False), (16, 1040, -1, False), (2, 16384, 64, True)])
def test_split_in_two_for_long_k_or_two_batch_blocks(torch, m, k, group, act_order):
    """SMs / 2 < n / 64 <= SMs, m = 9..16 or k >= 16384: the 4-strip, 2-stage kernel with a split of 2 (a partial
    last stage at k = 1040)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _run_case(torch, m, k, 64 * (sms // 2 + 1), group, act_order, seed=900 + m)


# ------------------------------------------------------------------------------------------------ other kinds
# bf16 activations, 8-bit weights, zero points (every combination but fp16 x 4-bit symmetric, tested above). Each
# kind has its own kernels: for m <= 16 the one-wave 4-strip schedule (n / 64 <= SMs; swapped, one batch block for
# m <= 8, two for m = 9..16), 4 strips at 2 stages (4-bit with n / 64 > SMs but 4-bit symmetric channelwise past 2 SMs;
# 8-bit with n / 64 > SMs; stream-K where launch_config picks it), the 2-strip one (4-bit symmetric channelwise,
# n = 17408 on 132 SMs: unswapped for m = 9..16), and the m > 16 kernels; each with grouped
# and channelwise scales (dispatch_kind in marlin_gemm_impl.cuh). The shapes below reach all of them on an H100 / H200
# (132 SMs), with group sizes 16 (strips of one warp cross groups:
# zero points and scales per strip), 32, 64, 128, channelwise, act-order and odd m.
KINDS = [(dtype, bits, asym) for dtype in ("float16", "bfloat16") for bits in (4, 8) for asym in (False, True)
         if (dtype, bits, asym) != ("float16", 4, False)]
KIND_SHAPES = [  # (m, k, n, group, act_order)
    (1, 512, 256, 128, False),     # one wave, swapped, grouped (fp32 group scales, zero points once per stage)
    (13, 1024, 192, -1, False),    # one wave, two batch blocks, channelwise
    (16, 2048, 4096, 128, False),  # one wave, two batch blocks, grouped
    (3, 1040, 128, 16, False),     # group 16: a warp's strips cross groups; partial last stage
    (5, 256, 17408, -1, False),    # n / 64 > 2 SMs: 2-strip / 1-strip swapped, channelwise
    (7, 256, 17408, 128, False),   # ... grouped
    (11, 256, 17408, 64, False),   # ... unswapped m = 9..16, grouped
    (9, 256, 17408, -1, False),    # ... unswapped, channelwise
    (4, 256, 10240, 128, False),   # SMs < n / 64 <= 2 SMs: 4 strips x 2 stages (stream-K: 160 tiles)
    (14, 256, 10240, -1, False),   # ... two batch blocks
    (3, 2048, 10240, 128, False),  # SMs < n / 64 <= 1.5 SMs, m <= 8: 4 strips x 2 stages, stream-K (160 tiles)
    (12, 1024, 4288, 64, False),   # 4-bit, SMs / 2 < n / 64 <= SMs (132 SMs), m > 8: 4 strips x 2 stages split in two
    (16, 2048, 8192, -1, False),   # ... channelwise
    (9, 1040, 10240, 16, False),   # 4-bit zero points, grouped, n / 64 > SMs: 4 strips x 2 stages, group 16 (straddling)
    (2, 1024, 17408, 64, True),    # ... act-order
    (2, 1024, 512, 64, True),      # act-order, m <= 8
    (37, 1024, 320, 32, True),     # m > 16, act-order, n % 128 != 0
    (70, 512, 384, 128, False),    # m > 16, grouped, two row chunks
    (130, 768, 192, -1, False),    # m > 16, channelwise, a partial row chunk
    (40, 16400, 256, 16, False),   # 4-bit m = 33..64 with long k: 64-row chunks, 8 strips x 2 stages, group 16
    (96, 1040, 256, 16, True),     # 4-bit m > 64: the same, act-order, a partial last stage; 8-bit grouped: MB = 2
    (50, 8192, 10240, 64, False),  # m > 16 with more tiles than one wave
]


def _kind_id(kind):
    dtype, bits, asym = kind
    return f"{'bf16' if dtype == 'bfloat16' else 'fp16'}-int{bits}-{'zp' if asym else 'sym'}"


@pytest.mark.parametrize("m,k,n,group,act_order", KIND_SHAPES)
@pytest.mark.parametrize("kind", KINDS, ids=_kind_id)
def test_kinds_against_fp32_reference(torch, kind, m, k, n, group, act_order):
    dtype, bits, asym = kind
    seed = hash((bits, asym, dtype == "bfloat16", m, k, n, group)) % 2**31  # ints only: the same in every process
    _run_case(torch, m, k, n, group, act_order, seed=seed, bits=bits, asym=asym, dtype=dtype)


@pytest.mark.parametrize("seed", range(16))
def test_kinds_random_shapes(torch, seed):
    rng = np.random.default_rng(5000 + seed)
    dtype, bits, asym = KINDS[seed % len(KINDS)]
    m = int(rng.integers(1, 131))
    group = int(rng.choice([-1, 32, 64, 128]))
    k = 128 * int(rng.integers(1, 25))
    n = 64 * int(rng.integers(1, 41))
    act = bool(rng.integers(0, 2)) and group != -1
    _run_case(torch, m, k, n, group, act, seed=seed, bits=bits, asym=asym, dtype=dtype)


# Stream-K (MARLIN_CONVERT_STREAM_K = blocks per SM; only the 2-stage kernels of >= 4 strips have it, and a forced
# split_k turns it off). Shapes that reach those kernels on a 132-SM GPU: the m <= 16 4 x 2 kernel with more tiles
# than SMs (blocks that end one tile and start the next; group 16 / 48, act-order, a partial last stage, channelwise),
# the m > 16 32-row 4 x 2 kernel and 8 x 2 kernel (m = 65..96), the 64-row 8 x 2 kernel with several row chunks, and one tile row over many blocks
# where the cap of 16 / 8 contributors per tile binds (40 x 16384 x 256: 32 stages, 2 tiles of 128 columns); every
# kind (8-bit channelwise m > 16 keeps its 1-strip kernel: split-K there).
STREAM_K_SHAPES = [  # (m, k, n, group, act_order)
    (1, 4096, 12288, 128, False),
    (5, 1040, 10240, 16, False),
    (5, 4096, 10240, -1, False),
    (12, 4128, 12288, 48, False),
    (2, 1024, 17408, 64, True),
    (40, 2048, 4096, 128, False),
    (40, 16384, 256, 128, False),
    (100, 1040, 2048, -1, True),
    (130, 4096, 1024, 32, False),
    (80, 2048, 1280, 64, False),  # 4-bit: three 32-row chunks, 8 strips x 2 stages, 128 columns
]


@pytest.mark.parametrize("per_sm", ["1", "2"])
@pytest.mark.parametrize("m,k,n,group,act_order", STREAM_K_SHAPES)
@pytest.mark.parametrize("kind", [("float16", 4, False), ("bfloat16", 4, False), ("bfloat16", 4, True),
                                  ("float16", 8, True), ("bfloat16", 8, False)], ids=_kind_id)
def test_stream_k_schedule(torch, monkeypatch, kind, m, k, n, group, act_order, per_sm):
    """Every stream-K grid gives the right result and leaves the workspace zeroed."""
    monkeypatch.setenv("MARLIN_CONVERT_STREAM_K", per_sm)
    dtype, bits, asym = kind
    _run_case(torch, m, k, n, group, act_order, seed=hash((m, k, n, group, bits, int(per_sm))) % 2**31, bits=bits,
              asym=asym, dtype=dtype)


# m = 17..32 with group scales where the 32-row kernel's tiles are one wave at one block per SM and leave almost no SM
# idle (n / 64 = SMs - 4 or - 5, odd, so that the 8-strip 128-column rule, try_eight_strip_32, cannot take it; the
# stream-K formula sees nothing to gain) and k >= 16384: stream-K at two blocks per SM by default (fill_one_wave in
# launch_config), read back from the launch; with k = 8192 (there the 8-strip 64-column kernel) or channelwise the grid
# stays split-K (one block per tile). Every 4-bit kind whose 32-row kernel fits two blocks per SM (not grouped zero
# points); 8-bit grouped runs at one block per SM, so never there. Hopper with >= 132 SMs, where it was measured.
@pytest.mark.parametrize("kind", [("float16", 4, False), ("bfloat16", 4, False), ("float16", 4, True),
                                  ("float16", 8, False)], ids=_kind_id)
@pytest.mark.parametrize("layer", ["long_k", "long_k_g64_act", "short_k", "channelwise"])
def test_stream_k_fills_one_wave_at_m32(torch, monkeypatch, kind, layer):
    _skip_unless_hopper_132(torch, "the rule's layers are sized for a Hopper GPU of >= 132 SMs")
    monkeypatch.delenv("MARLIN_CONVERT_STREAM_K", raising=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dtype, bits, asym = kind
    m, k, group, act_order = {
        "long_k": (32, 16384, 128, False),
        "long_k_g64_act": (20, 16448, 64, True),
        "short_k": (32, 8192, 128, False),
        "channelwise": (32, 16384, -1, False),
    }[layer]
    n = 64 * (sms - 4 - (sms % 2 == 0))  # an odd number of 64-column tiles
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr((kind, layer)).encode()), bits=bits, asym=asym,
              dtype=dtype)
    launch = _last_launch(torch)
    assert launch.startswith("pipelined MB=2 WN=1 "), launch
    expected = bits == 4 and not (asym and group != -1) and layer.startswith("long_k")
    assert ("stream_k=1" in launch) == expected, f"{layer}: k = {k}, n = {n} ({sms} SMs): {launch}"


# fp16 x 4-bit, m <= 16, one wave of 64-column tiles (SMs / 2 < n / 64 <= SMs on a GPU of 132 or 108 SMs) and
# k < 16384: the 8-strip, 2-stage kernel (stage k = 1024; partial last stages, group 64 / 32 / channelwise, act-order).
@pytest.mark.parametrize("m,k,n,group,act_order", [(1, 8192, 8192, 128, False), (16, 4096, 6144, 64, False),
                                                   (9, 5120, 8192, -1, False), (3, 2048, 7168, 32, True),
                                                   (12, 1040, 8192, 16, False)])
def test_one_wave_eight_strip_kernel(torch, m, k, n, group, act_order):
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr((m, k, n, group)).encode()), calls=2)


# The same kernel for the other 4-bit kinds (dispatch_kind): bf16 (with its offset sums in the fp32 group stages) and
# zero points, wherever n / 64 <= SMs (split over k when fewer); with group scales also at k >= 16384.
@pytest.mark.parametrize("kind", [("bfloat16", 4, False), ("float16", 4, True), ("bfloat16", 4, True)],
                         ids=_kind_id)
@pytest.mark.parametrize("m,k,n,group,act_order", [(1, 8192, 8192, 128, False), (16, 4096, 6144, 64, False),
                                                   (9, 5120, 8192, -1, False), (3, 2048, 7168, 32, True),
                                                   (12, 1040, 8192, 16, False), (8, 16384, 8192, 128, False),
                                                   (5, 20480, 7168, 64, True), (7, 11008, 4096, 128, False),
                                                   (16, 4096, 1024, -1, False)])
def test_one_wave_eight_strip_kernel_kinds(torch, kind, m, k, n, group, act_order):
    dtype, bits, asym = kind
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr((m, k, n, group, kind)).encode()), calls=2,
              bits=bits, asym=asym, dtype=dtype)


# The Hopper wgmma kernel (4-bit kinds, m > 32, n a multiple of 256; sm_90a builds on compute capability 9.0 only):
# MARLIN_CONVERT_WGMMA = 2, 3, 4 force its three configurations wherever they fit (64-row chunks for m <= 64, 128-row
# ones above; 8 strips x 3 stages, 4 x 6, 4 x 4), 1 its default rule. Elsewhere the same calls run the mma.sync
# kernels, so these pass there too. Shapes: a lone partial stage, group 16, 32 and 48 (stages across groups: the
# mma.sync kernels take them), group 64 (wgmma at 4 strips only), 128 and 256, act-order, two and three row chunks,
# split-K chains (automatic and forced), channelwise.
WGMMA_SHAPES = [  # (m, k, n, group, act_order, split_k)
    (33, 64, 256, -1, False, 0),
    (64, 4096, 512, 128, False, 0),
    (65, 1040, 768, 16, False, 0),
    (40, 1152, 256, 48, False, 0),
    (128, 4096, 4096, 128, False, 0),
    (100, 2048, 1024, 64, True, 0),
    (300, 1152, 256, 128, False, 0),
    (48, 4096, 256, 32, False, 3),
    (128, 8192, 2048, -1, False, 0),
    (96, 3072, 10240, 128, False, 0),
    (80, 3072, 512, 256, False, 2),
]
FOUR_BIT_KINDS = [("float16", 4, False), ("bfloat16", 4, False), ("float16", 4, True), ("bfloat16", 4, True)]
WGMMA_CASES = [(kind, v) for kind in FOUR_BIT_KINDS for v in ("1", "2", "3", "4")]


# The m > 16 benchmark configurations (MARLIN_CONVERT_SMALL_CFG 30 and 33, launch_m32_cfg): the unswapped 32-row kernel
# with 8 strips per warp and stage, its grouped fp32 partial sums scaled once per group, on 128- / 64-column tiles,
# whatever the layer. Every 4-bit kind; group 128 (one group per warp and stage), 64 and 32 (groups inside a warp's 128 k: the
# per-strip path), 256 with act-order, channelwise; m = 17 (a second m-block of one row), 40 and 64 (two row chunks),
# 72, 81 and 96 (three: cfg 30 is the default kernel there on the layers the wgmma kernel leaves);
# a partial last stage (k = 1040); split over k where the tiles leave SMs idle.
M32_CFG_SHAPES = [(32, 4096, 1024, 128, False), (17, 2048, 512, 64, False), (64, 2048, 256, 256, True),
                  (40, 1024, 384, -1, False), (24, 1040, 256, 16, False), (32, 8192, 512, 32, False),
                  (96, 2048, 512, 128, False), (72, 1040, 384, -1, False), (81, 1024, 256, 64, True)]


@pytest.mark.parametrize("kind", FOUR_BIT_KINDS, ids=_kind_id)
@pytest.mark.parametrize("cfg", ["30", "33"])
@pytest.mark.parametrize("m,k,n,group,act_order", M32_CFG_SHAPES)
def test_m32_eight_strip_configs(torch, monkeypatch, kind, cfg, m, k, n, group, act_order):
    monkeypatch.setenv("MARLIN_CONVERT_SMALL_CFG", cfg)
    dtype, bits, asym = kind
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr((cfg, m, k, n, kind)).encode()), calls=2,
              bits=bits, asym=asym, dtype=dtype)
    if torch.cuda.get_device_capability() == (9, 0):  # (the 208 KB of cfg 33 fit there; elsewhere it may fall back)
        launch = _last_launch(torch)
        assert launch.startswith(f"pipelined MB=2 WN={1 if cfg == '33' else 2} STRIPS=8 STAGES=2 SWAP=0 "), launch


# m = 17..64, the layers the direct and wgmma kernels leave (try_eight_strip_32), read back from the launch for every
# 4-bit kind (8-bit: never) and both scale kinds. m <= 32: one wave of 64-column tiles with k < 16384 -> the 8-strip
# 64-column kernel; one wave with k >= 16384, fewer 128-column tiles than SMs (n / 64 > SMs), or >= 2 SMs of them ->
# the 8-strip 128-column kernel; SMs < n / 128 < 2 SMs -> the 4-strip kernel. m = 33..64 (two row chunks): one wave of
# 64-column blocks -> 64 columns, of 128-column blocks -> 128 columns, with k < 16384; long k or wide layers -> not
# these. m = 65..96 (three row chunks): 128 columns on every layer the wgmma kernel leaves (these layers have k / split
# below wgmma_pays' 2048-2560); m = 97..128 (four): 128 columns on one wave of 128-column blocks with k <= 4096 (a
# partial last chunk at m = 100), not with longer k or more blocks than SMs. Hopper with >= 132 SMs, where it was
# measured.
@pytest.mark.parametrize("kind", FOUR_BIT_KINDS + [("float16", 8, False)], ids=_kind_id)
@pytest.mark.parametrize("layer", ["one_wave_short_k", "one_wave_long_k", "under_a_wave_of_128", "wide", "band",
                                   "two_chunks_64", "two_chunks_128", "two_chunks_long_k", "two_chunks_wide",
                                   "three_chunks", "three_chunks_wide", "three_chunks_long_k", "four_chunks",
                                   "four_chunks_partial", "four_chunks_long_k", "four_chunks_over_a_wave"])
@pytest.mark.parametrize("group", [128, -1])
def test_eight_strip_32_rule_picks_its_layers(torch, kind, layer, group):
    _skip_unless_hopper_132(torch, "the rule's layers are sized for a Hopper GPU of >= 132 SMs")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dtype, bits, asym = kind
    sixty_four = "pipelined MB=2 WN=1 STRIPS=8 STAGES=2 SWAP=0 "
    one_twenty_eight = "pipelined MB=2 WN=2 STRIPS=8 STAGES=2 SWAP=0 "
    m, k, n, expected = {
        "one_wave_short_k": (24, 2048, 128 * ((sms - 4) // 2), sixty_four),
        "one_wave_long_k": (32, 16384, 128 * ((sms - 4) // 2), one_twenty_eight),
        "under_a_wave_of_128": (17, 2048, 128 * (3 * sms // 4), one_twenty_eight),
        "wide": (32, 1024, 128 * (2 * sms + 8), one_twenty_eight),
        "band": (32, 1024, 128 * (sms + sms // 4), "pipelined MB=2 WN=1 STRIPS=4 "),
        "two_chunks_64": (64, 2048, 64 * ((sms - 4) // 2), sixty_four),
        "two_chunks_128": (40, 2048, 128 * ((sms - 4) // 2), one_twenty_eight),
        "two_chunks_long_k": (48, 16384, 128 * ((sms - 4) // 2), None),
        "two_chunks_wide": (48, 1024, 128 * (2 * sms + 8), None),
        "three_chunks": (96, 4096, 4096, one_twenty_eight),
        "three_chunks_wide": (72, 1024, 128 * (2 * sms + 8), one_twenty_eight),
        "three_chunks_long_k": (80, 16384, 128 * 65, one_twenty_eight),  # (n / 256 not whole: no wgmma)
        "four_chunks": (128, 4096, 4096, one_twenty_eight),
        "four_chunks_partial": (100, 2048, 128 * (sms // 4), one_twenty_eight),
        "four_chunks_long_k": (128, 8192, 4096, None),
        "four_chunks_over_a_wave": (112, 2048, 128 * (sms // 4 + 2), None),
    }[layer]
    _run_case(torch, m, k, n, group, False, seed=zlib.crc32(repr((kind, layer, group)).encode()), bits=bits,
              asym=asym, dtype=dtype)
    launch = _last_launch(torch)
    if bits == 8 or expected is None:
        assert not launch.startswith((sixty_four, one_twenty_eight)), f"{layer}: m = {m}, n = {n}: {launch}"
    else:
        assert launch.startswith(expected), f"{layer}: m = {m}, k = {k}, n = {n} ({sms} SMs): {launch}"


@pytest.mark.parametrize("kind,variant", WGMMA_CASES, ids=lambda c: c if isinstance(c, str) else _kind_id(c))
@pytest.mark.parametrize("m,k,n,group,act_order,split_k", WGMMA_SHAPES)
def test_wgmma_kernel(torch, monkeypatch, kind, variant, m, k, n, group, act_order, split_k):
    monkeypatch.setenv("MARLIN_CONVERT_WGMMA", variant)
    dtype, bits, asym = kind
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr((m, k, n, group, variant, kind)).encode()),
              split_k=split_k, calls=2, bits=bits, asym=asym, dtype=dtype)


# The 64-row wgmma kernel (m = 33..64) in stream-K (MARLIN_CONVERT_STREAM_K = 1: one block per SM, every block the
# same number of stages across tile boundaries, a tile's contributors adding into C under its lock): with 132 SMs, 10
# tiles of 32 stages over blocks of 3 (blocks with two segments), 3 tiles of 25 stages of 4 x 6 with group 64 and
# act-order (stages of 64 k; blocks of 2 or 4 stages, so some with two segments), 86 tiles of 8 stages (blocks of 6: 1-2
# contributors per tile), a lone tile of 9 stages (contributors of one stage), channelwise with one tile and with 10
# tiles of 34 stages (blocks of 3 or 5: two segments; 8 x 3's channelwise stage is exactly the reduction area, the
# bound at which the next segment's copies overlap the reduction), 4 x 4. The 128-row kernel (m > 64) has no stream-K form: the same switch
# leaves it split-K. Elsewhere the same calls run the kernels that fit there.
WGMMA_STREAM_K_SHAPES = [  # (m, k, n, group, act_order, wgmma variant)
    (64, 4096, 2560, 128, False, "2"),
    (40, 1600, 768, 64, True, "3"),
    (33, 1024, 22016, 128, False, "2"),
    (64, 1152, 256, -1, False, "2"),
    (64, 4352, 2560, -1, False, "2"),
    (48, 2048, 1024, 128, False, "4"),
    (128, 4096, 2560, 128, False, "2"),
    (100, 1536, 768, 64, True, "3"),
    (128, 1152, 256, -1, False, "2"),
]


@pytest.mark.parametrize("kind", FOUR_BIT_KINDS, ids=_kind_id)
@pytest.mark.parametrize("m,k,n,group,act_order,variant", WGMMA_STREAM_K_SHAPES)
def test_wgmma_kernel_stream_k(torch, monkeypatch, kind, m, k, n, group, act_order, variant):
    monkeypatch.setenv("MARLIN_CONVERT_WGMMA", variant)
    monkeypatch.setenv("MARLIN_CONVERT_STREAM_K", "1")
    dtype, bits, asym = kind
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr(("wgmma-sk", m, k, n, kind)).encode()), calls=2,
              bits=bits, asym=asym, dtype=dtype)
    if torch.cuda.get_device_capability() == (9, 0):
        launch = _last_launch(torch)
        assert launch.startswith(f"pipelined MB={4 if m <= 64 else 8} WN=4 "), launch
        assert ("SWAP=3 stream_k=1 " in launch) == (m <= 64), launch


# By default the 64-row wgmma kernel runs in stream-K where launch_config's formula says the split-K grid leaves SMs
# idle and split-K does not split k (4096 x 22016: 86 tiles of 256 columns on 132 SMs, 132 / 86 rounds down to one), and
# split-K where the tiles fill the SMs (4096 x 33792: 132 tiles) or where split-K splits (4096 x 12288: 48 tiles, split
# in two); the 128-row kernel (m = 128) has no stream-K form. Hopper with 132 SMs, where the rule was measured.
@pytest.mark.parametrize("m,n,stream_k", [(64, 22016, True), (64, 33792, False), (128, 22016, False),
                                          (64, 12288, False)])
def test_wgmma_stream_k_default(torch, monkeypatch, m, n, stream_k):
    _skip_unless_hopper_132(torch, "the wgmma kernels run on compute capability 9.0 only (this check needs 132 SMs)")
    monkeypatch.delenv("MARLIN_CONVERT_STREAM_K", raising=False)
    monkeypatch.delenv("MARLIN_CONVERT_WGMMA", raising=False)
    _run_case(torch, m, 4096, n, 128, False, seed=zlib.crc32(repr(("wgmma-sk-default", m, n)).encode()))
    launch = _last_launch(torch)
    assert "SWAP=3 " in launch and ("stream_k=1 " in launch) == stream_k, f"m = {m}, n = {n}: {launch}"


@pytest.mark.parametrize("variant,m,k,n,group", [("2", 64, 4096, 4096, 128), ("3", 128, 2048, 1024, -1),
                                                  ("1", 64, 4096, 33792, 128), ("1", 128, 8192, 33792, -1)])
def test_wgmma_kernel_runs_on_hopper(torch, monkeypatch, variant, m, k, n, group):
    """On compute capability 9.0 the wgmma kernel really runs where it should: forced (2, 3), and by default (1) on a
    layer with 132 tiles of 256 columns (k >= 2560 per block on a 132-SM H100 / H200). Its sums come in another order
    than the mma.sync kernels', so over 2-4 M outputs some fp16 roundings differ; identical outputs would mean the same
    kernel ran. Both are checked against the reference."""
    _skip_unless_hopper_132(torch, "the wgmma kernels run on compute capability 9.0 only (this check needs 132 SMs)")
    rng = np.random.default_rng(zlib.crc32(repr((variant, m, k, n)).encode()))
    p = Problem(k, n, group, False, rng, torch)
    a = torch.randn(m, k, device="cuda").half()
    _check_switch_changes_kernel(torch, monkeypatch, p, a, "MARLIN_CONVERT_WGMMA", variant, "mma.sync",
                                 f"wgmma variant {variant}")


# [RED] in a cluster: on compute capability 9.0 the wgmma kernel's split-K contributors (one row chunk: m <= 128) form a
# thread-block cluster and add their partial sums in distributed shared memory (MARLIN_CONVERT_WGMMA_CLUSTER = 0: the
# lock chain through C instead). The wgmma kernel forced (MARLIN_CONVERT_WGMMA = 2: 8 strips x 3 stages, stages of 128
# k; 3: 4 x 6, stages of 64 k). One tile (n = 256), where one cluster of up to 8 always fits, so the split is exact: k =
# 768 / 1280 / 1536 / 1792 / 2048 have 6 / 10 / 12 / 14 / 16 stages, split 3 / 5 / 6 / 7 / 8 (>= 2 stages each), at m =
# 64 (the 64-row kernel: 32 output pairs per thread) and m = 97 / 128 (the 128-row kernel: 64 pairs, a partial row
# chunk at 97), so the owners of the pairs are uneven at 3, 5, 6 and 7; k = 1040 (9 stages, the last partial: split 4
# leaves one empty, so 3), group 64 at 4 x 6 with act-order (k = 1024: 16 stages, 8). And layers of several tiles, where
# the split depends on which clusters fit the GPU's GPCs (the launch must then say a cluster of 2..8 blocks per tile):
# 16, 40 and 10 tiles. Each case runs with the cluster and with the lock chain; both must match the reference, and on
# compute capability 9.0 the launch must say which ran. Elsewhere the mma.sync kernels run both.
WGMMA_CLUSTER_SHAPES = [  # (m, k, n, group, act_order, wgmma variant, blocks per cluster on one tile or None)
    (64, 768, 256, 128, False, "2", 3),
    (97, 768, 256, -1, False, "2", 3),
    (64, 1280, 256, -1, False, "2", 5),
    (128, 1280, 256, 128, False, "2", 5),
    (64, 1536, 256, 128, False, "2", 6),
    (100, 1536, 256, 128, False, "2", 6),
    (64, 1792, 256, -1, False, "2", 7),
    (128, 1792, 256, 128, False, "2", 7),
    (40, 2048, 256, 128, False, "2", 8),
    (128, 2048, 256, -1, False, "2", 8),
    (97, 1040, 256, -1, False, "2", 3),
    (100, 1024, 256, 64, True, "3", 8),
    (128, 4096, 4096, 128, False, "2", None),
    (100, 3072, 10240, 128, False, "2", None),
    (64, 4096, 2560, 128, False, "2", None),
]


@pytest.mark.parametrize("kind", FOUR_BIT_KINDS, ids=_kind_id)
@pytest.mark.parametrize("cluster", ["0", "1"])
@pytest.mark.parametrize("m,k,n,group,act_order,variant,blocks_expected", WGMMA_CLUSTER_SHAPES)
def test_wgmma_cluster_reduction(torch, monkeypatch, kind, cluster, m, k, n, group, act_order, variant,
                                 blocks_expected):
    monkeypatch.setenv("MARLIN_CONVERT_WGMMA", variant)
    monkeypatch.setenv("MARLIN_CONVERT_WGMMA_CLUSTER", cluster)
    monkeypatch.delenv("MARLIN_CONVERT_STREAM_K", raising=False)
    dtype, bits, asym = kind
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr(("cluster", m, k, n, kind)).encode()), calls=2,
              bits=bits, asym=asym, dtype=dtype)
    if torch.cuda.get_device_capability() == (9, 0):
        launch = _last_launch(torch)
        assert "SWAP=3 stream_k=0 " in launch, launch
        blocks = int(re.search(r" cluster=(\d+) ", launch).group(1))
        grid = int(re.search(r" grid=(\d+)", launch).group(1))
        if cluster == "0":
            assert blocks == 1, launch
        elif blocks_expected is not None:
            assert blocks == blocks_expected and grid == blocks, launch
        else:
            assert 2 <= blocks <= 8 and grid == n // 256 * blocks, launch


# The default rule for [RED] in a cluster (launch_config, try_wgmma; Hopper with >= 132 SMs, where it was measured), fp16
# x 4-bit group 128, read back from the launch. 4096 x 12288 (48 tiles of 256 columns, the wgmma kernel by default):
# split in two, in a cluster. 16384 x 8192 (32 tiles, 4-way lock chains of 4096 k): the lock chain unless clusters of 4
# fit (on the H200 only clusters of 3 do). At m = 65..128 on the layers wgmma_pays leaves: the wgmma kernel only in a
# cluster whose blocks keep >= 1536 of k (11008 x 4096 and 8192 x 8192 where the clusters that fit allow it; 4096 x
# 4096 never: 16 tiles take clusters of >= 3, 1365 k; 16384 x 2048 always: 8 tiles, whose 8 clusters of 8 fit any
# 132-SM Hopper, 2048 k each); at m = 64 the mma.sync kernels there.
@pytest.mark.parametrize("m,k,n,expected", [(128, 4096, 12288, "cluster 2"), (64, 4096, 12288, "cluster 2"),
                                            (128, 16384, 8192, "chain or >= 4"), (128, 11008, 4096, "if long"),
                                            (100, 8192, 8192, "if long"), (128, 16384, 2048, "cluster 8"),
                                            (128, 4096, 4096, "mma.sync"),
                                            (64, 11008, 4096, "mma.sync")])
def test_wgmma_cluster_default_rule(torch, monkeypatch, m, k, n, expected):
    _skip_unless_hopper_132(torch, "the rule's layers are sized for a Hopper GPU of >= 132 SMs")
    for var in ("MARLIN_CONVERT_WGMMA", "MARLIN_CONVERT_WGMMA_CLUSTER", "MARLIN_CONVERT_STREAM_K"):
        monkeypatch.delenv(var, raising=False)
    _run_case(torch, m, k, n, 128, False, seed=zlib.crc32(repr(("cluster-rule", m, k, n)).encode()))
    launch = _last_launch(torch)
    wgmma = "SWAP=3 " in launch
    blocks = int(re.search(r" cluster=(\d+) ", launch).group(1))
    if expected in ("cluster 2", "cluster 8"):
        assert wgmma and blocks == int(expected[-1]), launch
    elif expected == "chain or >= 4":
        assert wgmma and (blocks == 1 or blocks >= 4), launch
    elif expected == "if long":
        assert not wgmma or (blocks >= 2 and k // blocks >= 1536), launch
    else:
        assert not wgmma, launch


# The Hopper direct-load kernel (kernel/marlin_gemm_direct.cuh: 4-bit kinds, m <= 16, k a multiple of 128, group size a
# multiple of 128 or channelwise; on compute capability 9.0 MARLIN_CONVERT_DIRECT = 2 takes it wherever it fits, 0
# never, and by default it runs at m <= 8, and at m = 9..32 in clusters of two). Each case runs with it and without; elsewhere both calls run the pipelined
# kernels, so these pass there too. Shapes:
# one chunk and one tile, k == group size (one scale row), uneven chunks over the blocks of a cluster (forced splits 3
# of 32 chunks, 5 of 5, 8 of 8: blocks whose warps have no chunk), one block per tile (no cluster: forced split 1), one
# two and four batch blocks (m 1..8, 9..16, 17..32), group 256 with act-order, long k, and shapes it refuses (group 64, k not a
# multiple of 128: the pipelined kernels).
DIRECT_SHAPES = [  # (m, k, n, group, act_order, split_k)
    (1, 128, 64, -1, False, 0),
    (1, 128, 64, 128, False, 0),
    (3, 1152, 192, 128, False, 0),
    (8, 4096, 4096, 128, False, 0),
    (9, 4096, 4096, -1, False, 0),
    (16, 11008, 4096, 128, False, 0),
    (5, 2048, 320, 256, True, 0),
    (2, 4096, 512, 128, False, 3),
    (13, 1024, 256, -1, False, 8),
    (4, 640, 128, 128, False, 5),
    (16, 256, 64, 128, False, 2),
    (7, 28672, 256, 128, False, 0),
    (12, 8192, 1024, -1, True, 0),
    (6, 1024, 256, 64, False, 0),
    (11, 1040, 256, -1, False, 0),
    (6, 2048, 512, 128, False, 1),
    (1, 1024, 128, 128, False, 7),  # m = 1 in clusters of 7 (the push reduction: pairs per block ceil(32 / 7))
    (3, 768, 64, -1, False, 6),     # clusters of 6
    (14, 1024, 192, -1, True, 1),
    (17, 4096, 4096, 128, False, 0),  # four batch blocks (m = 17..32), the last with one row
    (32, 11008, 4096, -1, False, 0),
    (32, 2048, 320, 256, True, 0),
    (24, 1024, 256, -1, False, 3),
    (29, 640, 128, 128, False, 5),
    (32, 1024, 192, 128, False, 1),
]


# Its stream-K form (MARLIN_CONVERT_DIRECT = 3: the (tile, unit) space, a unit = one 128-k chunk per warp, cut evenly
# over the resident blocks, at most 4 contributors per tile; they add through C under the tile's lock, last segment
# first). With 132 SMs (264 blocks at m <= 8, 132 at m = 9..16): tiles of 11 units (the last of 6 chunks) over blocks
# of 4, so blocks cross tiles; 344 tiles of 4 units over blocks of 6; 8 tiles of 16 units over blocks of 6 (chains of
# 3-4); two batch blocks, 3-4 blocks per tile; a last unit of one chunk (warps with none); one chunk. Elsewhere the
# split differs but every case still runs the same kernel.
DIRECT_STREAM_K_SHAPES = [  # (m, k, n, group, act_order)
    (1, 11008, 4096, 128, False),
    (8, 4096, 22016, -1, False),
    (5, 16384, 512, 256, True),
    (16, 8192, 1024, 128, False),
    (3, 1152, 192, -1, False),
    (2, 128, 64, 128, False),
    (12, 28672, 256, 128, False),
    (32, 8192, 1024, 128, False),
    (20, 11008, 4096, -1, True),
]


# MARLIN_CONVERT_DIRECT value, then the shape: cluster-mode shapes forced ("2") and off ("0"), stream-K shapes forced
DIRECT_CASES = ([(direct, *shape) for shape in DIRECT_SHAPES for direct in ("0", "2")]
                + [("3", *shape, 0) for shape in DIRECT_STREAM_K_SHAPES])


@pytest.mark.parametrize("kind", FOUR_BIT_KINDS, ids=_kind_id)
@pytest.mark.parametrize("direct,m,k,n,group,act_order,split_k", DIRECT_CASES)
def test_direct_kernel(torch, monkeypatch, kind, direct, m, k, n, group, act_order, split_k):
    monkeypatch.setenv("MARLIN_CONVERT_DIRECT", direct)
    dtype, bits, asym = kind
    key = (m, k, n, group, kind) + (("sk",) if direct == "3" else ())  # (the seeds the cases have always had)
    _run_case(torch, m, k, n, group, act_order, seed=zlib.crc32(repr(key).encode()), split_k=split_k, calls=2,
              bits=bits, asym=asym, dtype=dtype)


@pytest.mark.parametrize("kind", FOUR_BIT_KINDS, ids=_kind_id)
@pytest.mark.parametrize("m,k,n,group", [(1, 4096, 4096, 128), (8, 8192, 8192, -1), (5, 11008, 4096, 128),
                                         (2, 8192, 10240, 128), (12, 4096, 4096, -1), (16, 11008, 4096, 128),
                                         (24, 4096, 4096, 128), (32, 11008, 4096, -1)])
def test_direct_kernel_runs_on_hopper(torch, monkeypatch, kind, m, k, n, group):
    """On compute capability 9.0 the direct kernel really runs by default at m <= 8 (cluster mode; 8192 x 10240: one
    block per tile on 132-159 SMs) and at m = 9..32 on n / 64 <= SMs / 2 (two or four batch blocks, clusters of two):
    its sums come in another order than the pipelined kernels', so over 4-131 K outputs
    some roundings differ; identical outputs would mean the same kernel ran. Both are checked against the reference."""
    _skip_unless_hopper_132(torch, "the direct kernel runs on compute capability 9.0 only (this check needs 132 SMs: "
                                   "its default rules, cluster mode or stream-K, are set for that count)")
    dtype, bits, asym = kind
    rng = np.random.default_rng(zlib.crc32(repr((m, k, n, kind)).encode()))
    p = Problem(k, n, group, False, rng, torch, bits=bits, asym=asym, dtype=dtype)
    a = torch.randn(m, k, device="cuda").to(p.dtype)
    _check_switch_changes_kernel(torch, monkeypatch, p, a, "MARLIN_CONVERT_DIRECT", None, "pipelined", "direct")


# The direct kernel's default plans (direct_plan and direct_pays, kernel/marlin_gemm_direct.cuh), read back from the
# launch, at m = 3 for every 4-bit kind and both scale kinds: a cluster of two blocks per tile where 2 x n / 64 <= 2 x
# SMs; one block per tile where the tiles fit one wave (n / 64 <= 2 x SMs) and k has a chunk per warp (>= 1024); more
# tiles: stream-K where each block gets >= 4 (grouped) / 12 (channelwise) units of 8 chunks, else the pipelined kernels.
# Hopper with 132 SMs or more, where the rule was measured.
@pytest.mark.parametrize("dtype,asym", [("float16", False), ("bfloat16", True)])
@pytest.mark.parametrize("layer", ["pairs", "one_wave", "one_wave_short_k", "stream_k", "two_waves_few_units"])
@pytest.mark.parametrize("group", [128, -1])
def test_direct_plan_picks_its_layers(torch, dtype, asym, layer, group):
    _skip_unless_hopper_132(torch, "the direct kernel's plans are sized for a Hopper GPU of >= 132 SMs")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, n, expected = {
        "pairs": (2048, 64 * sms, "direct MB8=1 cluster=2 units_per_block=0 "),
        "one_wave": (1024, 64 * (sms + 8), "direct MB8=1 cluster=1 units_per_block=0 "),
        "one_wave_short_k": (512, 64 * (sms + 8), "pipelined "),
        # 2 x SMs + 8 tiles of 4 units (k = 4096): 5 units per block, the grouped threshold, not the channelwise one
        "stream_k": (4096, 64 * (2 * sms + 8),
                     "direct MB8=1 cluster=1 units_per_block=5 " if group != -1 else "pipelined "),
        "two_waves_few_units": (1024, 64 * (2 * sms + 8), "pipelined "),
    }[layer]
    _run_case(torch, 3, k, n, group, False, seed=zlib.crc32(repr((dtype, asym, layer, group)).encode()), asym=asym,
              dtype=dtype)
    launch = _last_launch(torch)
    assert launch.startswith(expected), f"k = {k}, n = {n} ({sms} SMs): {launch}"


# The default at m = 9..32 (direct_pays with two or four batch blocks), read back from the launch for every 4-bit
# kind: the direct kernel in clusters of two where 2 x n / 64 <= SMs (one block per SM); the pipelined kernels with one
# tile more (one block per tile: slower on 8192 x 8192), where k is not a multiple of 128, and where the group is 64.
@pytest.mark.parametrize("kind", FOUR_BIT_KINDS, ids=_kind_id)
@pytest.mark.parametrize("layer", ["pairs", "one_tile_more", "k_1040", "group_64"])
@pytest.mark.parametrize("group", [128, -1])
@pytest.mark.parametrize("m", [12, 24])
def test_direct_plan_at_several_batch_blocks(torch, kind, layer, group, m):
    _skip_unless_hopper_132(torch, "the direct kernel's plans are sized for a Hopper GPU of >= 132 SMs")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dtype, bits, asym = kind
    k, n, grp, direct = {
        "pairs": (2048, 64 * (sms // 2), group, True),
        "one_tile_more": (2048, 64 * (sms // 2 + 1), group, False),
        "k_1040": (1040, 64 * (sms // 2), -1, False),
        "group_64": (2048, 64 * (sms // 2), 64, False),
    }[layer]
    key = (kind, layer, group) + ((m,) if m != 12 else ())  # (the seeds the m = 12 cases have always had)
    _run_case(torch, m, k, n, grp, False, seed=zlib.crc32(repr(key).encode()), bits=bits, asym=asym, dtype=dtype)
    launch = _last_launch(torch)
    expected = f"direct MB8={2 if m <= 16 else 4} cluster=2 units_per_block=0 "
    assert launch.startswith(expected) == direct, f"m = {m}, k = {k}, n = {n}: {launch}"


# [PDL] On compute capability 9.0 a launch may start while the kernel before it in the stream still runs (programmatic
# dependent launch where pdl_launch takes it; MARLIN_CONVERT_PDL=0 turns it off), and every kernel here lets its
# successor start once all of its blocks run. That happens only between two of our calls back to back (torch's kernels
# do not let a successor start early), so each case runs a chain of four calls of ours with nothing in between, on one
# square layer, ping-ponging between two NaN-filled buffers: each call reads the buffer the call before wrote and
# writes the one it read. The chain must give the very bits it gives with PDL off (the arithmetic is the same); a read
# of A before the wait would read NaN or a half-written output, a write of C before it would overwrite the call before's
# input. `switches`: the environment of each call in turn (cycled): the pipelined kernels split over k, in stream-K,
# 8-bit, 64-row, wgmma, at most one block per SM of a kernel that could run two (asking for kOneBlockSmem: 4096 x 4096
# at m = 32, pipelined), the direct kernel in cluster mode (256 blocks on 8192 x 8192; 128 on 4096 x 4096, one per SM;
# four batch blocks by default at m = 32) and in stream-K, and the direct kernel alternating with the pipelined one. The library counts the launches that took PDL:
# on compute capability 9.0 every call of the chain must have, elsewhere none (both chains are then serialized).
PDL_CASES = [  # (label, switches, m, k, group, bits, dtype, asym)
    ("pipelined-m1", [{"MARLIN_CONVERT_DIRECT": "0"}], 1, 2048, 128, 4, "float16", False),
    ("pipelined-m16", [{"MARLIN_CONVERT_DIRECT": "0"}], 16, 2048, 128, 4, "float16", False),
    ("pipelined-stream-k", [{"MARLIN_CONVERT_STREAM_K": "1", "MARLIN_CONVERT_DIRECT": "0"}], 8, 4096, 128, 4,
     "float16", True),
    ("pipelined-8bit", [{}], 3, 1024, 64, 8, "bfloat16", False),
    ("pipelined-m64", [{"MARLIN_CONVERT_WGMMA": "0"}], 64, 1024, -1, 4, "float16", False),
    ("pipelined-m32-one-per-sm", [{"MARLIN_CONVERT_DIRECT": "0"}], 32, 4096, 128, 4, "float16", False),
    ("direct-m32", [{}], 32, 4096, -1, 4, "bfloat16", True),
    ("wgmma", [{"MARLIN_CONVERT_WGMMA": "2"}], 128, 2048, 128, 4, "float16", False),
    ("direct-cluster", [{"MARLIN_CONVERT_DIRECT": "2"}], 1, 8192, 128, 4, "float16", False),
    ("direct-cluster-one-per-sm", [{"MARLIN_CONVERT_DIRECT": "2"}], 2, 4096, 128, 4, "float16", False),
    ("direct-stream-k", [{"MARLIN_CONVERT_DIRECT": "3"}], 3, 8192, -1, 4, "bfloat16", True),
    ("direct-then-pipelined", [{"MARLIN_CONVERT_DIRECT": "2"}, {"MARLIN_CONVERT_DIRECT": "0"}], 5, 8192, -1, 4,
     "bfloat16", True),
]


def _assert_pdl_changes_no_bit(torch, monkeypatch, run, what: str, pdl_calls: int) -> None:
    """run() (calls of ours back to back, returning output tensors) with PDL off, then on: the same bits, no NaN.
    The launches that took PDL are counted (the library's count): none with it off, and with it on at least
    ``pdl_calls`` on compute capability 9.0, none elsewhere, so the comparison really is of overlapped calls."""
    launches = load_kernel(torch.cuda.current_device()).pdl_launches
    monkeypatch.setenv("MARLIN_CONVERT_PDL", "0")
    before = launches()
    serialized = run()
    assert launches() == before, f"{what}: a launch took PDL with MARLIN_CONVERT_PDL=0"
    monkeypatch.delenv("MARLIN_CONVERT_PDL")
    before = launches()
    overlapped = run()
    took = launches() - before
    if torch.cuda.get_device_capability() == (9, 0):
        assert took >= pdl_calls, f"{what}: {took} launches took PDL, expected at least {pdl_calls}"
    else:
        assert took == 0, f"{what}: {took} launches took PDL below compute capability 9.0"
    for i, (c_ser, c_pdl) in enumerate(zip(serialized, overlapped)):
        assert int(torch.isnan(c_ser).sum()) == 0, f"{what} {i}: NaN without PDL"
        assert torch.equal(c_ser, c_pdl), f"{what} {i}: other bits with PDL than without"


def _set_switches(monkeypatch, names, env: dict) -> None:
    for var in names:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)


@pytest.mark.parametrize("label,switches,m,k,group,bits,dtype,asym", PDL_CASES, ids=[c[0] for c in PDL_CASES])
def test_pdl_chain_matches_serialized(torch, monkeypatch, label, switches, m, k, group, bits, dtype, asym):
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    p = Problem(k, k, group, False, rng, torch, bits=bits, asym=asym, dtype=dtype)
    x = (torch.randn(m, k, device="cuda") * 0.05).to(p.dtype)  # (four layers of ~4-6x growth stay inside fp16)
    names = {var for env in switches for var in env}
    _set_switches(monkeypatch, names, switches[0])
    _check(torch, p, x, p.gemm(x), f"{label}: one call")

    def chain():
        buffers = [torch.full((m, k), float("nan"), dtype=p.dtype, device="cuda") for _ in range(2)]
        torch.cuda.synchronize()  # from here on only our calls, back to back
        a = x
        for i in range(4):
            _set_switches(monkeypatch, names, switches[i % len(switches)])
            a = p.gemm(a, out=buffers[i % 2])
        torch.cuda.synchronize()
        return buffers

    _assert_pdl_changes_no_bit(torch, monkeypatch, chain, f"{label}: buffer", pdl_calls=4)  # every call of the chain
    assert int(p.workspace.abs().sum()) == 0, "workspace not left zeroed"


@pytest.mark.parametrize("m", [1, 16])
def test_pdl_weights_written_by_the_calls_before(torch, monkeypatch, m):
    """[PDL] A call computes with the weights and scales that the two calls of ours right before it wrote (one writes
    the layer's B, viewed as fp16 [k / 16, 4 n], the next its scales [k / 128, n]), three rounds back to back with new
    producer inputs each: bit-equal to the same calls without PDL. (m = 1: the direct kernel's clusters, one block per
    SM; m = 16: the pipelined one-block-per-SM kernel.)"""
    rng = np.random.default_rng(78 + m)
    k = n = 4096
    layer = Problem(k, n, 128, False, rng, torch)
    make_b = Problem(256, 4 * n, 128, False, rng, torch)  # its output [k / 16, 4 n] is B's bytes
    make_s = Problem(256, n, 128, False, rng, torch)      # its output [k / 128, n] has the scales' shape
    xs_b = [torch.randn(k // 16, 256, device="cuda").half() for _ in range(3)]
    xs_s = [torch.randn(k // 128, 256, device="cuda").half() for _ in range(3)]
    a = torch.randn(m, k, device="cuda").half()

    launches = load_kernel(torch.cuda.current_device()).pdl_launches
    layer_pdl = []  # per round: whether the layer's call took PDL (counted on the host as it is launched)

    def rounds():
        b_buf, s_buf = torch.empty_like(layer.B), torch.empty_like(layer.s)
        outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(3)]
        layer_pdl.clear()
        torch.cuda.synchronize()  # from here on only our calls, back to back
        for x_b, x_s, out in zip(xs_b, xs_s, outs):
            make_b.gemm(x_b, out=b_buf.view(torch.float16))
            make_s.gemm(x_s, out=s_buf)
            before = launches()
            marlin_gemm(a, b_buf, s_buf, layer.workspace, out=out)
            layer_pdl.append(launches() - before)
        torch.cuda.synchronize()
        return outs

    _assert_pdl_changes_no_bit(torch, monkeypatch, rounds, "round", pdl_calls=3)
    if torch.cuda.get_device_capability() == (9, 0):  # the calls that read what the calls before wrote
        assert layer_pdl == [1, 1, 1], f"the layer's calls took PDL {layer_pdl} times"


@pytest.mark.parametrize("m,k,n,group", [(1, 16384, 256, 128), (8, 28672, 192, 64), (16, 16384, 128, 128),
                                         (13, 8192, 320, 64), (4, 16384, 12288, 128), (1, 8192, 8192, 128),
                                         (16, 8192, 8192, 128), (6, 28672, 8192, 128)])
@pytest.mark.parametrize("asym", [False, True])
def test_bf16_4bit_offset_sums_with_biased_activations(torch, m, k, n, group, asym):
    """bf16 x 4-bit in the fp32 group-scale stages multiplies 128 + q and subtracts (128 + z) times the activations'
    sums over the stage (kOffsetB): with activations of mean 0.5 (sums that dwarf each stage's result) and long k on
    one block per tile (split_k = 1), the error stays within the bound."""
    _run_case(torch, m, k, n, group, False, seed=m * 31 + k + n, split_k=1, bits=4, asym=asym, dtype="bfloat16",
              a_mean=0.5)


@pytest.mark.parametrize("kind,split_k", [(("bfloat16", 4, False), 2), (("bfloat16", 8, True), 8),
                                          (("float16", 8, True), 3), (("float16", 4, True), 16),
                                          (("float16", 8, False), 5)], ids=str)
@pytest.mark.parametrize("m", [1, 12, 40])
def test_kinds_forced_split_k(torch, kind, split_k, m):
    dtype, bits, asym = kind
    _run_case(torch, m, 4096, 256, 128, False, seed=split_k * 100 + m, split_k=split_k, bits=bits, asym=asym,
              dtype=dtype)


def test_kinds_reuse_one_workspace(torch):
    """Calls of different kinds on one workspace, each fresh: results right, workspace zero after each."""
    rng = np.random.default_rng(21)
    ws = torch.zeros(required_workspace_ints(192), dtype=torch.int32, device="cuda")
    for dtype, bits, asym in KINDS:
        p = Problem(512, 192, 64, False, rng, torch, bits=bits, asym=asym, dtype=dtype)
        p.workspace = ws
        a = torch.randn(4, 512, device="cuda").to(p.dtype)
        _check(torch, p, a, p.gemm(a), f"{dtype} b{bits} zp={asym} shared workspace")


def test_kinds_allocate_output_in_the_activation_dtype(torch):
    rng = np.random.default_rng(12)
    p = Problem(256, 128, 128, False, rng, torch, bits=8, asym=True, dtype="bfloat16")
    a = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    c = p.gemm(a)
    assert c.shape == (3, 128) and c.dtype == torch.bfloat16 and c.is_cuda
    _check(torch, p, a, c, "bf16 int8 zp, allocated output")


# ---- host checks of the other kinds (each message names the values)


def test_rejects_bits_other_than_4_or_8(torch):
    a, b, s, w = _args(torch)
    with pytest.raises(KernelError, match=r"bits = 3: the kernel takes 4- or 8-bit weights"):
        marlin_gemm(a, b, s, w, bits=3)


def test_rejects_8_bit_weights_read_as_4_bit(torch):
    """An 8-bit B ([k / 16, 4 n]) passed with the default bits=4 reads as twice the columns: named, with the bits."""
    a, _, s, w = _args(torch, k=256, n=128, rows=2)
    b8 = torch.zeros(16, 4 * 128, dtype=torch.int32, device="cuda")
    with pytest.raises(KernelError, match=r"s has shape \[2, 128\] but B \(bits = 4, width 2 n\) has n = 256 columns"):
        marlin_gemm(a, b8, s, w)


def test_rejects_8_bit_width_not_multiple_of_4(torch):
    a, _, s, w = _args(torch, k=256, n=128, rows=2)
    b = torch.zeros(16, 4 * 128 + 2, dtype=torch.int32, device="cuda")
    with pytest.raises(KernelError, match=r"B has shape \[16, 514\]: with bits = 8 its width must be 4 n"):
        marlin_gemm(a, b, s, w, bits=8)


@pytest.mark.parametrize("bits,shape,expected", [(4, (2, 8), r"\[2, 16\]"), (8, (2, 16), r"\[2, 32\]"),
                                                 (4, (1, 16), r"\[2, 16\]")])
def test_rejects_zero_points_of_the_wrong_shape(torch, bits, shape, expected):
    a, _, s, w = _args(torch, k=256, n=128, rows=2)
    b = torch.zeros(16, 128 * bits // 2, dtype=torch.int32, device="cuda")
    zp = torch.zeros(*shape, dtype=torch.int32, device="cuda")
    with pytest.raises(KernelError, match=rf"zp has shape \[{shape[0]}, {shape[1]}\], expected {expected}"):
        marlin_gemm(a, b, s, w, zp=zp, bits=bits)


def test_rejects_zero_points_not_int32_or_on_the_cpu(torch):
    a, b, s, w = _args(torch, k=256, n=128, rows=2)
    with pytest.raises(KernelError, match=r"zp must be Int, got Byte"):
        marlin_gemm(a, b, s, w, zp=torch.zeros(2, 16, dtype=torch.uint8, device="cuda"))
    with pytest.raises(KernelError, match=r"zp must be a CUDA tensor"):
        marlin_gemm(a, b, s, w, zp=torch.zeros(2, 16, dtype=torch.int32))


def test_rejects_scales_or_output_in_another_dtype_than_a(torch):
    a, b, s, w = _args(torch)
    a16 = a.to(torch.bfloat16)
    with pytest.raises(KernelError, match=r"s must be BFloat16 \(the dtype of A\), got Half"):
        marlin_gemm(a16, b, s, w)
    with pytest.raises(KernelError, match=r"out must be BFloat16 \(the dtype of A\), got Half"):
        marlin_gemm(a16, b, s.to(torch.bfloat16), w, out=torch.empty(4, 128, dtype=torch.float16, device="cuda"))
    with pytest.raises(KernelError, match=r"A must be Half or BFloat16, got Float"):
        marlin_gemm(a.float(), b, s, w)
