"""Test helper: read a converted directory back and decode each Marlin layer into the GPTQ tensors it came from.

Uses only the layout module's inverse functions and the manifest's per-layer record; strips the padding after
checking that every padded weight is exactly zero (code equal to its zero point, or scale 0 in padded columns).
"""

from __future__ import annotations

import numpy as np

from marlin_convert import layout
from marlin_convert.safetensors_io import read_header, read_tensor


def all_tensors(directory, pattern: str = "*.safetensors") -> dict[str, np.ndarray]:
    """name -> numpy array of raw values (bfloat16 as uint16) over every shard of a directory (``pattern``: which
    files; ``model*.safetensors`` leaves out a producer's reference file)."""
    out = {}
    for path in sorted(directory.glob(pattern)):
        header = read_header(path)
        out.update({name: read_tensor(header, name) for name in header.tensors})
    return out


def decode_layer(entry: dict, tensors: dict[str, np.ndarray], expert: int | None = None) -> dict[str, np.ndarray]:
    """Manifest ``layers`` entry + the output's tensors -> the GPTQ tensors of one layer (or one expert slice):
    ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` (the trivial one when the layer has no act-order), at the
    logical shape. Asserts the padding holds exactly-zero weights and the shapes match the manifest."""
    bits, k, n = entry["bits"], entry["in_features"], entry["out_features"]
    k_pad, n_pad, groups = entry["padded_in_features"], entry["padded_out_features"], entry["num_groups"]
    p, bias = 32 // bits, 1 << (bits - 1)

    def output(kind):
        array = tensors[entry["outputs"][kind]]
        assert list(array.shape) == entry["shapes"][kind]
        return array if expert is None else array[expert]

    b, s = output("B"), output("s")
    assert b.shape == (k_pad // 16, n_pad * bits // 2) and s.shape == (groups, n_pad)
    perm = output("perm") if entry["act_order"] else None
    codes = layout.unpack_gptq_qweight(layout.marlin_to_gptq_weight(b, perm, bits=bits), bits)
    scales = layout.unpermute_scales(s)
    if entry["sym"]:
        assert "zp" not in entry["outputs"]
        zeros = np.full((groups, n_pad), bias, dtype=np.uint8)
    else:
        zp = output("zp")
        assert zp.shape == (groups, n_pad // p)
        zeros = layout.marlin_to_zero_points(zp, n_pad, bits)
    if entry["act_order"]:
        g_idx = layout.restore_g_idx(perm, output("g_idx"))
        assert perm.shape == (k_pad,) and (perm[k:] == np.arange(k, k_pad)).all()  # padded rows sort last
    else:
        group = k if entry["group_size"] == -1 or entry["group_size"] >= k else entry["group_size"]
        g_idx = layout.pad_g_idx(layout.trivial_g_idx(k, group), k_pad, groups)
    # every padded weight is exactly zero: padded rows (last group) hold that group's zero point, padded
    # columns hold code 2^(b-1) with zero point 2^(b-1) and scale 0
    assert (g_idx[k:] == groups - 1).all()
    assert (codes[k:, :n] == zeros[groups - 1, :n]).all()
    assert (codes[:, n:] == bias).all() and (zeros[:, n:] == bias).all()
    assert (scales[:, n:].view(np.uint8) == 0).all()
    stored = zeros[:, :n] - np.uint8(entry["zero_format"] == "v1")
    return {
        "qweight": layout.pack_gptq_qweight(np.ascontiguousarray(codes[:k, :n]), bits),
        "qzeros": layout.pack_gptq_qzeros(np.ascontiguousarray(stored), bits),
        "scales": np.ascontiguousarray(scales[:, :n]),
        "g_idx": g_idx[:k],
    }


def assert_decodes_to_source(entry: dict, converted: dict, source: dict) -> None:
    """Every source of ``entry`` (one per expert slice) decodes to its source tensors byte for byte."""
    for source_entry in entry["sources"]:
        experts = [None] if source_entry["slices"] is None else list(range(*source_entry["slices"]))
        stacked_source = entry["num_experts"] and len(entry["sources"]) == 1
        for expert in experts:
            decoded = decode_layer(entry, converted, expert if entry["num_experts"] else None)
            for kind, name in source_entry["tensors"].items():
                original = source[name][expert] if stacked_source else source[name]
                assert decoded[kind].dtype.itemsize == original.dtype.itemsize, (name, kind)
                assert decoded[kind].tobytes() == np.ascontiguousarray(original).tobytes(), (name, kind, expert)


def dequantize(entry: dict, decoded: dict[str, np.ndarray]) -> np.ndarray:
    """float32 [K, N] W = (q - z) * s from one layer's decoded GPTQ tensors (:func:`decode_layer`), z the true zero
    point (v1 stores z - 1), bfloat16 scales widened exactly."""
    bits, n = entry["bits"], entry["out_features"]
    q = layout.unpack_gptq_qweight(decoded["qweight"], bits).astype(np.float32)
    z = layout.unpack_gptq_qzeros(decoded["qzeros"], n, bits).astype(np.float32) + (entry["zero_format"] == "v1")
    s = decoded["scales"]
    s = (s.astype(np.uint32) << 16).view(np.float32) if entry["scale_dtype"] == "bfloat16" else s.astype(np.float32)
    g = decoded["g_idx"]
    return (q - z[g]) * s[g]
