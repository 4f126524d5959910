"""Slow, obviously-correct references for the layout math, written with index loops straight from FORMAT.md.

They work on Python ints one value at a time and share no code with :mod:`marlin_convert.layout`.
"""

from __future__ import annotations

import numpy as np


def reference_perm_table(bits: int = 4) -> list[int]:
    """FORMAT.md section 2, step 2, transcribed literally; at 8 bits the last reorder is section 7's."""
    table = []
    for i in range(32):
        c = i // 4
        r = 2 * (i % 4)
        base = []
        for cc in (c, c + 8):
            base += [16 * r + cc, 16 * (r + 1) + cc, 16 * (r + 8) + cc, 16 * (r + 9) + cc]
        for j in range(4):
            table += [x + 256 * j for x in base]
    reorder = (0, 2, 4, 6, 1, 3, 5, 7) if bits == 4 else (0, 2, 1, 3)
    out = []
    for start in range(0, 1024, len(reorder)):
        group = table[start:start + len(reorder)]
        out += [group[p] for p in reorder]
    return out


def reference_codes(qweight: np.ndarray, bits: int = 4) -> list[list[int]]:
    """q[k][n] from GPTQ words, one value at a time."""
    per_word = 32 // bits
    rows, n = qweight.shape
    q = [[0] * n for _ in range(rows * per_word)]
    for r in range(rows):
        for col in range(n):
            word = int(qweight[r, col]) & 0xFFFFFFFF
            for i in range(per_word):
                q[per_word * r + i][col] = (word >> (bits * i)) & ((1 << bits) - 1)
    return q


def reference_pack_qweight(q: list[list[int]], bits: int) -> np.ndarray:
    """GPTQ words from codes q[k][n], one value at a time: value k goes to word k // p, slot k % p."""
    per_word = 32 // bits
    k, n = len(q), len(q[0])
    out = np.zeros((k // per_word, n), dtype=np.uint32)
    for row in range(k):
        for col in range(n):
            out[row // per_word, col] |= q[row][col] << (bits * (row % per_word))
    return out.view(np.int32)


def reference_pack_qzeros(z: list[list[int]], bits: int) -> np.ndarray:
    """GPTQ qzeros from zero points z[g][n]: value n goes to word n // p, slot n % p; ceil(N / p) words."""
    per_word = 32 // bits
    groups, n = len(z), len(z[0])
    out = np.zeros((groups, (n + per_word - 1) // per_word), dtype=np.uint32)
    for g in range(groups):
        for col in range(n):
            out[g, col // per_word] |= z[g][col] << (bits * (col % per_word))
    return out.view(np.int32)


def reference_gptq_to_marlin(qweight: np.ndarray, perm: list[int] | None = None) -> np.ndarray:
    """Tile, permute by the 1024 table, pack: three explicit loops over indices."""
    q = reference_codes(qweight)
    if perm is not None:
        q = [q[p] for p in perm]
    k, n = len(q), len(q[0])
    table = reference_perm_table()
    out = np.zeros((k // 16, 2 * n), dtype=np.uint32)
    for t in range(k // 16):
        # step 1: strip t as N/16 row-major 16x16 tiles
        strip = []
        for tile in range(n // 16):
            for row in range(16):
                for col in range(16):
                    strip.append(q[16 * t + row][16 * tile + col])
        # step 2: permute each run of 1024
        permuted = []
        for run in range(0, len(strip), 1024):
            permuted += [strip[run + table[j]] for j in range(1024)]
        # step 3: pack 8 values per word, low bits first
        for w in range(2 * n):
            word = 0
            for i in range(8):
                word |= permuted[8 * w + i] << (4 * i)
            out[t, w] = word
    return out.view(np.int32)


def reference_permute_scales(scales: np.ndarray) -> np.ndarray:
    rows, n = scales.shape
    if rows > 1:
        order = [i + 8 * j for i in range(8) for j in range(8)]
    else:
        order = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    flat = scales.reshape(-1)
    out = np.empty_like(flat)
    width = len(order)
    for start in range(0, flat.size, width):
        for pos in range(width):
            out[start + pos] = flat[start + order[pos]]
    return out.reshape(rows, n)


def reference_gptq_to_marlin_by_placement(qweight: np.ndarray, bits: int, perm: list[int] | None = None) -> np.ndarray:
    """The Marlin words built value by value: for every code (k, n) find where FORMAT.md puts it.

    Its place in strip k // 16 listed as row-major 16x16 tiles is (n // 16) * 256 + (k % 16) * 16 + n % 16; the run
    of 1024 it falls in keeps its offset, and inside the run it moves to the j with PERM[j] == its index; then value
    number m of the row sits in word m // p at bits (m % p) * b.
    """
    q = reference_codes(qweight, bits)
    if perm is not None:
        q = [q[p] for p in perm]
    k, n = len(q), len(q[0])
    per_word = 32 // bits
    table = reference_perm_table(bits)
    destination = {source: j for j, source in enumerate(table)}
    out = np.zeros((k // 16, n * 16 // per_word), dtype=np.uint32)
    for row in range(k):
        for col in range(n):
            listed = (col // 16) * 256 + (row % 16) * 16 + col % 16
            m = (listed // 1024) * 1024 + destination[listed % 1024]
            out[row // 16, m // per_word] |= q[row][col] << (bits * (m % per_word))
    return out.view(np.int32)


def reference_marlin_zero_points(z: list[list[int]], bits: int) -> np.ndarray:
    """Marlin zp from true zero points z[g][n], value by value (FORMAT.md section 7).

    Inside its run of 64, value n moves to the j with grouped_order[j] == n % 64; inside its group of p that j
    moves to the position m with reorder[m % p] == j % p; then it is packed p per word along N.
    """
    per_word = 32 // bits
    grouped_order = [i + 8 * j for i in range(8) for j in range(8)]
    reorder = [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3]
    groups, n = len(z), len(z[0])
    out = np.zeros((groups, n // per_word), dtype=np.uint32)
    for g in range(groups):
        for col in range(n):
            j = grouped_order.index(col % 64)
            m = (j // per_word) * per_word + reorder.index(j % per_word)
            place = (col // 64) * 64 + m
            out[g, place // per_word] |= z[g][col] << (bits * (place % per_word))
    return out.view(np.int32)


def reference_padded_shape(k: int, n: int, group_size: int) -> tuple[int, int]:
    """FORMAT.md section 8 by counting: add rows until K tiles (channelwise) or fills whole groups, columns until N
    divides by 64."""
    k_pad, n_pad = k, n
    step = 16 if group_size == k else group_size
    while k_pad % step:
        k_pad += 1
    while n_pad % 64:
        n_pad += 1
    return k_pad, n_pad


def reference_pad_codes(q: list[list[int]], k_pad: int, n_pad: int, row_fill: list[int], col_fill: int) -> np.ndarray:
    """Cell by cell: a real cell keeps its code, a padded column takes col_fill, a padded row row_fill[n]."""
    k, n = len(q), len(q[0])
    out = np.zeros((k_pad, n_pad), dtype=np.uint8)
    for row in range(k_pad):
        for col in range(n_pad):
            if col >= n:
                out[row, col] = col_fill
            elif row >= k:
                out[row, col] = row_fill[col]
            else:
                out[row, col] = q[row][col]
    return out
