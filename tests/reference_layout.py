"""Slow, obviously-correct references for the layout math, written with index loops straight from FORMAT.md.

They work on Python ints one value at a time and share no code with :mod:`marlin_convert.layout`.
"""

from __future__ import annotations

import numpy as np


def reference_perm_table() -> list[int]:
    """FORMAT.md section 2, step 2, transcribed literally."""
    table = []
    for i in range(32):
        c = i // 4
        r = 2 * (i % 4)
        base = []
        for cc in (c, c + 8):
            base += [16 * r + cc, 16 * (r + 1) + cc, 16 * (r + 8) + cc, 16 * (r + 9) + cc]
        for j in range(4):
            table += [x + 256 * j for x in base]
    out = []
    for start in range(0, 1024, 8):
        group = table[start:start + 8]
        out += [group[p] for p in (0, 2, 4, 6, 1, 3, 5, 7)]
    return out


def reference_codes(qweight: np.ndarray) -> list[list[int]]:
    """q[k][n] from GPTQ words, one nibble at a time."""
    k8, n = qweight.shape
    q = [[0] * n for _ in range(k8 * 8)]
    for r in range(k8):
        for col in range(n):
            word = int(qweight[r, col]) & 0xFFFFFFFF
            for i in range(8):
                q[8 * r + i][col] = (word >> (4 * i)) & 0xF
    return q


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
