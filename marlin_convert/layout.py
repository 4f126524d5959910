"""The Marlin layout math: pure functions on numpy arrays, no I/O.

Notation (as in ``shared/FORMAT.md``): ``K`` = in_features (rows of the GPTQ matrix), ``N`` = out_features,
``g`` = group size (``g == K`` for channelwise), 4-bit codes ``q[k, n]`` in 0..15 with ``w = (q - 8) * s``.

GPTQ stores ``qweight`` int32 ``[K/8, N]``: word ``(r, n)`` holds ``q[8r + i, n]`` in bits ``4i..4i+3``.
Marlin stores ``B`` int32 ``[K/16, 2N]``: row ``t`` is the 16-row strip ``t``; every run of 128 words covers
64 columns (four 16x16 tiles side by side) and word ``4*lane + j`` holds what lane ``lane`` of a warp needs of
tile ``j`` for two ``mma.m16n8k16`` B fragments.

Worked example of one output word. Take lane ``i`` (``c = i // 4``, ``r = 2 * (i % 4)``) and tile ``j`` of the
first 64 columns. The word's eight nibbles, low to high, are the codes at (row, column) inside the tile::

    (r, c) (r+8, c) (r, c+8) (r+8, c+8) (r+1, c) (r+9, c) (r+1, c+8) (r+9, c+8)

In GPTQ, rows ``r, r+1`` of a strip are the two nibbles of byte ``r/2`` of word ``qweight[2t, col]`` and rows
``r+8, r+9`` the same byte of ``qweight[2t+1, col]``. So every output word is made of exactly four source bytes
(``a`` = row pair r at column c, ``b`` = row pair r+8 at c, ``a'`` and ``b'`` the same at column c+8): low
nibbles ``a b a' b'`` then high nibbles ``a b a' b'``. The fast path below therefore never touches single
nibbles: it merges the two words of a strip into ``LO`` (low nibbles of a and b in one byte) and ``HI`` (high
nibbles) with whole-word masks, then moves whole bytes with two reshapes and transposes.

Every function here has a slow reference written with index loops in ``tests/reference_layout.py``.
"""

from __future__ import annotations

import os
import threading

import numpy as np

try:  # the optional C fast path (setup.py builds it at install time); same output as the numpy code below
    from . import _repack
except ImportError:  # pragma: no cover - depends on how the package was installed
    _repack = None

#: values per int32 word at 4 bits
PACK_FACTOR = 8
#: Marlin tiles are 16x16 (one mma.m16n8k16 B operand covers k16 x n8; two of them make a tile)
TILE = 16
#: four tiles side by side (64 columns) form one run of 1024 values = 128 words
TILE_RUN_COLUMNS = 64
#: the smallest thread tile of the Marlin kernel family is 64 columns wide, so N must divide by 64
MIN_N_MULTIPLE = 64
#: locks per 64-column slice (``max_par`` = 16 thread blocks may reduce one slice)
WORKSPACE_INTS_PER_64_COLUMNS = 16
WORKSPACE_RULE = "(N / 64) * 16"

_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_FOUR = np.uint64(4)


_scratch = threading.local()


def _scratch_array(slot: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array backed by a per-thread buffer that is reused across calls.

    Only for intermediates that never leave a function: fresh multi-megabyte arrays cost more in page faults
    than the byte shuffles themselves, and the converter repacks hundreds of same-sized matrices per thread.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(slot)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[slot] = np.empty(nbytes, dtype=np.uint8)
    return buffer[:nbytes].view(dtype).reshape(shape)


def marlin_weight_perm() -> np.ndarray:
    """The 1024-entry table of FORMAT.md section 2, step 2: ``out[j] = in[PERM[j]]``.

    Returns int64 ``[1024]``, a permutation of ``0..1023`` indexing four row-major 16x16 tiles side by side
    (tile ``j`` at offset ``256 * j``).
    """
    lane_lists = []
    for lane in range(32):
        col = lane // 4
        row = 2 * (lane % 4)
        one_tile = []
        for c in (col, col + 8):
            one_tile += [16 * row + c, 16 * (row + 1) + c, 16 * (row + 8) + c, 16 * (row + 9) + c]
        for tile in range(4):
            lane_lists += [v + 256 * tile for v in one_tile]
    perm = np.array(lane_lists, dtype=np.int64).reshape(-1, 8)
    return perm[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)


def scale_perm_grouped() -> np.ndarray:
    """Grouped scale order (FORMAT.md section 3): int64 ``[64]``, ``[i + 8*j for i in 0..7 for j in 0..7]``."""
    return np.array([i + 8 * j for i in range(8) for j in range(8)], dtype=np.int64)


def scale_perm_channelwise() -> np.ndarray:
    """Channelwise scale order (FORMAT.md section 3): int64 ``[32]``."""
    return np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)], dtype=np.int64)


