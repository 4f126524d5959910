"""The kernel check's statistics and verdicts (marlin_convert.gpu_check), on the CPU: GpuChecker._check and finish
run with plain torch on CPU tensors, the kernel replaced by an exact product that can be made to misbehave. Each
failure must fail its own batch, and only that one."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from marlin_convert import gpu_check, kernel, layout  # noqa: E402
from marlin_convert.gpu_check import GpuChecker, reference_weight  # noqa: E402

BITS, K, N, N_PAD, GROUPS = 4, 64, 40, 64, 2
BATCHES = [1, 16, 128]


class _Event:
    def record(self, *args):
        pass

    def elapsed_time(self, other):
        return 0.0


def _arrays():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 1 << BITS, size=(K, N), dtype=np.uint8)
    stored = rng.integers(0, (1 << BITS) - 1, size=(GROUPS, N), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, size=(GROUPS, N)).astype(np.float16)
    g_idx = (np.arange(K) // (K // GROUPS)).astype(np.int32)
    return {"qweight": torch.from_numpy(layout.pack_gptq_qweight(q, bits=BITS)), "scales": torch.from_numpy(scales),
            "qzeros": torch.from_numpy(layout.pack_gptq_qzeros(stored, bits=BITS)), "g_idx": torch.from_numpy(g_idx),
            "s": torch.from_numpy(scales), "B": None}


def _checks(monkeypatch, fault: str, run_dtype: str):
    arrays = _arrays()
    weight = torch.nn.functional.pad(reference_weight(arrays["qweight"], arrays["scales"], arrays["qzeros"],
                                                      arrays["g_idx"], BITS, "v2"), (0, N_PAD - N))

    def fake_kernel(a, B, s, workspace, perm=None, out=None, zp=None, bits=4):
        m = a.shape[0]
        result = (a.float() @ weight).to(out.dtype)
        if fault == "row left unwritten" and m == 16:
            out[:-1] = result[:-1]
            return out
        if fault == "one wrong row" and m == 128:
            result[5] *= 1.5
        if fault == "padded column written" and m == 1:
            result[:, N] = 1
        if fault == "full tile written" and m == 1:  # 16 rows from the same pointer, as a kernel ignoring m would
            tile = out.as_strided((16, out.shape[1]), out.stride())
            tile.zero_()
        out[:m] = result
        return out

    monkeypatch.setattr(kernel, "marlin_gemm", fake_kernel)
    checker = GpuChecker.__new__(GpuChecker)
    checker.torch, checker.timing, checker.seconds, checker.pending, checker.devices = torch, [], {}, [], []
    checker._event = _Event
    checker._set_batches(BATCHES)
    layer = types.SimpleNamespace(spec=types.SimpleNamespace(in_features=K, out_features=N, bits=BITS),
                                  padded_in_features=K, padded_out_features=N_PAD)
    gpu = types.SimpleNamespace(device="cpu", compute_stream=None, workspace=torch.zeros(0, dtype=torch.int32))
    stats, left, errors = checker._check(gpu, layer, arrays, "v2", run_dtype, 0, True)
    checker.pending = [gpu_check._Queued((0, None), stats, left, errors, run_dtype, None)]
    return {c.batch: c for c in checker.finish()[(0, None)][0]}


@pytest.mark.parametrize("run_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fault, batch, problem", [
    (None, None, None),
    ("row left unwritten", 16, f"{N_PAD} outputs NaN or never written"),
    ("one wrong row", 128, "relative error"),
    ("padded column written", 1, "1 outputs in padded columns are not 0"),
    ("full tile written", 1, "written past the batch's 1 rows"),
])
def test_each_fault_fails_its_own_batch_only(monkeypatch, run_dtype, fault, batch, problem):
    checks = _checks(monkeypatch, fault, run_dtype)
    assert sorted(checks) == BATCHES
    for m, check in checks.items():
        if m == batch:
            assert not check.ok and problem in check.problem
        else:
            assert check.ok, (m, check.problem)
            assert 0 < check.relative_error < check.bound
