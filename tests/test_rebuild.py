"""Rebuilding GPTQ from Marlin (``marlin_convert.rebuild``): the C inverses against the loop reference, the act-order
row scatter, the table checks that guard every index, and whole slices of every kind against their sources.

The inverse and scatter tests run twice, with the C fast path and with the numpy fallback.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from checkpoint_kinds import KINDS, kind_spec
from make_gptq_checkpoint import write_checkpoint
from reference_layout import reference_gptq_to_marlin_by_placement

from marlin_convert import layout
from marlin_convert.convert import convert
from marlin_convert.manifest import MANIFEST_FILE, load_manifest
from marlin_convert.rebuild import check_act_order_tables, inverse_weight, unsort_rows
from marlin_convert.verify import verify

SLOW = settings(max_examples=15, deadline=None)


IMPLEMENTATIONS = pytest.mark.parametrize("implementation", ["c-extension", "numpy"])


@contextlib.contextmanager
def _using(implementation: str):
    """The C fast path or the numpy fallback for the duration of the block."""
    if implementation == "c-extension" and layout._repack is None:
        pytest.skip("the C fast path is not built here (setup.py builds it on install)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MARLIN_CONVERT_PURE_NUMPY", "1" if implementation == "numpy" else "0")
        yield


def _words(seed: int, k: int, n: int, bits: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**32, size=(k * bits // 32, n), dtype=np.uint64).astype(np.uint32).view(np.int32)


@IMPLEMENTATIONS
@SLOW
@given(bits=st.sampled_from([4, 8]), k16=st.integers(1, 3), n64=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_inverse_of_the_loop_reference_gives_back_the_words(implementation, bits, k16, n64, seed):
    qweight = _words(seed, 16 * k16, 64 * n64, bits)
    tiles = reference_gptq_to_marlin_by_placement(qweight, bits)
    out = np.empty_like(qweight)
    with _using(implementation):
        inverse_weight(tiles, out, bits)
    assert np.array_equal(out, qweight)


@IMPLEMENTATIONS
@pytest.mark.parametrize("bits", [4, 8])
def test_inverse_on_a_large_matrix_and_into_a_view(implementation, bits):
    qweight = _words(1, 1024, 1280, bits)
    tiles = layout.gptq_to_marlin_weight(qweight, bits=bits)
    buffer = np.zeros(qweight.size + 64, dtype=np.int32)
    out = buffer[64:].reshape(qweight.shape)
    with _using(implementation):
        inverse_weight(tiles, out, bits)
    assert np.array_equal(out, qweight) and not buffer[:64].any()


@IMPLEMENTATIONS
@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), k=st.sampled_from([8, 16, 48, 96]), n=st.integers(1, 70), seed=st.integers(0, 999))
def test_unsort_rows_puts_each_row_where_perm_says(implementation, bits, k, n, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)
    perm = rng.permutation(k).astype(np.int32)
    in_perm_order = layout.pack_gptq_qweight(codes[perm], bits=bits)
    out = np.empty((k * bits // 32, n), dtype=np.int32)
    with _using(implementation):
        unsort_rows(in_perm_order, perm, out, bits)
    restored = layout.unpack_gptq_qweight(out, bits=bits)
    for i in range(k):  # row i of the matrix in perm order is original row perm[i]
        assert np.array_equal(restored[perm[i]], codes[perm[i]])


@pytest.mark.parametrize("bad", [[0, 1, 1, 3], [0, 1, 2, 4], [0, 1, 2, -1]])
def test_the_c_scatter_refuses_what_is_not_a_permutation(bad):
    if layout._repack is None:
        pytest.skip("the C fast path is not built here")
    words = np.zeros((1, 4), dtype=np.int32)
    with pytest.raises(ValueError, match="not a permutation"):
        layout._repack.scatter_rows(np.zeros((1, 4), np.int32), words, np.array(bad * 2, np.int32), 8, 4, 4)


@pytest.mark.parametrize("perm, sorted_g_idx, problem", [
    ([0, 1, 2, 3], [0, 0, 1, 1], None),
    ([0, 1, 2, 4], [0, 0, 1, 1], "outside 0..3"),
    ([0, 1, 1, 3], [0, 0, 1, 1], "not a permutation"),
    ([0, 1, 2, 3], [0, 0, 2, 1], "outside 0..1"),
    ([0, 1, 2, 3], [0, 1, 0, 1], "not sorted"),
    ([0, 1, 2, -7], [0, -1, 1, 1], "outside"),
])
def test_act_order_tables_are_checked_before_use(perm, sorted_g_idx, problem):
    found = check_act_order_tables(np.array(perm, np.int32), np.array(sorted_g_idx, np.int32), 2)
    assert (found == []) if problem is None else any(problem in p for p in found)


# ---------------------------------------------------------------------------------- whole kinds, end to end

@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_rebuilds_its_source_exactly(tmp_path, name):
    src = write_checkpoint(tmp_path / "in", kind_spec(name))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    report = verify(out, gpus=None, workers=1, source_dir=src)
    assert report.ok and len(report.results) == 2, [(r.label, r.integrity_problems) for r in report.failures]


@pytest.mark.parametrize("name", ["asym v1 g64", "padded act-order asym", "8-bit act-order g64"])
def test_flips_in_zp_perm_and_g_idx_fail_the_layer_by_name(tmp_path, name):
    from marlin_convert.safetensors_io import read_header

    src = write_checkpoint(tmp_path / "in", kind_spec(name))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    manifest = load_manifest(out)
    rng = np.random.default_rng(0)
    flipped = tmp_path / "flipped"
    for entry in manifest["layers"]:
        for kind in sorted(set(entry["outputs"]) & {"zp", "perm", "g_idx"}):
            for _ in range(4):
                shutil.rmtree(flipped, ignore_errors=True)
                shutil.copytree(out, flipped)
                shard = flipped / entry["shards"][kind]
                info = read_header(shard).tensors[entry["outputs"][kind]]
                data = bytearray(shard.read_bytes())
                data[int(rng.integers(info.begin, info.end))] ^= 1 << int(rng.integers(8))
                shard.write_bytes(bytes(data))
                report = verify(flipped, gpus=None, workers=1)
                assert [r.name for r in report.failures] == [entry["name"]], (kind, report.failures)


def test_a_manifest_that_hides_the_padding_fails(tmp_path):
    src = write_checkpoint(tmp_path / "in", kind_spec("padded 1000 x 1000"))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    path = out / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["layers"][0]["padded_out_features"] = manifest["layers"][0]["out_features"]
    path.write_text(json.dumps(manifest))
    report = verify(out, gpus=None, workers=1)
    assert any("padded shape" in p for r in report.failures for p in r.integrity_problems)


@pytest.mark.parametrize("bits, sym, zero_format", [(4, True, "v1"), (8, False, "v2"), (4, False, "v1")])
def test_the_gpu_reference_weight_is_q_minus_z_times_s(bits, sym, zero_format):
    """The kernel check's reference (plain torch, here on the CPU) against the definition, value by value."""
    torch = pytest.importorskip("torch")
    from marlin_convert.gpu_check import reference_weight

    rng = np.random.default_rng(bits)
    k, n, g = 96, 40, 32
    q = rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)
    stored = rng.integers(0, (1 << bits) - 1, size=(k // g, n), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, size=(k // g, n)).astype(np.float16)
    g_idx = rng.permutation(np.arange(k) // g).astype(np.int32)
    weight = reference_weight(torch.from_numpy(layout.pack_gptq_qweight(q, bits=bits)), torch.from_numpy(scales),
                              torch.from_numpy(layout.pack_gptq_qzeros(stored, bits=bits)), torch.from_numpy(g_idx),
                              bits, zero_format).numpy()
    true_zero = stored.astype(np.float32) + (1 if zero_format == "v1" else 0)
    for row in (0, 5, 63, 95):
        group = g_idx[row]
        expected = (q[row].astype(np.float32) - true_zero[group]) * scales[group].astype(np.float32)
        assert np.array_equal(weight[row], expected)


@pytest.mark.parametrize("bits, zero_format, groups", [(4, "v1", 3), (8, "v2", 3), (4, "v2", 1)])
def test_the_contiguous_group_reference_equals_the_gathered_one(bits, zero_format, groups):
    """Without act-order the reference broadcasts each group over its rows: the same values as the per-row gather."""
    torch = pytest.importorskip("torch")
    from marlin_convert.gpu_check import groups_are_contiguous, reference_weight

    rng = np.random.default_rng(bits + groups)
    k, n = 96, 40
    q = rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)
    stored = rng.integers(0, (1 << bits) - 1, size=(groups, n), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, size=(groups, n)).astype(np.float16)
    g_idx = (np.arange(k) // (k // groups)).astype(np.int32)
    assert groups_are_contiguous(g_idx, groups)
    assert not groups_are_contiguous(rng.permutation(g_idx), groups) or groups == 1
    args = [torch.from_numpy(layout.pack_gptq_qweight(q, bits=bits)), torch.from_numpy(scales),
            torch.from_numpy(layout.pack_gptq_qzeros(stored, bits=bits)), torch.from_numpy(g_idx), bits, zero_format]
    gathered = reference_weight(*args).numpy()
    broadcast = reference_weight(*args, contiguous_groups=True).numpy()
    assert broadcast.shape == (k, n) and np.array_equal(broadcast, gathered)


def test_fp16_scales_run_in_bf16_only_when_exact():
    from marlin_convert.gpu_check import scales_exact_in

    exact = np.array([0.5, 0.25, 0.0078125], dtype=np.float16)
    inexact = np.array([0.5, 0.0011], dtype=np.float16)
    assert scales_exact_in(exact, "float16", "bfloat16")
    assert not scales_exact_in(inexact, "float16", "bfloat16")
    too_large = np.array([np.float32(1e6)]).view(np.uint32) >> 16
    assert not scales_exact_in(too_large.astype(np.uint16), "bfloat16", "float16")
