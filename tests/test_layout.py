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
from reference_layout import reference_codes, reference_gptq_to_marlin, reference_perm_table, reference_permute_scales

from marlin_convert import layout

@pytest.fixture(autouse=True, scope="module", params=["c-extension", "numpy"])
def repack_implementation(request):
    if request.param == "c-extension" and layout._repack is None:
        pytest.skip("the C fast path is not built here (setup.py builds it on install)")
    patch = pytest.MonkeyPatch()
    patch.setenv("MARLIN_CONVERT_PURE_NUMPY", "1" if request.param == "numpy" else "0")
    assert layout.fast_repack_available() == (request.param == "c-extension")
    yield request.param
    patch.undo()


SLOW = settings(max_examples=20, deadline=None)  # the loop reference is slow: keep these few
FAST = settings(max_examples=60, deadline=None)


def _random_qweight(seed: int, k: int, n: int) -> np.ndarray:
    """Uniformly random GPTQ words int32 [K/8, N] (all 16 codes, sign bit included)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**32, size=(k // 8, n), dtype=np.uint32).view(np.int32)


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
    k, n = 16 * k16, 64 * n64
    qweight = _random_qweight(seed, k, n)
    perm = np.random.default_rng(seed + 1).permutation(k).astype(np.int32) if with_perm else None
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


@FAST
@given(k16=st.integers(1, 64), n64=st.integers(1, 16), seed=st.integers(0, 2**32 - 1), with_perm=st.booleans())
def test_marlin_to_gptq_is_the_exact_inverse(k16, n64, seed, with_perm):
    k, n = 16 * k16, 64 * n64
    qweight = _random_qweight(seed, k, n)
    perm = np.random.default_rng(seed + 1).permutation(k).astype(np.int32) if with_perm else None
    b = layout.gptq_to_marlin_weight(qweight, perm)
    back = layout.marlin_to_gptq_weight(b, perm)
    assert back.dtype == np.int32 and back.shape == qweight.shape
    np.testing.assert_array_equal(back, qweight)


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
