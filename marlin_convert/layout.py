"""The Marlin layout math: pure functions on numpy arrays, no I/O.

Notation (as in ``shared/FORMAT.md``): ``K`` = in_features (rows of the GPTQ matrix), ``N`` = out_features,
``g`` = group size (``g == K`` for channelwise), ``b`` = bits (4 or 8), ``p = 32 / b`` codes per int32 word,
codes ``q[k, n]`` in ``0 .. 2^b - 1`` with ``w = (q - z) * s`` and ``z = 2^(b-1)`` (8 or 128) when symmetric.

GPTQ stores ``qweight`` int32 ``[K/p, N]``: word ``(r, n)`` holds ``q[p*r + i, n]`` in bits ``b*i .. b*i+b-1``.
Marlin stores ``B`` int32 ``[K/16, 2N]`` (4-bit) or ``[K/16, 4N]`` (8-bit): row ``t`` is the 16-row strip ``t``;
every run of 1024 codes covers 64 columns (four 16x16 tiles side by side), and lane ``lane`` of a warp finds
there the eight codes of each tile ``j`` that it needs for two ``mma.m16n8k16`` B fragments: at 4 bits in word
``4*lane + j`` of the run, at 8 bits in words ``8*lane + 2*j`` (column ``c``) and ``8*lane + 2*j + 1`` (``c + 8``).

4-bit, worked example of one output word. Take lane ``i`` (``c = i // 4``, ``r = 2 * (i % 4)``) and tile ``j`` of
the first 64 columns. The word's eight nibbles, low to high, are the codes at (row, column) inside the tile::

    (r, c) (r+8, c) (r, c+8) (r+8, c+8) (r+1, c) (r+9, c) (r+1, c+8) (r+9, c+8)

In GPTQ, rows ``r, r+1`` of a strip are the two nibbles of byte ``r/2`` of word ``qweight[2t, col]`` and rows
``r+8, r+9`` the same byte of ``qweight[2t+1, col]``. So every output word is made of exactly four source bytes
(``a`` = row pair r at column c, ``b`` = row pair r+8 at c, ``a'`` and ``b'`` the same at column c+8): low
nibbles ``a b a' b'`` then high nibbles ``a b a' b'``. The fast path below therefore never touches single
nibbles: it merges the two words of a strip into ``LO`` (low nibbles of a and b in one byte) and ``HI`` (high
nibbles) with whole-word masks, then moves whole bytes with two reshapes and transposes.

8-bit, the same lane and tile. The table's last step reorders each group of 4 by ``[0, 2, 1, 3]``, so the two
words hold, low byte to high byte::

    word 8*i + 2*j:      (r, c)   (r+8, c)   (r+1, c)   (r+9, c)
    word 8*i + 2*j + 1:  (r, c+8) (r+8, c+8) (r+1, c+8) (r+9, c+8)

In GPTQ 8-bit, row ``R`` of strip ``t`` is byte ``R % 4`` of word ``qweight[4t + R // 4, col]``: rows ``r, r+1``
are one 16-bit half of word ``4t + r // 4`` and rows ``r+8, r+9`` the same half of word ``4t + 2 + r // 4``. So
every output word interleaves the bytes of two source halves, and the whole repack is a byte permutation: with
``r = 2 * (2*rb1 + rb0)`` and byte ``e = 2*e1 + e0`` of the output word (row ``r + e1 + 8*e0``), the source byte
is byte ``2*rb0 + e1`` of word ``(4t + 2*e0 + rb1, 64G + 16j + 8h + c)`` and the destination is byte ``e`` of
word ``256G + 8*(4c + 2*rb1 + rb0) + 2j + h`` of row ``t``. The numpy code does that in one transpose of bytes.

Zero points (asymmetric layers, FORMAT.md section 7): true zero points ``[G, N]`` take the grouped scale order
on runs of 64 (always, even for one group), then the weight table's last reorder inside each group of ``p``, then
are packed ``p`` per word along N: ``zp`` int32 ``[G, N/p]``.

Shapes that don't tile (FORMAT.md section 8) are zero padded: rows at the end of K (to a multiple of 16, or of
whole groups), columns at the end of N (to a multiple of 64). Padded rows belong to the last group and hold its
zero point; padded columns hold code ``2^(b-1)``, zero point ``2^(b-1)`` and scale 0. Every padded weight is
then exactly 0.

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

#: codes per int32 word at 4 bits, the default width (:func:`pack_factor` gives it for any supported width)
PACK_FACTOR = 8
#: weight widths that have a Marlin form
SUPPORTED_BITS = (4, 8)
#: Marlin tiles are 16x16 (one mma.m16n8k16 B operand covers k16 x n8; two of them make a tile)
TILE = 16
#: four tiles side by side (64 columns) form one run of 1024 values
TILE_RUN_COLUMNS = 64
#: the smallest thread tile of the Marlin kernel family is 64 columns wide, so N must divide by 64
MIN_N_MULTIPLE = 64
#: locks per 64-column slice (``max_par`` = 16 thread blocks may reduce one slice)
WORKSPACE_INTS_PER_64_COLUMNS = 16
WORKSPACE_RULE = "(N / 64) * 16"

_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_FOUR = np.uint64(4)

#: the C function of ``_repack`` for each width (a build older than 8-bit support lacks the second one)
_C_REPACK = {4: "gptq_to_marlin", 8: "gptq8_to_marlin"}


def pack_factor(bits: int) -> int:
    """Codes per int32 word: ``32 // bits`` (8 at 4 bits, 4 at 8 bits). Raises ValueError for other widths."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits = {bits}: Marlin has a form only for {' and '.join(map(str, SUPPORTED_BITS))} bits")
    return 32 // bits


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


