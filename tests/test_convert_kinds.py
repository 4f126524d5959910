"""Every kind of layer a real GPTQ checkpoint holds converts, and decodes back to its source bit for bit:
8-bit, asymmetric zero points (v1, v2), group sizes that do not divide K, shapes that do not tile (zero padding),
act-order, stacked and per-expert MoE, and several bit widths in one checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from decode_output import all_tensors, assert_decodes_to_source, decode_layer
from make_gptq_checkpoint import (
    CheckpointSpec,
    LinearSpec,
    TensorSpec,
    qwen3_moe,
    tiny_llama,
    with_quantized_lm_head,
    write_checkpoint,
)
from safetensors.numpy import save_file

from marlin_convert import layout
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError, UnsupportedLayerError
from marlin_convert.manifest import load_manifest
from marlin_convert.safetensors_io import read_header, read_tensor

LAYER = "model.layers.0.mlp.down_proj"


def _one_linear(k, n, **kw):
    return CheckpointSpec(linears=[LinearSpec(LAYER, k, n, bias=True)],
                          extras=[TensorSpec("model.norm.weight", (64,), "float16")], **kw)


def _convert_and_decode(tmp_path, spec, **convert_kw) -> dict:
    """Convert ``spec``, check every layer decodes to its source, return the manifest."""
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    convert(src, out, **convert_kw)
    manifest = load_manifest(out)
    source, converted = all_tensors(src), all_tensors(out)
    for entry in manifest["layers"]:
        assert_decodes_to_source(entry, converted, source)
    consumed = {name for entry in manifest["layers"] for src_entry in entry["sources"]
                for name in src_entry["tensors"].values()}
    for name, values in source.items():  # everything that is not a converted layer's tensor passes through
        if name not in consumed:
            assert converted[name].tobytes() == values.tobytes(), name
    return manifest


KINDS = [  # (bits, sym, zero_format, act_order, group_size, scale_dtype)
    (4, True, "v1", False, 128, "float16"),
    (8, True, "v1", False, 128, "float16"),
    (8, True, "v2", True, 32, "bfloat16"),
    (4, False, "v1", False, 64, "float16"),
    (4, False, "v2", True, 128, "bfloat16"),
    (8, False, "v1", True, 64, "float16"),
    (8, False, "v2", False, -1, "float32"),
]


@pytest.mark.parametrize("bits, sym, zero_format, act_order, group_size, scale_dtype", KINDS)
@pytest.mark.parametrize("k, n", [(256, 128), (1000, 1000), (320, 96)])
def test_every_kind_and_shape_converts_and_decodes_to_its_source(tmp_path, bits, sym, zero_format, act_order,
                                                                 group_size, scale_dtype, k, n):
    label = "gptq_v2" if zero_format == "v2" else "gptq"
    spec = _one_linear(k, n, bits=bits, sym=sym, zero_format=zero_format, act_order=act_order, group_size=group_size,
                       scale_dtype=scale_dtype, checkpoint_format_label=label)
    manifest = _convert_and_decode(tmp_path, spec)
    entry = manifest["layers"][0]
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    k_pad = -(-k // 16) * 16 if group_size == -1 else groups * g
    n_pad = -(-n // 64) * 64
    assert (entry["bits"], entry["sym"], entry["zero_format"], entry["act_order"]) == (bits, sym, zero_format,
                                                                                        act_order)
    assert (entry["in_features"], entry["out_features"], entry["num_groups"]) == (k, n, groups)
    assert (entry["padded_in_features"], entry["padded_out_features"]) == (k_pad, n_pad)
    expected = {"B": [k_pad // 16, n_pad * bits // 2], "s": [groups, n_pad]}
    if not sym:
        expected["zp"] = [groups, n_pad * bits // 32]
    if act_order:
        expected.update(perm=[k_pad], g_idx=[k_pad])
    assert entry["shapes"] == expected
    assert entry["workspace"]["ints"] == n_pad // 64 * 16
    assert entry["sources"][0]["zero_stored"] == ((1 << (bits - 1)) - (zero_format == "v1") if sym else None)


def test_padded_layer_computes_the_same_product(tmp_path):
    """A @ W equals (A zero-padded to K_pad) @ W_pad cut to N columns, with W dequantized from the Marlin tensors."""
    spec = _one_linear(1000, 1000, bits=4, sym=False, zero_format="v2", act_order=True, group_size=128,
                       checkpoint_format_label="gptq_v2", scale_dtype="float32")
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    convert(src, out)
    entry = load_manifest(out)["layers"][0]
    converted, source = all_tensors(out), all_tensors(src)
    b = converted[entry["outputs"]["B"]]
    perm = converted[entry["outputs"]["perm"]]
    codes = layout.unpack_gptq_qweight(layout.marlin_to_gptq_weight(b, perm, bits=4), 4).astype(np.float64)
    zeros = layout.marlin_to_zero_points(converted[entry["outputs"]["zp"]], 1024, 4).astype(np.float64)
    scales = layout.unpermute_scales(converted[entry["outputs"]["s"]]).astype(np.float64)
    g_idx = layout.restore_g_idx(perm, converted[entry["outputs"]["g_idx"]])
    w_pad = (codes - zeros[g_idx]) * scales[g_idx]
    q = layout.unpack_gptq_qweight(source[f"{LAYER}.qweight"], 4).astype(np.float64)
    z = layout.unpack_gptq_qzeros(source[f"{LAYER}.qzeros"], 1000, 4).astype(np.float64)
    g = source[f"{LAYER}.g_idx"]
    w = (q - z[g]) * source[f"{LAYER}.scales"].astype(np.float64)[g]
    a = np.random.default_rng(0).standard_normal((3, 1000))
    a_pad = np.zeros((3, 1024))
    a_pad[:, :1000] = a
    assert np.array_equal(w_pad[:1000, :1000], w) and not w_pad[1000:].any() and not w_pad[:, 1000:].any()
    assert np.allclose((a_pad @ w_pad)[:, :1000], a @ w, rtol=0, atol=1e-9)


def test_partial_last_group_g_idx_must_hold_the_remainder(tmp_path):
    src = write_checkpoint(tmp_path / "in", _one_linear(1000, 128, group_size=128, act_order=True))
    path = src / "model.safetensors"
    tensors = {name: read_tensor(read_header(path), name) for name in read_header(path).tensors}
    g_idx = tensors[f"{LAYER}.g_idx"].copy()
    g_idx[np.flatnonzero(g_idx == 6)[0]] = 7  # group 7 (the 104-row remainder) gets one row too many
    tensors[f"{LAYER}.g_idx"] = g_idx
    save_file(tensors, str(path))
    with pytest.raises(InputError, match=r"g_idx is unbalanced: group 6 has 127 rows, expected 128 "
                                         r"\(K = 1000, group size 128\)"):
        build_plan(src)


def test_v1_zero_point_that_would_be_2_to_the_bits_is_refused_naming_layer_and_value(tmp_path):
    src = write_checkpoint(tmp_path / "in", _one_linear(256, 128, sym=False, zero_format="v1", bits=8))
    path = src / "model.safetensors"
    tensors = {name: read_tensor(read_header(path), name) for name in read_header(path).tensors}
    qzeros = tensors[f"{LAYER}.qzeros"].copy()
    qzeros.view(np.uint8)[1, 5] = 255  # one stored zero of 255: zero point 256
    tensors[f"{LAYER}.qzeros"] = qzeros
    save_file(tensors, str(path))
    with pytest.raises(UnsupportedLayerError, match=rf"{LAYER}: asymmetric v1 zero points: stored value 255 means "
                                                    r"zero point 256, outside 0..255"):
        build_plan(src)
    # --skip-incompatible would keep it in GPTQ form, but with no other layer there is nothing to convert
    with pytest.raises(UnsupportedLayerError, match=rf"none of the 1 quantized layers can be converted: {LAYER}: "
                                                    r"asymmetric v1 zero points: stored value 255"):
        convert(src, tmp_path / "out", skip_incompatible=True)
    assert not (tmp_path / "out").exists()


def test_explicit_sym_false_with_symmetric_looking_zeros_converts_with_its_true_zero_points(tmp_path):
    """Issue #7.6: sym false + gptq_v2 + qzeros all 7 is zero point 7, kept as such in zp."""
    spec = _one_linear(256, 128, sym=True, zero_format="v1", checkpoint_format_label="gptq_v2")
    src = write_checkpoint(tmp_path / "in", spec)
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((src / name).read_text())
        data.get("quantization_config", data)["sym"] = False
        (src / name).write_text(json.dumps(data))
    out = tmp_path / "out"
    convert(src, out)
    entry = load_manifest(out)["layers"][0]
    assert (entry["sym"], entry["zero_format"], entry["sources"][0]["zero_stored"]) == (False, "v2", None)
    zeros = layout.marlin_to_zero_points(all_tensors(out)[entry["outputs"]["zp"]], 128, 4)
    assert (zeros == 7).all()
    assert_decodes_to_source(entry, all_tensors(out), all_tensors(src))


