"""GPU tests of the bundled Marlin kernel (``kernel/``) against an fp32 reference.

Skipped, with the reason, where there is no CUDA build of torch, no GPU, a GPU older than compute capability 8.0,
or no nvcc / ninja. Test data comes from the package's own layout functions (``marlin_convert.layout``): random
GPTQ codes q in 0..15 and scales, packed and repacked exactly as the converter does; the reference is
``A.float() @ ((q - 8) * scales[g_idx])`` in fp32 (TF32 off). Every call gets fresh random inputs and an output
buffer poisoned with NaN, so an element the kernel never writes fails the test.

Run: ``python -m pytest -m gpu -v tests/test_kernel_gpu.py``
"""

from __future__ import annotations

import numpy as np
import pytest

from marlin_convert import layout
from marlin_convert.errors import KernelError
from marlin_convert.kernel import marlin_gemm, required_workspace_ints, unavailable_reason

_REASON = unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"GPU kernel unavailable: {_REASON}")]

#: mean |C - C_ref| / mean |C_ref| must stay below this
REL_BOUND = 1e-3


class Problem:
    """One random layer: GPTQ codes and scales, their Marlin form on the GPU, and the fp32 dense weight."""

    def __init__(self, k: int, n: int, group: int, act_order: bool, rng: np.random.Generator, torch, device="cuda"):
        g = k if group == -1 else group
        groups = k // g
        q = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
        scales = (rng.random((groups, n), dtype=np.float32) * 0.02 + 0.002).astype(np.float16)
        g_idx = layout.trivial_g_idx(k, g)
        perm = None
        if act_order:
            g_idx = rng.permutation(g_idx).astype(np.int32)
            perm, _sorted = layout.act_order_perm(g_idx)
        qweight = layout.pack_gptq_qweight(q)
        b = layout.gptq_to_marlin_weight(qweight, perm)
        s = layout.permute_scales(scales)
        self.k, self.n = k, n
        self.B = torch.from_numpy(b).to(device)
        self.s = torch.from_numpy(s).to(device)
        self.perm = torch.from_numpy(perm).to(device) if perm is not None else None
        w = (torch.from_numpy(q.astype(np.float32)) - 8.0) * torch.from_numpy(scales.astype(np.float32))[
            torch.from_numpy(g_idx.astype(np.int64))]
        self.W = w.to(device)
        self.workspace = torch.zeros(required_workspace_ints(n), dtype=torch.int32, device=device)


def _run_case(torch, m, k, n, group, act_order, seed, split_k=0, calls=1):
    rng = np.random.default_rng(seed)
    p = Problem(k, n, group, act_order, rng, torch)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(calls):
        a = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.float32).to(torch.float16)
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")  # poison
        c = marlin_gemm(a, p.B, p.s, p.workspace, perm=p.perm, out=out, split_k=split_k)
        torch.cuda.synchronize()
        assert c.data_ptr() == out.data_ptr() and c.shape == (m, n) and c.dtype == torch.float16
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            ref = a.float() @ p.W
            same_dtype = (a @ p.W.half()).float()  # what fp16 torch gets, for scale
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        c32 = c.float()
        nan = int(torch.isnan(c32).sum())
        diff = (c32 - ref).abs()
        rel = float(diff.mean() / ref.abs().mean())
        rel_torch = float((same_dtype - ref).abs().mean() / ref.abs().mean())
        print(f"m={m} k={k} n={n} g={group} act={act_order} split={split_k}: max {float(diff.max()):.3e} "
              f"mean-rel {rel:.2e} (torch fp16 {rel_torch:.2e}) nan={nan}")
        assert nan == 0, f"{nan} outputs are NaN or were never written"
        assert rel < REL_BOUND, f"relative error {rel:.2e} >= {REL_BOUND:.0e}"
        assert int(p.workspace.abs().sum()) == 0, "workspace not left zeroed"


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


def test_workspace_is_reusable(torch):
    """Several calls on one workspace: it is zero after each, and every result is right."""
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


# m = 9..16 takes the swapped kernel with two 8-row batch blocks, 4 strips when n / 64 <= SMs, 3 strips when
# n / 64 <= 2 SMs (n = 10240, 12288 on 132 SMs), else the unswapped 2-strip kernel (n = 22016); a partial last stage,
# odd m, channelwise and grouped, forced splits. The swapped kernels at 2 strips / 6 stages are reached through the
# benchmark configs below.
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
def test_two_batch_block_swapped_path(torch, m, k, n, group):
    _run_case(torch, m, k, n, group, False, seed=m * 7919 + n)


@pytest.mark.parametrize("split_k", [2, 5, 16])
@pytest.mark.parametrize("m", [9, 16])
def test_two_batch_block_forced_split_k(torch, m, split_k):
    _run_case(torch, m, 4096, 256, 128, False, seed=split_k * 31 + m, split_k=split_k)


@pytest.mark.parametrize("cfg", ["0", "1", "2", "3", "4", "6", "7", "8"])
@pytest.mark.parametrize("m,group", [(4, 128), (13, 128), (16, -1)])
def test_small_m_benchmark_configs(torch, monkeypatch, cfg, m, group):
    """Every MARLIN_CONVERT_SMALL_CFG kernel (benchmark switch) gives the right result."""
    monkeypatch.setenv("MARLIN_CONVERT_SMALL_CFG", cfg)
    _run_case(torch, m, 2048, 512, group, False, seed=int(cfg) * 100 + m)
