"""Rebuild GPTQ tensors from one converted layer's Marlin tensors: the exact inverse of the converter.

One *slice* is a plain layer or one expert of a stacked layer. :func:`rebuild_slice` reads the slice's Marlin
tensors (``B``, ``s``, ``zp``, ``perm``, ``g_idx``) from the output shards into a :class:`Stage`, checks the
tables that index memory (``perm`` a permutation, the sorted ``g_idx`` non-decreasing and in range), inverts the
layout (the C fast path where it is built), strips the padding and writes the source tensors (``qweight``,
``scales``, ``qzeros``, ``g_idx``) into the same stage. Every array lives at a known offset of the stage's one
buffer, so ``verify`` can hash them where they are and upload the whole slice to a GPU in one copy.

Notation as in FORMAT.md: K, N logical, K_pad, N_pad padded, b bits, p = 32 / b, G groups, bias = 2^(b-1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from . import compressed_tensors, layout
from .errors import ManifestError
from .fileio import open_inside
from .safetensors_io import TensorInfo
from .spec import QuantSpec

#: every array in a stage starts at a multiple of this many bytes (keeps device views aligned)
ALIGN = 256
#: manifest scale_dtype -> (safetensors dtype, numpy dtype holding the bits; bfloat16 as uint16)
SCALE_DTYPES = {"float16": ("F16", np.dtype("<f2")), "bfloat16": ("BF16", np.dtype("<u2")),
                "float32": ("F32", np.dtype("<f4"))}


@dataclass(frozen=True)
class MarlinLayer:
    """One ``layers`` entry of the manifest, checked for types, with where its Marlin tensors are.

    ``tensors`` maps each Marlin kind (``B``, ``s``, ``zp``, ``perm``, ``g_idx``) to ``(shard, tensor name)``.
    """

    name: str
    spec: QuantSpec
    padded_in_features: int
    padded_out_features: int
    tensors: dict[str, tuple[str, str]]

    @property
    def num_groups(self) -> int:
        return self.spec.num_groups

    def shape(self, kind: str) -> tuple[int, ...]:
        """Shape of one slice of Marlin tensor ``kind`` (CONTRACT C), from K_pad, N_pad, bits and groups."""
        k_pad, n_pad, spec = self.padded_in_features, self.padded_out_features, self.spec
        return {"B": (k_pad // layout.TILE, n_pad * spec.bits // 2), "s": (spec.num_groups, n_pad),
                "zp": (spec.num_groups, n_pad // spec.pack_factor), "perm": (k_pad,), "g_idx": (k_pad,)}[kind]

    def dtype(self, kind: str) -> str:
        """safetensors dtype of Marlin tensor ``kind``."""
        return SCALE_DTYPES[self.spec.scale_dtype][0] if kind == "s" else "I32"

    @property
    def expected_kinds(self) -> tuple[str, ...]:
        """The Marlin tensors this layer must have: B and s, zp when asymmetric, perm and g_idx with act-order."""
        return ("B", "s") + (() if self.spec.sym else ("zp",)) + (("perm", "g_idx") if self.spec.act_order else ())


class Stage:
    """One slice's arrays, laid out one after another (each aligned to :data:`ALIGN`) in one byte buffer.

    ``buffer`` is anything numpy can view as bytes (a bytearray, a shared ``mmap``). :meth:`array` places the
    next array; :attr:`placed` records ``name -> (offset, numpy dtype string, shape)`` for whoever reads the
    buffer elsewhere (the process that uploads it to a GPU).
    """

    def __init__(self, buffer) -> None:
        self.bytes = np.frombuffer(buffer, dtype=np.uint8)
        self.used = 0
        self.placed: dict[str, tuple[int, str, tuple[int, ...]]] = {}

    def reset(self) -> None:
        self.used = 0
        self.placed = {}

    def array(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        offset = -(-self.used // ALIGN) * ALIGN
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + nbytes > self.bytes.size:
            raise ValueError(f"stage of {self.bytes.size} bytes cannot hold '{name}' ({nbytes} bytes at {offset})")
        self.used = offset + nbytes
        self.placed[name] = (offset, dtype.str, tuple(shape))
        return self.bytes[offset:offset + nbytes].view(dtype).reshape(shape)

    def view(self, name: str) -> np.ndarray:
        offset, dtype, shape = self.placed[name]
        dtype = np.dtype(dtype)
        return self.bytes[offset:offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)


def stage_bytes(layer: MarlinLayer) -> int:
    """Bytes a :class:`Stage` needs for one slice of ``layer`` (an upper bound: every array plus alignment)."""
    spec, k_pad, n_pad = layer.spec, layer.padded_in_features, layer.padded_out_features
    words = k_pad * n_pad // spec.pack_factor
    scale_bytes = SCALE_DTYPES[spec.scale_dtype][1].itemsize * spec.num_groups * n_pad
    padded = (k_pad, n_pad) != (spec.in_features, spec.out_features)
    copies = 2 + padded + spec.act_order  # B, qweight, and qweight_padded, qweight_tile_order where needed
    total = (copies * words * 4
             + 2 * scale_bytes  # s, scales
             + 2 * spec.num_groups * (n_pad // spec.pack_factor + 1) * 4  # zp, qzeros
             + 3 * k_pad * 4)  # perm, sorted g_idx, g_idx
    if spec.source_format == compressed_tensors.QUANT_METHOD:  # the stored tensors too, transposed
        total += words * 4 + scale_bytes + spec.num_groups * (n_pad // spec.pack_factor + 1) * 4 + k_pad * 4 + 16
    return total + 17 * ALIGN


class TensorReader:
    """Positioned reads of tensors (or one expert slice of them) straight into a caller's array.

    ``headers`` maps shard file name -> parsed header. File descriptors are opened per process, on first use.
    """

    def __init__(self, directory, headers: dict) -> None:
        self.directory = directory
        self.headers = headers
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()

    def info(self, shard: str, name: str) -> TensorInfo:
        return self.headers[shard].tensors[name]

    def read_into(self, shard: str, name: str, index: int | None, out: np.ndarray) -> np.ndarray:
        if os.getpid() != self._pid:  # forked: the parent's descriptors share a file offset; open our own
            self._fds, self._pid = {}, os.getpid()
        info = self.info(shard, name)
        begin, nbytes = info.begin, info.nbytes
        if index is not None:
            nbytes //= info.shape[0]
            begin += index * nbytes
        target = memoryview(out.reshape(-1).view(np.uint8))
        if target.nbytes != nbytes:
            raise ManifestError(f"{shard}: tensor '{name}' holds {nbytes} bytes per slice, expected {target.nbytes}")
        fd = self._fds.get(shard)
        if fd is None:
            try:  # (the audit saw a regular file inside OUT_DIR; this checks the file actually opened)
                fd = self._fds[shard] = open_inside(self.headers[shard].path)
            except OSError as exc:
                raise ManifestError(f"{shard}: cannot read: {exc.strerror or exc}") from exc
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [target[done:]], begin + done)
            if got == 0:
                raise ManifestError(f"{shard}: truncated while reading tensor '{name}'")
            done += got
        return out


#: C inverses of the repack (marlin_convert/_repack.c), by bits
_C_INVERSE = {4: "marlin_to_gptq", 8: "marlin8_to_gptq"}


def _c_function(name: str):
    """The C fast-path function ``name`` when it is built and not switched off (MARLIN_CONVERT_PURE_NUMPY=1)."""
    return getattr(layout._repack, name, None) if layout.fast_repack_available() else None


def inverse_weight(b: np.ndarray, out: np.ndarray, bits: int) -> None:
    """Marlin tiles int32 [K/16, N*b/2] -> GPTQ words int32 [K/p, N] into ``out``, rows in tile order (act-order
    not undone). The C fast path when built, else :func:`marlin_convert.layout.marlin_to_gptq_weight`."""
    fast = _c_function(_C_INVERSE[bits])
    if fast is not None:
        fast(b, out, b.shape[0] * layout.TILE, out.shape[1])
    else:
        out[...] = layout.marlin_to_gptq_weight(b, None, bits=bits)


def unsort_rows(sorted_words: np.ndarray, perm: np.ndarray, out: np.ndarray, bits: int) -> None:
    """GPTQ words int32 [K/p, N] whose row i is original row ``perm[i]`` -> original row order, into ``out``.
    ``perm`` int32 [K] must be a permutation (the C path checks and raises ValueError)."""
    fast = _c_function("scatter_rows")
    if fast is not None:
        fast(sorted_words, out, perm, perm.shape[0], out.shape[1], bits)
    else:
        codes = layout.unpack_gptq_qweight(sorted_words, bits=bits)
        original = np.empty_like(codes)
        original[perm] = codes
        out[...] = layout.pack_gptq_qweight(original, bits=bits)


def check_act_order_tables(perm: np.ndarray, sorted_g_idx: np.ndarray, num_groups: int) -> list[str]:
    """Problems with a slice's act-order tables, before anything indexes with them: ``perm`` int32 [K_pad] must be a
    permutation of 0..K_pad-1, ``sorted_g_idx`` int32 [K_pad] non-decreasing with values in 0..G-1."""
    k = perm.shape[0]
    problems = []
    in_range = (perm >= 0) & (perm < k)
    if not in_range.all():
        problems.append(f"perm has {int((~in_range).sum())} value(s) outside 0..{k - 1}")
    elif np.bincount(perm, minlength=k).max(initial=0) > 1:
        problems.append(f"perm is not a permutation of 0..{k - 1} (repeated rows)")
    if k and (sorted_g_idx.min() < 0 or sorted_g_idx.max() >= num_groups):
        problems.append(f"g_idx has values outside 0..{num_groups - 1}")
    elif k > 1 and (np.diff(sorted_g_idx) < 0).any():
        problems.append("g_idx is not sorted (Marlin stores it non-decreasing)")
    return problems


@dataclass
class SliceRebuild:
    """What :func:`rebuild_slice` left in the stage: ``complete`` when every source tensor was rebuilt (False when
    a table that indexes memory was corrupt: then only the raw Marlin tensors are in the stage)."""

    complete: bool
    problems: list[str]


def rebuild_slice(layer: MarlinLayer, source: dict, expert: int | None, reader: TensorReader,
                  stage: Stage) -> SliceRebuild:
    """Read one slice's Marlin tensors into ``stage`` and rebuild the source GPTQ tensors there.

    Stage arrays afterwards (the first five feed the kernel, the next four are the GPTQ tensors):
    ``B``, ``s``, ``zp`` (asymmetric), ``perm`` and ``sorted_g_idx`` (act-order); ``qweight`` int32 [K/p, N],
    ``scales`` [G, N] (stored dtype bits), ``qzeros`` int32 [G, ceil(N/p)], ``g_idx`` int32 [K]. For a
    compressed-tensors source, also its stored tensors, by their kind (``weight_packed``, ``weight_scale``, ...;
    :func:`marlin_convert.compressed_tensors.stored_from_gptq`), after the arrays that travel to a GPU.
    ``source`` is the manifest's record of the source layer (its tensors, zero format and stored zero value).
    """
    spec = layer.spec
    bits, p, groups = spec.bits, spec.pack_factor, spec.num_groups
    k, n = spec.in_features, spec.out_features
    k_pad, n_pad = layer.padded_in_features, layer.padded_out_features
    scale_dtype = SCALE_DTYPES[spec.scale_dtype][1]
    stage.reset()

    def read(kind: str, name: str, dtype) -> np.ndarray:
        shard, tensor = layer.tensors[kind]
        return reader.read_into(shard, tensor, expert, stage.array(name, layer.shape(kind), dtype))

    b = read("B", "B", np.int32)
    s = read("s", "s", scale_dtype)
    zp = read("zp", "zp", np.int32) if not spec.sym else None
    problems: list[str] = []
    perm = sorted_g_idx = None
    if spec.act_order:
        perm = read("perm", "perm", np.int32)
        sorted_g_idx = read("g_idx", "sorted_g_idx", np.int32)
        problems = check_act_order_tables(perm, sorted_g_idx, groups)
        if problems:
            return SliceRebuild(False, problems)

    padded = (k_pad, n_pad) != (k, n)
    qweight = stage.array("qweight", (k // p, n), np.int32)
    scales = stage.array("scales", (groups, n), scale_dtype)
    qzeros = stage.array("qzeros", (groups, -(-n // p)), np.int32)
    g_idx = stage.array("g_idx", (k,), np.int32)
    # scratch after the arrays that travel, so an upload can stop at the end of g_idx
    full = qweight if not padded else stage.array("qweight_padded", (k_pad // p, n_pad), np.int32)
    if perm is not None:
        in_tile_order = stage.array("qweight_tile_order", (k_pad // p, n_pad), np.int32)
        inverse_weight(b, in_tile_order, bits)
        unsort_rows(in_tile_order, perm, full, bits)
        g_idx_padded = layout.restore_g_idx(perm, sorted_g_idx)
    else:
        inverse_weight(b, full, bits)
        # padded rows belong to the last group (channelwise: K_pad > K = g would give them group 1)
        g_idx_padded = np.minimum(layout.trivial_g_idx(k_pad, spec.effective_group_size), groups - 1)
    unpermuted = layout.unpermute_scales(s)
    zero_points = (layout.marlin_to_zero_points(zp, n_pad, bits) if zp is not None
                   else np.full((groups, n_pad), spec.bias, dtype=np.uint8))
    if padded:
        problems += _padding_problems(layer, full, unpermuted, zero_points, g_idx_padded)
        qweight[...] = full[:k // p, :n]
    scales[...] = unpermuted[:, :n]
    g_idx[...] = g_idx_padded[:k]
    if zp is None:
        stored = np.full((groups, n), source["zero_stored"], dtype=np.uint8)
    else:
        true_zero = zero_points[:, :n]
        if source["zero_format"] == "v1":
            if (true_zero == 0).any():
                problems.append("zero point 0 cannot be stored in GPTQ v1 (it stores z - 1)")
            stored = (true_zero - 1).astype(np.uint8) & np.uint8((1 << bits) - 1)
        else:
            stored = true_zero
    qzeros[...] = layout.pack_gptq_qzeros(stored, bits=bits)
    if spec.source_format == compressed_tensors.QUANT_METHOD:
        for kind in source["tensors"]:
            array = compressed_tensors.stored_from_gptq(kind, stage.view, spec)
            np.copyto(stage.array(kind, array.shape, array.dtype), array)
    return SliceRebuild(True, problems)


def _padding_problems(layer: MarlinLayer, full: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
                      g_idx: np.ndarray) -> list[str]:
    """The padding must hold what CONTRACT A says (so padded weights are exactly 0): padded rows in the last group
    with code = that group's zero point, padded columns with code = zero point = bias and scale 0."""
    spec = layer.spec
    k, n = spec.in_features, spec.out_features
    k_pad = layer.padded_in_features
    problems = []
    if (g_idx[k:] != spec.num_groups - 1).any():
        problems.append("padded rows are not in the last group")
    if k < k_pad:
        rows = layout.unpack_gptq_qweight(full[k // spec.pack_factor:], bits=spec.bits)[:, :n]
        if (rows != zero_points[-1, :n]).any():
            problems.append("padded rows do not hold the last group's zero point")
    if n < full.shape[1]:
        columns = layout.unpack_gptq_qweight(full[:, n:], bits=spec.bits)
        if (columns != spec.bias).any() or (zero_points[:, n:] != spec.bias).any():
            problems.append(f"padded columns do not hold the code and zero point {spec.bias}")
        if (scales[:, n:].view(scales.dtype) != 0).any():
            problems.append("padded columns' scales are not 0")
    return problems