def unpack_gptq_qweight(qweight: np.ndarray) -> np.ndarray:
    """Unpack GPTQ 4-bit words. ``qweight`` int32 ``[K/8, N]`` -> codes uint8 ``[K, N]`` in 0..15."""
    words = qweight.view(np.uint32)
    shifts = (4 * np.arange(PACK_FACTOR, dtype=np.uint32))[None, :, None]
    codes = (words[:, None, :] >> shifts) & np.uint32(0xF)
    return codes.astype(np.uint8).reshape(words.shape[0] * PACK_FACTOR, words.shape[1])


def pack_gptq_qweight(q: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes. ``q`` uint8 ``[K, N]`` (K % 8 == 0, values 0..15) -> int32 ``[K/8, N]``."""
    k, n = q.shape
    rows = q.reshape(k // PACK_FACTOR, PACK_FACTOR, n).astype(np.uint32)
    words = np.zeros((k // PACK_FACTOR, n), dtype=np.uint32)
    for i in range(PACK_FACTOR):
        words |= rows[:, i, :] << np.uint32(4 * i)
    return words.view(np.int32)


def unpack_gptq_qzeros(qzeros: np.ndarray, n: int) -> np.ndarray:
    """Unpack GPTQ zero points. ``qzeros`` int32 ``[G, N/8]`` -> uint8 ``[G, N]`` stored values (v1 = z - 1)."""
    words = qzeros.view(np.uint32)
    shifts = (4 * np.arange(PACK_FACTOR, dtype=np.uint32))[None, None, :]
    values = (words[:, :, None] >> shifts) & np.uint32(0xF)
    return values.astype(np.uint8).reshape(words.shape[0], -1)[:, :n]


def pack_gptq_qzeros(z: np.ndarray) -> np.ndarray:
    """Pack zero points. ``z`` uint8 ``[G, N]`` (N % 8 == 0) -> int32 ``[G, N/8]``, low nibbles first."""
    groups, n = z.shape
    values = z.reshape(groups, n // PACK_FACTOR, PACK_FACTOR).astype(np.uint32)
    words = np.zeros((groups, n // PACK_FACTOR), dtype=np.uint32)
    for i in range(PACK_FACTOR):
        words |= values[:, :, i] << np.uint32(4 * i)
    return words.view(np.int32)


def permute_rows(qweight: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Take the K rows of a GPTQ matrix in ``perm`` order: int32 ``[K/8, N]`` -> int32 ``[K/8, N]``."""
    return pack_gptq_qweight(unpack_gptq_qweight(qweight)[perm])


def _check_weight_shape(k: int, n: int) -> None:
    if k % TILE or n % TILE_RUN_COLUMNS:
        raise ValueError(f"K = {k} must divide by {TILE} and N = {n} by {TILE_RUN_COLUMNS} for the Marlin tiling")


def fast_repack_available() -> bool:
    """True when the C fast path is built and not switched off with MARLIN_CONVERT_PURE_NUMPY=1."""
    return _repack is not None and os.environ.get("MARLIN_CONVERT_PURE_NUMPY") != "1"


def gptq_to_marlin_weight(qweight: np.ndarray, perm: np.ndarray | None = None,
                          out: np.ndarray | None = None) -> np.ndarray:
    """Repack GPTQ 4-bit weights into Marlin tiles.

    ``qweight`` int32 ``[K/8, N]`` (K % 16 == 0, N % 64 == 0); ``perm`` optional int ``[K]`` (act-order: rows
    of q are taken in this order first); ``out`` optional contiguous int32 ``[K/16, 2N]`` to write into.
    Returns int32 ``[K/16, 2N]`` (``out`` when given). Uses the C fast path when it is built (one pass over
    the words), else :func:`gptq_to_marlin_weight_numpy`; both give identical results.
    """
    if not fast_repack_available():
        return gptq_to_marlin_weight_numpy(qweight, perm, out)
    if perm is not None:
        qweight = permute_rows(qweight, perm)
    k8, n = qweight.shape
    _check_weight_shape(k8 * PACK_FACTOR, n)
    if out is None:
        out = np.empty((k8 // 2, 2 * n), dtype=np.int32)
    _repack.gptq_to_marlin(np.ascontiguousarray(qweight, dtype=np.int32), out, k8 * PACK_FACTOR, n)
    return out


def gptq_to_marlin_weight_numpy(qweight: np.ndarray, perm: np.ndarray | None = None,
                                out: np.ndarray | None = None) -> np.ndarray:
    """:func:`gptq_to_marlin_weight` with numpy whole-word operations only (no C extension needed): see the
    module docstring for why four source bytes make one output word. Same arguments, same result."""
    if perm is not None:
        qweight = permute_rows(qweight, perm)
    k8, n = qweight.shape
    k = k8 * PACK_FACTOR
    _check_weight_shape(k, n)
    strips = k // TILE
    # Pair word (2t, col) with word (2t+1, col): rows 16t..16t+7 and 16t+8..16t+15 of the strip. Viewing
    # pairs of words as uint64 halves the number of element operations; the masks are byte-periodic.
    words = np.ascontiguousarray(qweight).view(np.uint64).reshape(strips, 2, n // 2)
    upper, lower = words[:, 0, :], words[:, 1, :]  # rows 0-7 (a) and rows 8-15 (b) of each strip
    merged = _scratch_array("merged", (strips, 2, n // 2), np.uint64)
    masked = _scratch_array("masked", (strips, n // 2), np.uint64)
    lo, hi = merged[:, 0, :], merged[:, 1, :]
    # LO byte = low nibble of a | low nibble of b << 4; HI byte = high nibble of a | high nibble of b << 4.
    np.bitwise_and(lower, _LOW_NIBBLES, out=lo)
    np.left_shift(lo, _FOUR, out=lo)
    lo |= np.bitwise_and(upper, _LOW_NIBBLES, out=masked)
    np.right_shift(upper, _FOUR, out=hi)
    hi &= _LOW_NIBBLES
    hi |= np.bitwise_and(lower, _HIGH_NIBBLES, out=masked)
    # merged words as [t, kind(LO/HI), G, j, h, c] with column = 64G + 16j + 8h + c; output words are
    # [t, G, c, rb, j] with bytes (kind, h). First move whole words, then the byte index rb outwards.
    word_view = merged.view(np.uint32).reshape(strips, 2, n // 64, 4, 2, 8)
    by_lane = _scratch_array("by_lane", (strips, n // 64, 8, 4, 2, 2), np.uint32)  # t, G, c, j, kind, h
    np.copyto(by_lane, word_view.transpose(0, 2, 5, 3, 1, 4))
    byte_view = by_lane.view(np.uint8).reshape(strips, n // 64, 8, 16, 4)  # ..., (j, kind, h), rb
    if out is None:
        out = np.empty((strips, 2 * n), dtype=np.int32)
    np.copyto(out.view(np.uint8).reshape(strips, n // 64, 8, 4, 16), byte_view.transpose(0, 1, 2, 4, 3))
    return out


def marlin_to_gptq_weight(b: np.ndarray, perm: np.ndarray | None = None) -> np.ndarray:
    """Exact inverse of :func:`gptq_to_marlin_weight`: int32 ``[K/16, 2N]`` (+ the same ``perm``) -> int32
    ``[K/8, N]``."""
    strips, two_n = b.shape
    n = two_n // 2
    _check_weight_shape(strips * TILE, n)
    byte_view = np.ascontiguousarray(b).view(np.uint8).reshape(strips, n // 64, 8, 4, 16)  # t,G,c,rb,(j,kind,h)
    by_lane = np.ascontiguousarray(byte_view.transpose(0, 1, 2, 4, 3))  # t, G, c, (j, kind, h), rb
    word_view = by_lane.view(np.uint32).reshape(strips, n // 64, 8, 4, 2, 2)  # t, G, c, j, kind, h
    merged = np.ascontiguousarray(word_view.transpose(0, 4, 1, 3, 5, 2))  # t, kind, G, j, h, c
    merged64 = merged.view(np.uint64).reshape(strips, 2, n // 2)
    lo, hi = merged64[:, 0, :], merged64[:, 1, :]
    words = np.empty((strips, 2, n // 2), dtype=np.uint64)
    upper, lower = words[:, 0, :], words[:, 1, :]
    np.bitwise_and(hi, _LOW_NIBBLES, out=upper)
    np.left_shift(upper, _FOUR, out=upper)
    upper |= lo & _LOW_NIBBLES
    np.right_shift(lo, _FOUR, out=lower)
    lower &= _LOW_NIBBLES
    lower |= hi & _HIGH_NIBBLES
    qweight = words.view(np.int32).reshape(strips * 2, n)
    if perm is not None:
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(len(perm), dtype=perm.dtype)
        qweight = permute_rows(qweight, inverse)
    return qweight


def _scale_table(rows: int) -> np.ndarray:
    return scale_perm_grouped() if rows > 1 else scale_perm_channelwise()


def permute_scales(scales: np.ndarray) -> np.ndarray:
    """Reorder GPTQ scales for Marlin. ``scales`` ``[K/g, N]`` (any dtype; N % 64 == 0) -> same shape and dtype.

    More than one row (grouped): each run of 64 values is reordered by :func:`scale_perm_grouped`. One row
    (channelwise, including a group size equal to K): runs of 32 by :func:`scale_perm_channelwise`.
    """
    rows, n = scales.shape
    table = _scale_table(rows)
    return np.ascontiguousarray(np.ascontiguousarray(scales).reshape(-1, len(table))[:, table].reshape(rows, n))


def unpermute_scales(s: np.ndarray) -> np.ndarray:
    """Exact inverse of :func:`permute_scales`: ``[K/g, N]`` -> ``[K/g, N]``, same dtype."""
    rows, n = s.shape
    inverse = np.argsort(_scale_table(rows))
    return np.ascontiguousarray(np.ascontiguousarray(s).reshape(-1, len(inverse))[:, inverse].reshape(rows, n))


def trivial_g_idx(k: int, group_size: int) -> np.ndarray:
    """The g_idx of a checkpoint without act-order: int32 ``[K]``, ``g_idx[k] = k // group_size``."""
    return (np.arange(k, dtype=np.int64) // group_size).astype(np.int32)


def act_order_perm(g_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Act-order (FORMAT.md section 7): ``g_idx`` int ``[K]`` -> ``(perm, sorted_g_idx)``, both int32 ``[K]``.

    ``perm`` is the *stable* argsort of ``g_idx``, so the result is the same on every platform;
    ``sorted_g_idx = g_idx[perm]`` is non-decreasing, so groups are contiguous after the row permutation.
    """
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    return perm, np.ascontiguousarray(g_idx[perm]).astype(np.int32)


def restore_g_idx(perm: np.ndarray, sorted_g_idx: np.ndarray) -> np.ndarray:
    """Inverse of :func:`act_order_perm`: int32 ``[K]`` x2 -> the original g_idx int32 ``[K]``."""
    g_idx = np.empty_like(sorted_g_idx)
    g_idx[perm] = sorted_g_idx
    return g_idx


def workspace_ints(n: int) -> int:
    """Zeroed int32 workspace a Marlin GEMM with N output columns needs: ``(N / 64) * 16`` (FORMAT.md section 4,
    the safe upper bound since the smallest thread tile is 64 columns)."""
    return (n // MIN_N_MULTIPLE) * WORKSPACE_INTS_PER_64_COLUMNS