def word_interleave(bits: int) -> np.ndarray:
    """The reorder inside each group of ``p`` codes, last step of the weight table and of the zero points
    (FORMAT.md sections 2 and 7): int64 ``[p]``, ``[0, 2, 4, 6, 1, 3, 5, 7]`` at 4 bits, ``[0, 2, 1, 3]`` at 8."""
    p = pack_factor(bits)
    return np.array(list(range(0, p, 2)) + list(range(1, p, 2)), dtype=np.int64)


def marlin_weight_perm(bits: int = 4) -> np.ndarray:
    """The 1024-entry table of FORMAT.md section 2, step 2 (section 7 for 8 bits): ``out[j] = in[PERM[j]]``.

    Returns int64 ``[1024]``, a permutation of ``0..1023`` indexing four row-major 16x16 tiles side by side
    (tile ``j`` at offset ``256 * j``). The two widths differ only in the reorder inside each group of ``p``.
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
    perm = np.array(lane_lists, dtype=np.int64).reshape(-1, pack_factor(bits))
    return perm[:, word_interleave(bits)].reshape(-1)


def scale_perm_grouped() -> np.ndarray:
    """Grouped scale order (FORMAT.md section 3): int64 ``[64]``, ``[i + 8*j for i in 0..7 for j in 0..7]``."""
    return np.array([i + 8 * j for i in range(8) for j in range(8)], dtype=np.int64)


def scale_perm_channelwise() -> np.ndarray:
    """Channelwise scale order (FORMAT.md section 3): int64 ``[32]``."""
    return np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)], dtype=np.int64)


def _pack(values: np.ndarray, bits: int, slot_axis: int) -> np.ndarray:
    """uint8 codes with an axis of length ``p`` at ``slot_axis`` -> int32 words without it, value ``i`` of that
    axis in bits ``b*i ..``. ValueError when a code does not fit in ``bits``."""
    if values.size and int(values.max()) >> bits:
        raise ValueError(f"codes must lie in 0..{(1 << bits) - 1} at {bits} bits, found {int(values.max())}")
    slots = np.moveaxis(values, slot_axis, 0)
    words = np.zeros(slots.shape[1:], dtype=np.uint32)
    for i, slot in enumerate(slots):
        words |= slot.astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


def _unpack(words: np.ndarray, bits: int, slot_axis: int) -> np.ndarray:
    """int32 words -> uint8 codes with a new axis of length ``p`` at ``slot_axis``, value ``i`` from bits
    ``b*i ..``."""
    expanded = np.expand_dims(np.asarray(words).view(np.uint32), slot_axis)
    shape = [1] * expanded.ndim
    shape[slot_axis] = pack_factor(bits)
    shifts = (bits * np.arange(pack_factor(bits), dtype=np.uint32)).reshape(shape)
    return ((expanded >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8)


def unpack_gptq_qweight(qweight: np.ndarray, bits: int = 4) -> np.ndarray:
    """Unpack GPTQ words. ``qweight`` int32 ``[K/p, N]`` -> codes uint8 ``[K, N]`` in ``0 .. 2^b - 1``."""
    rows, n = qweight.shape
    return _unpack(qweight, bits, 1).reshape(rows * pack_factor(bits), n)  # [K/p, p, N] -> [K, N]


def pack_gptq_qweight(q: np.ndarray, bits: int = 4) -> np.ndarray:
    """Pack codes along K. ``q`` uint8 ``[K, N]`` (K % p == 0, values ``0 .. 2^b - 1``) -> int32 ``[K/p, N]``."""
    p = pack_factor(bits)
    k, n = q.shape
    if k % p:
        raise ValueError(f"K = {k} must divide by {p} to pack {bits}-bit codes along K")
    return _pack(q.reshape(k // p, p, n), bits, 1)


def unpack_gptq_qzeros(qzeros: np.ndarray, n: int, bits: int = 4) -> np.ndarray:
    """Unpack GPTQ zero points. ``qzeros`` int32 ``[G, ceil(N/p)]`` -> uint8 ``[G, N]`` stored values
    (v1 = z - 1); slots past N in the last word are dropped."""
    groups, words = qzeros.shape
    expected = -(-n // pack_factor(bits))
    if words != expected:
        raise ValueError(f"qzeros has {words} words per row; N = {n} at {bits} bits needs {expected}")
    return _unpack(qzeros, bits, 2).reshape(groups, -1)[:, :n]


def pack_gptq_qzeros(z: np.ndarray, bits: int = 4) -> np.ndarray:
    """Pack zero points along N. ``z`` uint8 ``[G, N]`` -> int32 ``[G, ceil(N/p)]``, low bits first; the slots
    past N in the last word are 0."""
    p = pack_factor(bits)
    groups, n = z.shape
    words = -(-n // p)
    padded = np.zeros((groups, words * p), dtype=np.uint8)
    padded[:, :n] = z
    return _pack(padded.reshape(groups, words, p), bits, 2)


def permute_rows(qweight: np.ndarray, perm: np.ndarray, bits: int = 4) -> np.ndarray:
    """Take the K rows of a GPTQ matrix in ``perm`` order: int32 ``[K/p, N]`` -> int32 ``[K/p, N]``."""
    return pack_gptq_qweight(unpack_gptq_qweight(qweight, bits)[perm], bits)


def _inverse_perm(perm: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(len(perm), dtype=perm.dtype)
    return inverse


def _check_weight_shape(k: int, n: int) -> None:
    if k % TILE or n % TILE_RUN_COLUMNS:
        raise ValueError(f"K = {k} must divide by {TILE} and N = {n} by {TILE_RUN_COLUMNS} for the Marlin tiling")


def _marlin_columns(n: int, bits: int) -> int:
    """Words per row of ``B``: 16 rows of N codes at ``b`` bits = ``N * b / 2`` (2N at 4 bits, 4N at 8)."""
    return n * bits // 2


def _output(out: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """``out`` checked to be a C-contiguous int32 array of ``shape``, or a new one."""
    if out is None:
        return np.empty(shape, dtype=np.int32)
    if out.shape != shape or out.dtype != np.int32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous int32 array of shape {shape}, "
                         f"got {out.dtype} {out.shape}{'' if out.flags.c_contiguous else ' (not contiguous)'}")
    return out


def fast_repack_available(bits: int = 4) -> bool:
    """True when the C fast path for ``bits`` is built and not switched off with MARLIN_CONVERT_PURE_NUMPY=1."""
    pack_factor(bits)
    return (_repack is not None and hasattr(_repack, _C_REPACK[bits])
            and os.environ.get("MARLIN_CONVERT_PURE_NUMPY") != "1")


def gptq_to_marlin_weight(qweight: np.ndarray, perm: np.ndarray | None = None,
                          out: np.ndarray | None = None, bits: int = 4) -> np.ndarray:
    """Repack GPTQ weights into Marlin tiles.

    ``qweight`` int32 ``[K/p, N]`` (K % 16 == 0, N % 64 == 0); ``perm`` optional int ``[K]`` (act-order: rows
    of q are taken in this order first); ``out`` optional C-contiguous int32 ``[K/16, N*b/2]`` to write into;
    ``bits`` 4 or 8. Returns int32 ``[K/16, 2N]`` at 4 bits, ``[K/16, 4N]`` at 8 bits (``out`` when given).
    Uses the C fast path when it is built (one pass over the words), else :func:`gptq_to_marlin_weight_numpy`;
    both give identical results.
    """
    if not fast_repack_available(bits):
        return gptq_to_marlin_weight_numpy(qweight, perm, out, bits)
    if perm is not None:
        qweight = permute_rows(qweight, perm, bits)
    rows, n = qweight.shape
    k = rows * pack_factor(bits)
    _check_weight_shape(k, n)
    out = _output(out, (k // TILE, _marlin_columns(n, bits)))
    getattr(_repack, _C_REPACK[bits])(np.ascontiguousarray(qweight, dtype=np.int32), out, k, n)
    return out


def gptq_to_marlin_weight_numpy(qweight: np.ndarray, perm: np.ndarray | None = None,
                                out: np.ndarray | None = None, bits: int = 4) -> np.ndarray:
    """:func:`gptq_to_marlin_weight` with numpy whole-word (4-bit) or whole-byte (8-bit) operations only, no C
    extension needed: see the module docstring for where each source byte goes. Same arguments, same result."""
    if perm is not None:
        qweight = permute_rows(qweight, perm, bits)
    rows, n = qweight.shape
    k = rows * pack_factor(bits)
    _check_weight_shape(k, n)
    out = _output(out, (k // TILE, _marlin_columns(n, bits)))
    repack = _repack4_numpy if bits == 4 else _repack8_numpy
    repack(np.ascontiguousarray(qweight, dtype=np.int32), out)
    return out


def _repack4_numpy(qweight: np.ndarray, out: np.ndarray) -> None:
    k8, n = qweight.shape
    strips = k8 // 2
    # Pair word (2t, col) with word (2t+1, col): rows 16t..16t+7 and 16t+8..16t+15 of the strip. Viewing
    # pairs of words as uint64 halves the number of element operations; the masks are byte-periodic.
    words = qweight.view(np.uint64).reshape(strips, 2, n // 2)
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
    np.copyto(out.view(np.uint8).reshape(strips, n // 64, 8, 4, 16), byte_view.transpose(0, 1, 2, 4, 3))


# 8-bit byte coordinates (module docstring): a GPTQ strip of 4 words per column, as bytes, is
# [t, e0, rb1, G, j, h, c, rb0, e1] and the Marlin row is [t, G, c, rb1, rb0, j, h, e1, e0].
_GPTQ8_TO_MARLIN_AXES = (0, 3, 6, 2, 7, 4, 5, 8, 1)
_MARLIN8_TO_GPTQ_AXES = tuple(int(a) for a in np.argsort(_GPTQ8_TO_MARLIN_AXES))


def _gptq8_byte_view(words: np.ndarray, strips: int, n: int) -> np.ndarray:
    return words.view(np.uint8).reshape(strips, 2, 2, n // 64, 4, 2, 8, 2, 2)


def _marlin8_byte_view(words: np.ndarray, strips: int, n: int) -> np.ndarray:
    return words.view(np.uint8).reshape(strips, n // 64, 8, 2, 2, 4, 2, 2, 2)


def _repack8_numpy(qweight: np.ndarray, out: np.ndarray) -> None:
    k4, n = qweight.shape
    strips = k4 // 4
    source = _gptq8_byte_view(qweight, strips, n)
    np.copyto(_marlin8_byte_view(out, strips, n), source.transpose(_GPTQ8_TO_MARLIN_AXES))


def marlin_to_gptq_weight(b: np.ndarray, perm: np.ndarray | None = None, bits: int = 4) -> np.ndarray:
    """Exact inverse of :func:`gptq_to_marlin_weight`: int32 ``[K/16, N*b/2]`` (+ the same ``perm`` and ``bits``)
    -> int32 ``[K/p, N]``."""
    pack_factor(bits)
    strips, columns = b.shape
    n = columns * 2 // bits
    if _marlin_columns(n, bits) != columns:
        raise ValueError(f"B has {columns} words per row: not N * {bits} / 2 for any N")
    _check_weight_shape(strips * TILE, n)
    unrepack = _unrepack4 if bits == 4 else _unrepack8
    qweight = unrepack(np.ascontiguousarray(b, dtype=np.int32), strips, n)
    if perm is not None:
        qweight = permute_rows(qweight, _inverse_perm(perm), bits)
    return qweight


def _unrepack8(b: np.ndarray, strips: int, n: int) -> np.ndarray:
    by_source = np.ascontiguousarray(_marlin8_byte_view(b, strips, n).transpose(_MARLIN8_TO_GPTQ_AXES))
    return by_source.reshape(-1).view(np.int32).reshape(4 * strips, n)


def _unrepack4(b: np.ndarray, strips: int, n: int) -> np.ndarray:
    byte_view = b.view(np.uint8).reshape(strips, n // 64, 8, 4, 16)  # t, G, c, rb, (j, kind, h)
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
    return words.view(np.int32).reshape(strips * 2, n)


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


def marlin_zero_points(z: np.ndarray, bits: int) -> np.ndarray:
    """Marlin zero points of an asymmetric layer (FORMAT.md section 7).

    ``z`` uint8 ``[G, N]`` true zero points (v1 stored value + 1; N % 64 == 0) -> int32 ``[G, N/p]``: each run of
    64 values reordered by :func:`scale_perm_grouped` (always, even for G == 1: never the channelwise table),
    then each group of ``p`` by :func:`word_interleave`, then packed ``p`` per word along N, low bits first.
    """
    p = pack_factor(bits)
    groups, n = z.shape
    if n % TILE_RUN_COLUMNS:
        raise ValueError(f"N = {n} must divide by {TILE_RUN_COLUMNS} for Marlin zero points")
    grouped = np.ascontiguousarray(z).reshape(-1, TILE_RUN_COLUMNS)[:, scale_perm_grouped()]
    interleaved = grouped.reshape(-1, p)[:, word_interleave(bits)]
    return _pack(interleaved.reshape(groups, n // p, p), bits, 2)


def marlin_to_zero_points(zp: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Exact inverse of :func:`marlin_zero_points`: int32 ``[G, N/p]`` -> true zero points uint8 ``[G, N]``."""
    p = pack_factor(bits)
    groups, words = zp.shape
    if n % TILE_RUN_COLUMNS or words * p != n:
        raise ValueError(f"zp has {words} words per row: N = {n} at {bits} bits needs N % 64 == 0 and {n // p}")
    interleaved = _unpack(zp, bits, 2).reshape(-1, p)
    grouped = interleaved[:, np.argsort(word_interleave(bits))].reshape(-1, TILE_RUN_COLUMNS)
    return np.ascontiguousarray(grouped[:, np.argsort(scale_perm_grouped())]).reshape(groups, n)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_shape(k: int, n: int, group_size: int) -> tuple[int, int]:
    """The shape ``(k_pad, n_pad)`` a layer of logical shape K x N takes in Marlin form (FORMAT.md section 8).

    ``group_size`` is the effective group size (``== k`` for channelwise). Channelwise: ``k_pad`` = K rounded
    up to a multiple of 16. Grouped: ``group_size`` must divide by 16 (else ValueError) and ``k_pad`` =
    ``ceil(K / g) * g`` (whole groups). ``n_pad`` = N rounded up to a multiple of 64. Equal to ``(k, n)``
    when the layer already tiles. Example: K = 1000, N = 1000, g = 128 -> (1024, 1024); channelwise -> (1008,
    1024).
    """
    if k <= 0 or n <= 0 or group_size <= 0:
        raise ValueError(f"K = {k}, N = {n} and group size {group_size} must be positive")
    if group_size == k:
        k_pad = _round_up(k, TILE)
    elif group_size % TILE:
        raise ValueError(f"group size {group_size} (K = {k}) must divide by {TILE}: a Marlin tile of {TILE} rows "
                         "cannot span two groups")
    else:
        k_pad = _round_up(k, group_size)
    return k_pad, _round_up(n, MIN_N_MULTIPLE)


