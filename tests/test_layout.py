"""The layout math (``marlin_convert.layout``) as a specification, checked against the slow loop references in
``tests/reference_layout.py`` and against values computed by hand from ``shared/FORMAT.md``.

Nothing here compares a layout function with another layout function alone: every expectation comes from the
references, from literal numbers, or (for inverses) from the original input.

The whole module runs twice: once with the C fast path of the repack (``marlin_convert/_repack.c``, when it is
built) and once with the pure-numpy implementation (``MARLIN_CONVERT_PURE_NUMPY=1``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_layout import (
    reference_codes,
    reference_gptq_to_marlin,
    reference_gptq_to_marlin_by_placement,
    reference_marlin_zero_points,
    reference_pack_qweight,
    reference_pack_qzeros,
    reference_pad_codes,
    reference_padded_shape,
    reference_perm_table,
    reference_permute_scales,
)

from marlin_convert import layout

@pytest.fixture(autouse=True, scope="module", params=["c-extension", "numpy"])
def repack_implementation(request):
    if request.param == "c-extension" and layout._repack is None:
        pytest.skip("the C fast path is not built here (setup.py builds it on install)")
    patch = pytest.MonkeyPatch()
    patch.setenv("MARLIN_CONVERT_PURE_NUMPY", "1" if request.param == "numpy" else "0")
    for bits in (4, 8):  # a build older than _repack.c's 8-bit path fails here: rebuild it (setup.py build_ext)
        assert layout.fast_repack_available(bits) == (request.param == "c-extension"), bits
    yield request.param
    patch.undo()


SLOW = settings(max_examples=20, deadline=None)  # the loop reference is slow: keep these few
FAST = settings(max_examples=60, deadline=None)


def _random_qweight(seed: int, k: int, n: int, bits: int = 4) -> np.ndarray:
    """Uniformly random GPTQ words int32 [K/p, N] (every code, sign bit included)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**32, size=(k * bits // 32, n), dtype=np.uint32).view(np.int32)


def _random_case(seed: int, k16: int, n64: int, bits: int, with_perm: bool):
    """(K, N, random qweight int32 [K/p, N], a random row permutation int32 [K] or None)."""
    k, n = 16 * k16, 64 * n64
    perm = np.random.default_rng(seed + 1).permutation(k).astype(np.int32) if with_perm else None
    return k, n, _random_qweight(seed, k, n, bits), perm


def _word(value: int) -> int:
    """An unsigned 32-bit literal as the int32 numpy stores it."""
    return int(np.uint32(value).view(np.int32))


# ---------------------------------------------------------------------------------------------------------
# the 1024-entry table


def test_weight_perm_equals_the_reference_and_is_a_permutation():
    perm = layout.marlin_weight_perm()
    assert perm.shape == (1024,)
    assert perm.tolist() == reference_perm_table()
    assert sorted(perm.tolist()) == list(range(1024))


def test_weight_perm_first_lane_by_hand():
    # lane 0: c = 0, r = 0 -> tile indices 0, 16, 128, 144, 8, 24, 136, 152; reordered [0,2,4,6,1,3,5,7]
    perm = layout.marlin_weight_perm()
    assert perm[:8].tolist() == [0, 128, 8, 136, 16, 144, 24, 152]
    assert perm[8:16].tolist() == [256 + v for v in [0, 128, 8, 136, 16, 144, 24, 152]]  # same lane, tile 1
    # lane 31: c = 7, r = 6 -> 103, 119, 231, 247, 111, 127, 239, 255 in tile 3
    assert perm[-8:].tolist() == [768 + v for v in [103, 231, 111, 239, 119, 247, 127, 255]]


# ---------------------------------------------------------------------------------------------------------
# gptq_to_marlin_weight: bit for bit against the loop reference


@SLOW
@given(k16=st.integers(1, 8), n64=st.integers(1, 4), seed=st.integers(0, 2**32 - 1), with_perm=st.booleans())
def test_gptq_to_marlin_equals_the_reference(k16, n64, seed, with_perm):
    k, n, qweight, perm = _random_case(seed, k16, n64, 4, with_perm)
    expected = reference_gptq_to_marlin(qweight, None if perm is None else perm.tolist())
    got = layout.gptq_to_marlin_weight(qweight, perm)
    assert got.dtype == np.int32 and got.shape == (k // 16, 2 * n)
    np.testing.assert_array_equal(got, expected)


def test_gptq_to_marlin_equals_the_reference_on_a_larger_matrix():
    qweight = _random_qweight(7, 256, 192)
    np.testing.assert_array_equal(layout.gptq_to_marlin_weight(qweight), reference_gptq_to_marlin(qweight))


def test_gptq_to_marlin_writes_into_out_when_given():
    qweight = _random_qweight(11, 64, 128)
    out = np.full((4, 256), -1, dtype=np.int32)
    assert layout.gptq_to_marlin_weight(qweight, out=out) is out
    np.testing.assert_array_equal(out, reference_gptq_to_marlin(qweight))
    stacked = np.zeros((3, 4, 256), dtype=np.int32)  # one expert's slice of a stacked output
    layout.gptq_to_marlin_weight(qweight, out=stacked[1])
    np.testing.assert_array_equal(stacked[1], reference_gptq_to_marlin(qweight))
    assert not stacked[0].any() and not stacked[2].any()


# Small matrices whose reference output is computed once: for the scratch-buffer and thread tests below.
_CASES = [(k, n, seed) for seed, (k, n) in enumerate([(128, 256), (16, 64), (64, 192), (32, 128), (112, 64)])]
_EXPECTED = {}


def _expected(k: int, n: int, seed: int) -> np.ndarray:
    if (k, n, seed) not in _EXPECTED:
        _EXPECTED[k, n, seed] = reference_gptq_to_marlin(_random_qweight(seed, k, n))
    return _EXPECTED[k, n, seed]


def test_results_survive_later_calls_of_other_shapes():
    # the repack reuses per-thread scratch buffers: no returned array may alias them
    results = [(case, layout.gptq_to_marlin_weight(_random_qweight(case[2], case[0], case[1]))) for case in _CASES]
    for case, got in results:
        np.testing.assert_array_equal(got, _expected(*case), err_msg=str(case))


def test_concurrent_repacks_in_threads_are_independent():
    from concurrent.futures import ThreadPoolExecutor

    jobs = _CASES * 8
    inputs = [_random_qweight(seed, k, n) for k, n, seed in jobs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        outputs = list(pool.map(layout.gptq_to_marlin_weight, inputs))
    for case, got in zip(jobs, outputs):
        np.testing.assert_array_equal(got, _expected(*case), err_msg=str(case))


def test_gptq_to_marlin_does_not_modify_its_input():
    qweight = _random_qweight(3, 64, 128)
    before = qweight.copy()
    layout.gptq_to_marlin_weight(qweight, np.arange(64)[::-1].copy())
    np.testing.assert_array_equal(qweight, before)


# (row k, column n) of a K x N code matrix -> (strip, output word, nibble), computed by hand from FORMAT.md:
# lane i = 4 * c + r / 2 for (c, r) = (column in tile mod 8, even row in pair), word 4 * lane + tile, and the
# nibble order (r, c) (r+8, c) (r, c+8) (r+8, c+8) (r+1, c) (r+9, c) (r+1, c+8) (r+9, c+8).
SINGLE_NIBBLES = [
    # K, N, row, col, strip, word, nibble
    (16, 64, 0, 0, 0, 0, 0),
    (16, 64, 8, 1, 0, 16, 1),  # c = 1, r = 0, row r+8 -> lane 4, tile 0
    (16, 64, 6, 13, 0, 92, 2),  # tile 0, column c+8 with c = 5, row r = 6 -> lane 23
    (16, 64, 3, 20, 0, 69, 4),  # tile 1, c = 4, row r+1 with r = 2 -> lane 17
    (16, 64, 9, 43, 0, 50, 7),  # tile 2, column c+8 with c = 3, row r+9 with r = 0 -> lane 12
    (16, 64, 15, 63, 0, 127, 7),  # tile 3, c = 7, row r+9 with r = 6 -> lane 31
    (16, 128, 0, 64, 0, 128, 0),  # the second run of 64 columns starts at word 128
    (16, 128, 1, 100, 0, 128 + 4 * 16 + 2, 4),  # col 100 = run 1, tile 2, c = 4; row r+1, r = 0 -> lane 16
    (32, 64, 16, 0, 1, 0, 0),  # strip 1
    (32, 64, 26, 24, 1, 5, 3),  # strip 1 row 10 = r+8 with r = 2; tile 1, column c+8 with c = 0 -> lane 1
]


@pytest.mark.parametrize("k, n, row, col, strip, word, nibble", SINGLE_NIBBLES)
def test_a_single_code_lands_where_format_md_says(k, n, row, col, strip, word, nibble):
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    qweight[row // 8, col] = 0xB << (4 * (row % 8))  # GPTQ packing written out, not via layout
    expected = np.zeros((k // 16, 2 * n), dtype=np.uint32)
    expected[strip, word] = 0xB << (4 * nibble)
    got = layout.gptq_to_marlin_weight(qweight.view(np.int32))
    np.testing.assert_array_equal(got.view(np.uint32), expected)
    np.testing.assert_array_equal(reference_gptq_to_marlin(qweight.view(np.int32)).view(np.uint32), expected)


def test_rows_0_to_15_in_order_give_hand_computed_words():
    # Every column holds rows 0..15 = codes 0..15: qweight[0] = 0x76543210, qweight[1] = 0xFEDCBA98.
    qweight = np.empty((2, 64), dtype=np.uint32)
    qweight[0], qweight[1] = 0x76543210, 0xFEDCBA98
    got = layout.gptq_to_marlin_weight(qweight.view(np.int32)).view(np.uint32)
    # lane with r: nibbles r, r+8, r, r+8, r+1, r+9, r+1, r+9 (low to high), the same for every c and tile
    by_r = {0: 0x91918080, 2: 0xB3B3A2A2, 4: 0xD5D5C4C4, 6: 0xF7F7E6E6}
    for lane in range(32):
        for tile in range(4):
            assert got[0, 4 * lane + tile] == by_r[2 * (lane % 4)], (lane, tile)


def _four_byte_expectation(qweight: np.ndarray) -> np.ndarray:
    """FORMAT.md's consequence, written out word by word: output word (strip t, run G, lane i, tile j) is built
    from byte r/2 of a = qweight[2t, col], b = qweight[2t+1, col], a' and b' the same at col + 8 (col = 64G +
    16j + c), low nibbles a b a' b' then high nibbles a b a' b'."""
    words = qweight.view(np.uint32)
    k8, n = words.shape
    out = np.zeros((k8 // 2, 2 * n), dtype=np.uint32)
    for t in range(k8 // 2):
        for run in range(n // 64):
            for lane in range(32):
                c, r = lane // 4, 2 * (lane % 4)
                for j in range(4):
                    col = 64 * run + 16 * j + c
                    sources = [words[2 * t, col], words[2 * t + 1, col],
                               words[2 * t, col + 8], words[2 * t + 1, col + 8]]
                    source_bytes = [(int(w) >> (4 * r)) & 0xFF for w in sources]
                    nibbles = [b & 0xF for b in source_bytes] + [b >> 4 for b in source_bytes]
                    out[t, 128 * run + 4 * lane + j] = sum(v << (4 * i) for i, v in enumerate(nibbles))
    return out.view(np.int32)


@pytest.mark.parametrize("k, n, seed", [(16, 64, 0), (16, 64, 1), (48, 128, 2)])
def test_every_output_word_is_four_source_bytes_low_nibbles_first(k, n, seed):
    qweight = _random_qweight(seed, k, n)
    np.testing.assert_array_equal(layout.gptq_to_marlin_weight(qweight), _four_byte_expectation(qweight))


@pytest.mark.parametrize("shape, message", [((3, 64), r"K = 24 must divide by 16"),
                                            ((2, 96), r"N = 96 .*by 64"),
                                            ((2, 32), r"N = 32 .*by 64")])
def test_shapes_outside_the_tiling_are_refused_with_the_values(shape, message):
    with pytest.raises(ValueError, match=message):
        layout.gptq_to_marlin_weight(np.zeros(shape, dtype=np.int32))


# ---------------------------------------------------------------------------------------------------------
# marlin_to_gptq_weight: the exact inverse


@SLOW
@given(k16=st.integers(1, 4), n64=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_marlin_to_gptq_inverts_the_reference_output(k16, n64, seed):
    k, n = 16 * k16, 64 * n64
    qweight = _random_qweight(seed, k, n)
    np.testing.assert_array_equal(layout.marlin_to_gptq_weight(reference_gptq_to_marlin(qweight)), qweight)


# ---------------------------------------------------------------------------------------------------------
# scales


def test_scale_tables_by_hand():
    assert layout.scale_perm_grouped()[:10].tolist() == [0, 8, 16, 24, 32, 40, 48, 56, 1, 9]
    assert layout.scale_perm_channelwise()[:12].tolist() == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11]
    grouped = layout.permute_scales(np.arange(128, dtype=np.float32).reshape(2, 64))
    assert grouped[1, :9].tolist() == [64, 72, 80, 88, 96, 104, 112, 120, 65]
    channelwise = layout.permute_scales(np.arange(64, dtype=np.float32).reshape(1, 64))
    assert channelwise[0, 32:40].tolist() == [32, 33, 40, 41, 48, 49, 56, 57]


SCALE_DTYPES = [np.float16, np.uint16, np.float32]  # uint16 = bfloat16 bit patterns


@FAST
@given(rows=st.integers(1, 8), n64=st.integers(1, 8), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from(SCALE_DTYPES))
def test_permute_scales_equals_the_reference_and_keeps_the_dtype(rows, n64, seed, dtype):
    rng = np.random.default_rng(seed)
    scales = rng.integers(0, 2**16, size=(rows, 64 * n64), dtype=np.uint16)
    scales = scales.view(np.float16).astype(dtype) if dtype is np.float32 else scales.view(dtype)
    got = layout.permute_scales(scales)
    assert got.dtype == scales.dtype and got.shape == scales.shape
    expected = reference_permute_scales(scales)
    assert got.tobytes() == expected.tobytes()  # bit for bit, NaNs included
    assert layout.unpermute_scales(got).tobytes() == scales.tobytes()


def test_bfloat16_scales_through_torch_bits():
    torch = pytest.importorskip("torch")
    scales = torch.rand(4, 128, dtype=torch.float32).to(torch.bfloat16)
    bits = scales.view(torch.int16).numpy().view(np.uint16)
    got = layout.permute_scales(bits)
    np.testing.assert_array_equal(got, reference_permute_scales(bits))
    back = torch.from_numpy(layout.unpermute_scales(got).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(back, scales)


def test_a_single_group_uses_the_channelwise_table():
    scales = np.arange(128, dtype=np.float16).reshape(1, 128)  # K == g: one row
    np.testing.assert_array_equal(layout.permute_scales(scales), reference_permute_scales(scales))
    assert layout.permute_scales(scales)[0, :4].tolist() == [0, 1, 8, 9]


# ---------------------------------------------------------------------------------------------------------
# act-order and g_idx


def test_act_order_perm_is_stable_by_hand():
    perm, sorted_g_idx = layout.act_order_perm(np.array([1, 0, 1, 0, 2, 0], dtype=np.int32))
    assert perm.tolist() == [1, 3, 5, 0, 2, 4]  # ties keep their original order
    assert sorted_g_idx.tolist() == [0, 0, 0, 1, 1, 2]
    assert perm.dtype == np.int32 and sorted_g_idx.dtype == np.int32


@FAST
@given(g_idx=st.lists(st.integers(0, 7), min_size=1, max_size=300))
def test_act_order_perm_matches_a_stable_sort_and_restores(g_idx):
    array = np.array(g_idx, dtype=np.int32)
    perm, sorted_g_idx = layout.act_order_perm(array)
    assert perm.tolist() == sorted(range(len(g_idx)), key=lambda k: g_idx[k])  # Python's sort is stable
    assert sorted_g_idx.tolist() == sorted(g_idx)
    assert (np.diff(sorted_g_idx) >= 0).all()
    np.testing.assert_array_equal(layout.restore_g_idx(perm, sorted_g_idx), array)


def test_trivial_g_idx():
    assert layout.trivial_g_idx(256, 64).tolist() == [k // 64 for k in range(256)]
    assert layout.trivial_g_idx(256, 64).dtype == np.int32


# ---------------------------------------------------------------------------------------------------------
# GPTQ packing


def test_pack_qweight_by_hand():
    codes = np.zeros((16, 8), dtype=np.uint8)
    codes[:, 0] = np.arange(16)
    words = layout.pack_gptq_qweight(codes).view(np.uint32)
    assert words[:, 0].tolist() == [0x76543210, 0xFEDCBA98]
    assert words[:, 1:].tolist() == [[0] * 7] * 2


def test_pack_qzeros_by_hand():
    z = np.full((2, 16), 7, dtype=np.uint8)
    z[1, 8:] = np.arange(8)
    words = layout.pack_gptq_qzeros(z).view(np.uint32)
    assert words.tolist() == [[0x77777777, 0x77777777], [0x77777777, 0x76543210]]


@FAST
@given(k8=st.integers(1, 32), n=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_qweight_unpack_matches_the_reference_and_round_trips(k8, n, seed):
    qweight = _random_qweight(seed, 8 * k8, n)
    codes = layout.unpack_gptq_qweight(qweight)
    assert codes.shape == (8 * k8, n)
    assert codes.tolist() == reference_codes(qweight)
    np.testing.assert_array_equal(layout.pack_gptq_qweight(codes), qweight)


@FAST
@given(groups=st.integers(1, 16), n8=st.integers(1, 32), seed=st.integers(0, 2**32 - 1))
def test_qzeros_round_trip(groups, n8, seed):
    z = np.random.default_rng(seed).integers(0, 16, size=(groups, 8 * n8), dtype=np.uint8)
    packed = layout.pack_gptq_qzeros(z)
    assert packed.dtype == np.int32 and packed.shape == (groups, n8)
    np.testing.assert_array_equal(layout.unpack_gptq_qzeros(packed, 8 * n8), z)


# ---------------------------------------------------------------------------------------------------------
# workspace


@pytest.mark.parametrize("n, ints", [(4096, 1024), (64, 16), (11008, 2752)])
def test_workspace_ints(n, ints):
    assert layout.workspace_ints(n) == ints


# ---------------------------------------------------------------------------------------------------------
# widths: GPTQ packing at 4 and 8 bits

BITS = st.sampled_from([4, 8])


@pytest.mark.parametrize("bits, factor", [(4, 8), (8, 4)])
def test_pack_factor(bits, factor):
    assert layout.pack_factor(bits) == factor


@pytest.mark.parametrize("bits", [2, 3, 16, 0])
def test_widths_without_a_marlin_form_are_refused(bits):
    with pytest.raises(ValueError, match=f"bits = {bits}: Marlin has a form only for 4 and 8 bits"):
        layout.pack_factor(bits)
    with pytest.raises(ValueError, match=f"bits = {bits}"):
        layout.gptq_to_marlin_weight(np.zeros((4, 64), dtype=np.int32), bits=bits)


def test_pack_8bit_qweight_by_hand():
    codes = np.zeros((8, 4), dtype=np.uint8)
    codes[:, 0] = [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]
    words = layout.pack_gptq_qweight(codes, bits=8).view(np.uint32)
    assert words[:, 0].tolist() == [0x67452301, 0xEFCDAB89]
    assert not words[:, 1:].any()


def test_pack_qzeros_with_a_partial_last_word_by_hand():
    z = np.array([[1, 2, 3, 4, 5], [255, 0, 0, 0, 128]], dtype=np.uint8)
    words = layout.pack_gptq_qzeros(z, bits=8).view(np.uint32)
    assert words.tolist() == [[0x04030201, 0x00000005], [0x000000FF, 0x00000080]]  # unused slots stay 0
    z4 = np.arange(1, 11, dtype=np.uint8).reshape(1, 10)
    assert layout.pack_gptq_qzeros(z4).view(np.uint32).tolist() == [[0x87654321, 0x000000A9]]  # 9, 10, then unused 0s


@FAST
@given(bits=BITS, rows=st.integers(1, 16), n=st.integers(1, 48), seed=st.integers(0, 2**32 - 1))
def test_qweight_packing_at_both_widths_matches_the_reference(bits, rows, n, seed):
    qweight = _random_qweight(seed, rows * 32 // bits, n, bits)
    codes = layout.unpack_gptq_qweight(qweight, bits)
    assert codes.dtype == np.uint8 and codes.shape == (rows * 32 // bits, n)
    assert codes.tolist() == reference_codes(qweight, bits)
    np.testing.assert_array_equal(reference_pack_qweight(codes.tolist(), bits), qweight)
    np.testing.assert_array_equal(layout.pack_gptq_qweight(codes, bits), qweight)


@FAST
@given(bits=BITS, groups=st.integers(1, 8), n=st.integers(1, 100), seed=st.integers(0, 2**32 - 1))
def test_qzeros_packing_with_any_n_matches_the_reference_and_round_trips(bits, groups, n, seed):
    z = np.random.default_rng(seed).integers(0, 2**bits, size=(groups, n), dtype=np.uint8)
    packed = layout.pack_gptq_qzeros(z, bits)
    assert packed.dtype == np.int32 and packed.shape == (groups, -(-n * bits // 32))
    np.testing.assert_array_equal(packed, reference_pack_qzeros(z.tolist(), bits))
    np.testing.assert_array_equal(layout.unpack_gptq_qzeros(packed, n, bits), z)


def test_packing_refuses_values_that_do_not_fit_and_shapes_that_do_not_divide():
    with pytest.raises(ValueError, match=r"codes must lie in 0..15 at 4 bits, found 16"):
        layout.pack_gptq_qzeros(np.full((1, 8), 16, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"K = 6 must divide by 4"):
        layout.pack_gptq_qweight(np.zeros((6, 4), dtype=np.uint8), bits=8)
    with pytest.raises(ValueError, match=r"qzeros has 2 words per row; N = 12 at 8 bits needs 3"):
        layout.unpack_gptq_qzeros(np.zeros((1, 2), dtype=np.int32), 12, bits=8)


# ---------------------------------------------------------------------------------------------------------
# 8-bit Marlin weights


def test_8bit_table_equals_the_reference_and_its_first_lane_by_hand():
    perm = layout.marlin_weight_perm(8)
    assert perm.tolist() == reference_perm_table(8)
    assert sorted(perm.tolist()) == list(range(1024))
    # lane 0: (r, c) = (0, 0) -> 0, 16, 128, 144 | 8, 24, 136, 152, each four reordered [0, 2, 1, 3]
    assert perm[:8].tolist() == [0, 128, 16, 144, 8, 136, 24, 152]


@SLOW
@given(bits=BITS, k16=st.integers(1, 6), n64=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
       with_perm=st.booleans())
def test_gptq_to_marlin_at_both_widths_equals_the_placement_reference(bits, k16, n64, seed, with_perm):
    k, n, qweight, perm = _random_case(seed, k16, n64, bits, with_perm)
    expected = reference_gptq_to_marlin_by_placement(qweight, bits, None if perm is None else perm.tolist())
    got = layout.gptq_to_marlin_weight(qweight, perm, bits=bits)
    assert got.dtype == np.int32 and got.shape == (k // 16, n * bits // 2)
    np.testing.assert_array_equal(got, expected)


def test_the_two_4bit_references_agree():
    qweight = _random_qweight(5, 32, 128)
    np.testing.assert_array_equal(reference_gptq_to_marlin_by_placement(qweight, 4), reference_gptq_to_marlin(qweight))


# (row, col) of a K x N 8-bit code matrix -> (strip, word, byte) by hand from FORMAT.md sections 2 and 7: lane
# 4 * c + r / 2, words 8 * lane + 2 * tile (column c) and + 1 (column c + 8), bytes (r, r+8, r+1, r+9).
SINGLE_BYTES = [
    # K, N, row, col, strip, word, byte
    (16, 64, 0, 0, 0, 0, 0),
    (16, 64, 8, 0, 0, 0, 1),
    (16, 64, 1, 0, 0, 0, 2),
    (16, 64, 9, 0, 0, 0, 3),
    (16, 64, 0, 8, 0, 1, 0),  # column c + 8
    (16, 64, 2, 0, 0, 8, 0),  # r = 2 -> lane 1
    (16, 64, 0, 16, 0, 2, 0),  # tile 1
    (16, 64, 0, 1, 0, 32, 0),  # c = 1 -> lane 4
    (16, 64, 13, 42, 0, 8 * 10 + 2 * 2 + 1, 3),  # tile 2, column 10 = c + 8, c = 2; row 13 = r + 9, r = 4 -> lane 10
    (16, 64, 15, 63, 0, 255, 3),  # tile 3, c = 7, column c + 8, row r + 9 with r = 6 -> lane 31
    (16, 128, 0, 64, 0, 256, 0),  # the second run of 64 columns starts at word 256
    (32, 64, 17, 0, 1, 0, 2),  # strip 1, row r + 1
]


@pytest.mark.parametrize("k, n, row, col, strip, word, byte", SINGLE_BYTES)
def test_a_single_8bit_code_lands_where_format_md_says(k, n, row, col, strip, word, byte):
    qweight = np.zeros((k // 4, n), dtype=np.uint32)
    qweight[row // 4, col] = 0xA7 << (8 * (row % 4))  # GPTQ 8-bit packing written out, not via layout
    expected = np.zeros((k // 16, 4 * n), dtype=np.uint32)
    expected[strip, word] = 0xA7 << (8 * byte)
    got = layout.gptq_to_marlin_weight(qweight.view(np.int32), bits=8)
    np.testing.assert_array_equal(got.view(np.uint32), expected)
    np.testing.assert_array_equal(reference_gptq_to_marlin_by_placement(qweight.view(np.int32), 8).view(np.uint32),
                                  expected)


def test_8bit_repack_on_a_larger_matrix_writes_into_out():
    qweight = _random_qweight(13, 128, 192, bits=8)
    expected = reference_gptq_to_marlin_by_placement(qweight, 8)
    stacked = np.zeros((3, 8, 768), dtype=np.int32)  # one expert's slice of a stacked output
    expert = stacked[1]
    assert layout.gptq_to_marlin_weight(qweight, out=expert, bits=8) is expert
    np.testing.assert_array_equal(stacked[1], expected)
    assert not stacked[0].any() and not stacked[2].any()


def test_out_of_the_wrong_shape_is_refused():
    qweight = _random_qweight(1, 16, 64, bits=8)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous int32 array of shape \(1, 256\)"):
        layout.gptq_to_marlin_weight(qweight, out=np.zeros((1, 128), dtype=np.int32), bits=8)
    with pytest.raises(ValueError, match=r"not contiguous"):
        layout.gptq_to_marlin_weight(qweight, out=np.zeros((1, 512), dtype=np.int32)[:, ::2], bits=8)


@pytest.mark.parametrize("shape, message", [((5, 64), r"K = 20 must divide by 16"),
                                            ((4, 96), r"N = 96 .*by 64")])
def test_8bit_shapes_outside_the_tiling_are_refused_with_the_values(shape, message):
    with pytest.raises(ValueError, match=message):
        layout.gptq_to_marlin_weight(np.zeros(shape, dtype=np.int32), bits=8)


@FAST
@given(bits=BITS, k16=st.integers(1, 64), n64=st.integers(1, 12), seed=st.integers(0, 2**32 - 1),
       with_perm=st.booleans())
def test_marlin_to_gptq_is_the_exact_inverse_at_both_widths(bits, k16, n64, seed, with_perm):
    _k, _n, qweight, perm = _random_case(seed, k16, n64, bits, with_perm)
    b = layout.gptq_to_marlin_weight(qweight, perm, bits=bits)
    back = layout.marlin_to_gptq_weight(b, perm, bits=bits)
    assert back.dtype == np.int32 and back.shape == qweight.shape
    np.testing.assert_array_equal(back, qweight)


@SLOW
@given(k16=st.integers(1, 4), n64=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_marlin_to_gptq_inverts_the_8bit_reference_output(k16, n64, seed):
    qweight = _random_qweight(seed, 16 * k16, 64 * n64, bits=8)
    b = reference_gptq_to_marlin_by_placement(qweight, 8)
    np.testing.assert_array_equal(layout.marlin_to_gptq_weight(b, bits=8), qweight)


# ---------------------------------------------------------------------------------------------------------
# Marlin zero points


def test_zero_points_by_hand():
    # 8-bit, one group (still the grouped table): runs of 64 start 0, 8, 16, 24 | 32, 40, 48, 56, then [0, 2, 1, 3]
    z = np.arange(128, dtype=np.uint8).reshape(1, 128)
    words = layout.marlin_zero_points(z, 8).view(np.uint32)
    assert words.shape == (1, 32)
    assert words[0, :2].tolist() == [0x18081000, 0x38283020]
    assert words[0, 16] == 0x58485040  # the second run of 64: 64, 80, 72, 88
    # 4-bit, z[n] = n % 16: the grouped table gives 0, 8, 0, 8, ... and [0, 2, 4, 6, 1, 3, 5, 7] sorts them
    z4 = (np.arange(64) % 16).astype(np.uint8).reshape(1, 64)
    assert layout.marlin_zero_points(z4, 4).view(np.uint32)[0, 0] == 0x88880000


@FAST
@given(bits=BITS, groups=st.integers(1, 4), n64=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_zero_points_equal_the_reference_and_round_trip(bits, groups, n64, seed):
    n = 64 * n64
    z = np.random.default_rng(seed).integers(0, 2**bits, size=(groups, n), dtype=np.uint8)
    zp = layout.marlin_zero_points(z, bits)
    assert zp.dtype == np.int32 and zp.shape == (groups, n * bits // 32)
    np.testing.assert_array_equal(zp, reference_marlin_zero_points(z.tolist(), bits))
    back = layout.marlin_to_zero_points(zp, n, bits)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, z)


def test_zero_points_refuse_shapes_and_values():
    with pytest.raises(ValueError, match=r"N = 96 must divide by 64"):
        layout.marlin_zero_points(np.zeros((1, 96), dtype=np.uint8), 4)
    with pytest.raises(ValueError, match=r"found 16"):
        layout.marlin_zero_points(np.full((1, 64), 16, dtype=np.uint8), 4)
    with pytest.raises(ValueError, match=r"zp has 8 words per row: N = 128 at 8 bits"):
        layout.marlin_to_zero_points(np.zeros((1, 8), dtype=np.int32), 128, 8)


# ---------------------------------------------------------------------------------------------------------
# padding shapes that don't tile


@pytest.mark.parametrize("k, n, g, expected", [
    (1000, 1000, 128, (1024, 1024)),  # seven groups of 128 and one of 104 -> eight whole groups
    (1000, 4096, 1000, (1008, 4096)),  # channelwise: K to a multiple of 16 only
    (1000, 1000, 32, (1024, 1024)),
    (4096, 11008, 128, (4096, 11008)),  # already tiles
    (4096, 8608, 4096, (4096, 8640)),
    (14784, 4096, 128, (14848, 4096)),
    (100, 64, 128, (128, 64)),  # one partial group
    (16, 1, 16, (16, 64)),
])
def test_padded_shape_cases(k, n, g, expected):
    assert layout.padded_shape(k, n, g) == expected
    assert reference_padded_shape(k, n, g) == expected


@pytest.mark.parametrize("k, g", [(1000, 40), (1000, 8), (4096, 100)])
def test_padded_shape_refuses_a_group_size_that_is_not_a_multiple_of_16(k, g):
    with pytest.raises(ValueError, match=f"group size {g} \\(K = {k}\\) must divide by 16"):
        layout.padded_shape(k, 64, g)


@FAST
@given(k=st.integers(1, 3000), n=st.integers(1, 3000), g=st.sampled_from([16, 32, 64, 128, None]))
def test_padded_shape_equals_the_reference(k, n, g):
    group = k if g is None else g
    k_pad, n_pad = layout.padded_shape(k, n, group)
    assert (k_pad, n_pad) == reference_padded_shape(k, n, group)
    assert k_pad % 16 == 0 and n_pad % 64 == 0 and k_pad - k < max(group, 16) and n_pad - n < 64


@FAST
@given(k=st.integers(1, 40), n=st.integers(1, 80), extra_k=st.integers(0, 20), extra_n=st.integers(0, 70),
       seed=st.integers(0, 2**32 - 1))
def test_pad_codes_equals_the_reference(k, n, extra_k, extra_n, seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, size=(k, n), dtype=np.uint8)
    row_fill = rng.integers(0, 256, size=n, dtype=np.uint8)
    k_pad, n_pad = k + extra_k, n + extra_n
    got = layout.pad_codes(q, k_pad, n_pad, row_fill, 128)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, reference_pad_codes(q.tolist(), k_pad, n_pad, row_fill.tolist(), 128))


def test_pad_matrix_and_pad_g_idx_by_hand():
    scales = np.array([[1.5, 2.0, 3.0]], dtype=np.float16)
    padded = layout.pad_matrix(scales, 2, 5, 0)
    assert padded.dtype == np.float16 and padded.tolist() == [[1.5, 2.0, 3.0, 0, 0], [0, 0, 0, 0, 0]]
    g_idx = layout.pad_g_idx(np.array([1, 0, 1, 0], dtype=np.int32), 7, 3)
    assert g_idx.dtype == np.int32 and g_idx.tolist() == [1, 0, 1, 0, 2, 2, 2]
    with pytest.raises(ValueError, match=r"cannot pad matrix of shape \(1, 3\) to the smaller shape \(1, 2\)"):
        layout.pad_matrix(scales, 1, 2, 0)
    with pytest.raises(ValueError, match=r"cannot pad codes"):
        layout.pad_codes(np.zeros((4, 4), dtype=np.uint8), 2, 4, np.zeros(4, dtype=np.uint8), 8)
    with pytest.raises(ValueError, match=r"row_fill must have shape \(4,\)"):
        layout.pad_codes(np.zeros((4, 4), dtype=np.uint8), 8, 4, np.zeros(3, dtype=np.uint8), 8)


def _padded_layer(bits, k, n, g, symmetric, act_order, seed):
    """A random logical layer padded by the convention of CONTRACT.md section A: codes, zero points [G, N],
    scales [G, N] and g_idx, logical and padded."""
    rng = np.random.default_rng(seed)
    bias = 1 << (bits - 1)
    group = k if g is None else g
    groups = -(-k // group)
    k_pad, n_pad = layout.padded_shape(k, n, group)
    q = rng.integers(0, 2**bits, size=(k, n), dtype=np.uint8)
    z = np.full((groups, n), bias, np.uint8) if symmetric else rng.integers(0, 2**bits, (groups, n), np.uint8)
    s = rng.uniform(0.001, 2.0, size=(groups, n)).astype(np.float16)
    g_idx = np.arange(k, dtype=np.int32) // group
    if act_order:
        g_idx = rng.permutation(g_idx).astype(np.int32)
    padded = dict(q=layout.pad_codes(q, k_pad, n_pad, z[groups - 1], bias), z=layout.pad_matrix(z, groups, n_pad, bias),
                  s=layout.pad_matrix(s, groups, n_pad, 0), g_idx=layout.pad_g_idx(g_idx, k_pad, groups))
    return dict(q=q, z=z, s=s, g_idx=g_idx), padded


LAYER = dict(bits=BITS, k=st.integers(1, 300), n=st.integers(1, 200), g=st.sampled_from([16, 32, 64, 128, None]),
             symmetric=st.booleans(), act_order=st.booleans(), seed=st.integers(0, 2**32 - 1))


@FAST
@given(**LAYER)
def test_padded_weights_dequantize_to_exactly_zero(bits, k, n, g, symmetric, act_order, seed):
    logical, padded = _padded_layer(bits, k, n, g, symmetric, act_order, seed)
    k_pad, n_pad = padded["q"].shape
    rows = padded["g_idx"]
    # w = (q - z[g_idx[k], n]) * s[g_idx[k], n], computed in float32 over the whole padded matrix
    w = (padded["q"].astype(np.float32) - padded["z"][rows].astype(np.float32)) * padded["s"][rows].astype(np.float32)
    is_padding = np.ones((k_pad, n_pad), dtype=bool)
    is_padding[:k, :n] = False
    assert (w[is_padding] == 0).all()
    assert (padded["q"][is_padding] == padded["z"][rows][is_padding]).all()  # zero even before the scale
    expected = (logical["q"].astype(np.float32) - logical["z"][logical["g_idx"]]) * logical["s"][logical["g_idx"]]
    np.testing.assert_array_equal(w[:k, :n], expected)  # real cells unchanged


@FAST
@given(**LAYER)
def test_padded_layers_go_through_marlin_and_back(bits, k, n, g, symmetric, act_order, seed):
    logical, padded = _padded_layer(bits, k, n, g, symmetric, act_order, seed)
    k_pad = padded["q"].shape[0]
    perm, sorted_g_idx = layout.act_order_perm(padded["g_idx"])
    assert perm[k:].tolist() == list(range(k, k_pad))  # padded rows sort after every real row
    qweight = layout.pack_gptq_qweight(padded["q"], bits)
    b = layout.gptq_to_marlin_weight(qweight, perm if act_order else None, bits=bits)
    zp = layout.marlin_zero_points(padded["z"], bits)
    back_q = layout.unpack_gptq_qweight(layout.marlin_to_gptq_weight(b, perm if act_order else None, bits), bits)
    back_z = layout.marlin_to_zero_points(zp, padded["z"].shape[1], bits)
    np.testing.assert_array_equal(back_q[:k, :n], logical["q"])
    np.testing.assert_array_equal(back_z[:, :n], logical["z"])
    np.testing.assert_array_equal(layout.restore_g_idx(perm, sorted_g_idx)[:k], logical["g_idx"])


def test_the_c_entry_points_check_their_buffers(repack_implementation):
    if repack_implementation != "c-extension":
        pytest.skip("checks of the C extension itself")
    qweight = np.zeros((4, 64), dtype=np.int32)  # 8-bit K = 16, N = 64
    with pytest.raises(ValueError, match=r"buffer sizes 1024 / 512 do not match K = 16, N = 64 at 8 bits"):
        layout._repack.gptq8_to_marlin(qweight, np.zeros((1, 128), dtype=np.int32), 16, 64)
    with pytest.raises(ValueError, match=r"K = 20 must divide by 16 and N = 64 by 64"):
        layout._repack.gptq8_to_marlin(qweight, np.zeros((1, 256), dtype=np.int32), 20, 64)
    with pytest.raises(ValueError, match=r"not C-contiguous"):  # refused by the buffer protocol ("y*")
        layout._repack.gptq_to_marlin(np.zeros((2, 128), dtype=np.int32)[:, ::2], np.zeros((1, 128), np.int32), 16, 64)