def test_mixed_bits_and_group_sizes_from_dynamic_rules_in_one_output(tmp_path):
    spec = tiny_llama(num_layers=2, hidden=128, intermediate=1000, vocab=300, group_size=128,
                      dynamic={r"+:model\.layers\.1\..*down_proj": {"bits": 8, "sym": False},
                               ".*up_proj": {"group_size": 32}})
    for lin in spec.linears:
        if lin.name == "model.layers.1.mlp.down_proj":
            lin.bits, lin.sym = 8, False
        if lin.name.endswith("up_proj"):
            lin.group_size = 32
    manifest = _convert_and_decode(tmp_path, with_quantized_lm_head(spec))
    layers = {entry["name"]: entry for entry in manifest["layers"]}
    assert len(layers) == 15 and manifest["kept"] == [] and manifest["checkpoint_format"] == "marlin"
    settings = {name: (e["bits"], e["group_size"], e["sym"]) for name, e in layers.items()}
    assert settings["model.layers.1.mlp.down_proj"] == (8, 128, False)
    assert settings["model.layers.0.mlp.down_proj"] == (4, 128, True)
    assert settings["model.layers.0.mlp.up_proj"] == (4, 32, True)
    assert settings["lm_head"] == (8, 32, True)
    assert (layers["lm_head"]["out_features"], layers["lm_head"]["padded_out_features"]) == (300, 320)
    assert layers["model.layers.0.mlp.down_proj"]["padded_in_features"] == 1024
    assert manifest["quantization_defaults"]["dynamic"]["lm_head"] == {"bits": 8, "group_size": 32}
    assert manifest["quantization_defaults"]["bits"] == 4