def _check_padding(what: str, shape: tuple[int, int], target: tuple[int, int]) -> None:
    if target[0] < shape[0] or target[1] < shape[1]:
        raise ValueError(f"cannot pad {what} of shape {shape} to the smaller shape {target}")


def pad_codes(q: np.ndarray, k_pad: int, n_pad: int, row_fill: np.ndarray, col_fill: int) -> np.ndarray:
    """Zero-padding of a code matrix (FORMAT.md section 8): uint8 ``[K, N]`` -> a new uint8 ``[k_pad, n_pad]``.

    Rows ``K ..`` take ``row_fill`` uint8 ``[N]`` (the last group's zero point of each column, so the padded
    rows' weights are exactly 0); columns ``N ..`` take the scalar code ``col_fill`` in every row (the zero
    point given to padded columns).
    """
    k, n = q.shape
    _check_padding("codes", (k, n), (k_pad, n_pad))
    row_fill = np.asarray(row_fill)
    if row_fill.shape != (n,):
        raise ValueError(f"row_fill must have shape ({n},), got {row_fill.shape}")
    padded = np.empty((k_pad, n_pad), dtype=np.uint8)
    padded[:k, :n] = q
    padded[k:, :n] = row_fill
    padded[:, n:] = col_fill
    return padded


def pad_matrix(x: np.ndarray, rows: int, cols: int, fill) -> np.ndarray:
    """Any dtype ``[R, C]`` -> a new ``[rows, cols]`` of the same dtype; the new cells hold ``fill`` (scales: 0,
    zero points: ``2^(b-1)``)."""
    _check_padding("matrix", x.shape, (rows, cols))
    padded = np.full((rows, cols), fill, dtype=x.dtype)
    padded[: x.shape[0], : x.shape[1]] = x
    return padded


def pad_g_idx(g_idx: np.ndarray, k_pad: int, num_groups: int) -> np.ndarray:
    """int ``[K]`` -> int32 ``[k_pad]``: padded rows belong to the last group ``num_groups - 1``, so with act-order
    the stable argsort (:func:`act_order_perm`) puts them after every real row."""
    if k_pad < len(g_idx) or num_groups < 1:
        raise ValueError(f"cannot pad g_idx of {len(g_idx)} rows to {k_pad} rows in {num_groups} groups")
    padded = np.full(k_pad, num_groups - 1, dtype=np.int32)
    padded[: len(g_idx)] = g_idx
    return padded


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