@pytest.mark.parametrize("stacked", [True, False])
def test_moe_experts_with_shapes_that_do_not_tile(tmp_path, stacked):
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=200, stacked=stacked,
                     group_size=64, act_order=True, bits=8, sym=False, zero_format="v2",
                     checkpoint_format_label="gptq_v2")
    manifest = _convert_and_decode(tmp_path, spec, stack_experts=not stacked)
    down = next(e for e in manifest["layers"] if e["name"] == "model.layers.0.mlp.experts.down_proj")
    assert (down["num_experts"], down["in_features"], down["padded_in_features"]) == (4, 200, 256)
    assert down["expert_stride_int32"] == 256 * 128 * 8 // 32
    assert down["shapes"]["zp"] == [4, 4, 128 // 4] and down["workspace"] == {"rule": "(N / 64) * 16", "ints": 32,
                                                                              "per_expert": True}
    gate_up = [e for e in manifest["layers"] if e["name"].endswith(("gate_up_proj", "gate_proj", "up_proj"))]
    shapes = {(e["out_features"], e["padded_out_features"]) for e in gate_up}
    assert shapes == ({(400, 448)} if stacked else {(200, 256)})  # stacked gate_up_proj has N = 2 * 200


def test_per_expert_keys_that_need_padding_decode_per_expert(tmp_path):
    spec = qwen3_moe(num_layers=1, num_experts=3, hidden=128, expert_intermediate=104, group_size=32)
    manifest = _convert_and_decode(tmp_path, spec)
    entry = next(e for e in manifest["layers"] if e["name"] == "model.layers.0.mlp.experts.1.down_proj")
    assert (entry["in_features"], entry["padded_in_features"], entry["num_groups"]) == (104, 128, 4)
    group = next(g for g in manifest["expert_groups"] if g["projection"] == "down_proj")
    assert group["workspace_ints_per_expert"] == 2 * 16


def test_qzeros_with_bits_set_past_n_are_refused_as_not_provably_lossless(tmp_path):
    src = write_checkpoint(tmp_path / "in", _one_linear(256, 100))  # 13 words per row, the last holds 4 of 8 slots
    path = src / "model.safetensors"
    tensors = {name: read_tensor(read_header(path), name) for name in read_header(path).tensors}
    qzeros = tensors[f"{LAYER}.qzeros"].copy()
    qzeros[0, 12] |= np.int32(0x7 << 28)  # slot 7 of the last word: column 103, past N = 100
    tensors[f"{LAYER}.qzeros"] = qzeros
    save_file(tensors, str(path))
    with pytest.raises(UnsupportedLayerError, match=r"unused slots past N = 100 .* not 0"):
        build_plan(src)


def test_bits_the_kernel_has_no_form_for_stay_in_gptq_form(tmp_path):
    spec = _one_linear(256, 128, bits=2)
    with pytest.raises(UnsupportedLayerError, match=rf"{LAYER}: 2-bit weights: Marlin has 4- and 8-bit forms only"):
        build_plan(write_checkpoint(tmp_path / "in", spec))


def test_decode_helper_notices_a_flipped_padding_code(tmp_path):
    """The padding checks of the decoder used above can fail: a non-zero weight in a padded row is caught."""
    src = write_checkpoint(tmp_path / "in", _one_linear(1000, 128, group_size=128))
    out = tmp_path / "out"
    convert(src, out)
    entry = load_manifest(out)["layers"][0]
    converted = all_tensors(out)
    b = converted[entry["outputs"]["B"]]
    q = layout.unpack_gptq_qweight(layout.marlin_to_gptq_weight(b, bits=4), 4)
    q[1010, 3] ^= 1
    converted[entry["outputs"]["B"]] = layout.gptq_to_marlin_weight(layout.pack_gptq_qweight(q, 4), bits=4)
    with pytest.raises(AssertionError):
        decode_layer(entry, converted)
