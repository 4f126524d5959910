"""Reading compressed-tensors ``pack-quantized`` checkpoints beyond the committed fixtures: synthetic checkpoints
(:mod:`ct_checkpoint`) for what llm-compressor's presets do not write (act-order ``weight_g_idx``, shapes that need
padding, 8-bit asymmetric, float32 scales, schemes mixed by config group), every refusal (activation
quantization, 2/3-bit, float weights, another compressed-tensors form) by layer and reason, kept with
``--skip-incompatible``, and malformed input named by file, tensor and reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ct_checkpoint import (Linear, assert_same_tensors, config_group, gptq_twin, pack, quantization_config, read_all,
                           scheme, write_compressed_tensors, write_tensors)
from decode_output import all_tensors

from marlin_convert.cli.app import main
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError, UnsupportedLayerError
from marlin_convert.manifest import MANIFEST_FILE, load_manifest
from marlin_convert.verify import verify

Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"


def _single(tmp_path: Path, linears: list[Linear], weights: dict, scale_dtype: str = "bfloat16") -> Path:
    config = quantization_config({"group_0": config_group(["Linear"], weights)})
    return write_compressed_tensors(tmp_path / "ct", linears, config, scale_dtype=scale_dtype)


def _assert_same_as_twin_and_verified(src: Path, tmp_path: Path) -> dict:
    """Convert ``src`` and its GPTQ twin; every output tensor equal; verify with the source passes. The manifest."""
    convert(src, tmp_path / "out", workers=1)
    convert(gptq_twin(src, tmp_path / "gptq"), tmp_path / "twin", workers=1)
    assert_same_tensors(tmp_path / "out", tmp_path / "twin")
    report = verify(tmp_path / "out", gpus=None, workers=1, source_dir=src)
    assert report.ok, (report.problems, [r.integrity_problems for r in report.failures])
    return load_manifest(tmp_path / "out")


@pytest.mark.parametrize("linear, weights, scale_dtype, expect", [
    (Linear(DOWN, 256, 128, group_size=64, g_idx="shuffled"), scheme(group_size=64, actorder="group"), "bfloat16",
     {"act_order": True, "padded_in_features": 256}),
    (Linear(DOWN, 256, 128, group_size=64, g_idx="trivial"), scheme(group_size=64, actorder="group"), "bfloat16",
     {"act_order": False}),
    (Linear(DOWN, 1000, 100, symmetric=False), scheme(symmetric=False), "bfloat16",
     {"padded_in_features": 1024, "padded_out_features": 128, "num_groups": 8, "sym": False}),
    (Linear(DOWN, 256, 192, bits=8, group_size=None, symmetric=False), scheme(8, None, False), "float16",
     {"bits": 8, "group_size": -1, "num_groups": 1, "sym": False}),
    (Linear(DOWN, 128, 256, group_size=32), scheme(group_size=32), "float32",
     {"num_groups": 4, "scale_dtype": "float32"}),
], ids=["actorder-group", "actorder-group-trivial", "padded-asym-n100", "int8-asym-channel", "g32-float32-scales"])
def test_kinds_the_presets_do_not_write_equal_their_gptq_twins(tmp_path, linear, weights, scale_dtype, expect):
    q_proj = Linear(Q, 128, 128, **{k: getattr(linear, k) for k in ("bits", "symmetric", "g_idx")},
                    group_size=linear.group_size and min(linear.group_size, 128))
    src = _single(tmp_path, [q_proj, linear], weights, scale_dtype)
    manifest = _assert_same_as_twin_and_verified(src, tmp_path)
    entry = next(e for e in manifest["layers"] if e["name"] == DOWN)
    assert {key: entry[key] for key in expect} == expect
    (source,) = entry["sources"]
    assert ("weight_g_idx" in source["tensors"]) is bool(linear.g_idx)
    assert source["g_idx"] == {"shuffled": "act_order", "trivial": "trivial", None: "absent"}[linear.g_idx]


def _two_groups(tmp_path: Path, down: Linear, down_group: dict, **config_extra) -> Path:
    """q_proj W4A16 g128 (targets Linear); down_proj stored as ``down`` and configured by ``down_group``."""
    config = quantization_config({"group_0": config_group(["Linear"], scheme()),
                                  "group_1": down_group}, **config_extra)
    return write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128), down], config)


REFUSALS = {
    "activations": (Linear(DOWN, 256, 128), config_group(["re:.*down_proj$"], scheme(), input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
        "activation quantization (input_activations 8-bit int token dynamic)"),
    "2-bit": (Linear(DOWN, 256, 128, bits=2), config_group(["re:.*down_proj$"], scheme(2)), "2-bit weights"),
    "3-bit": (Linear(DOWN, 256, 128, bits=3), config_group(["re:.*down_proj$"], scheme(3)), "3-bit weights"),
    "float": (Linear(DOWN, 256, 128, bits=8), config_group(["re:.*down_proj$"], scheme(8, type="float")),
              "float weights (8-bit float)"),
    "tensor-strategy": (Linear(DOWN, 256, 128, group_size=None),
                        config_group(["re:.*down_proj$"], scheme(4, None, strategy="tensor")), 'strategy "tensor"'),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_marlin_cannot_take_is_refused_by_layer_and_reason_or_kept(tmp_path, case, capsys):
    down, group, reason = REFUSALS[case]
    src = _two_groups(tmp_path, down, group)
    with pytest.raises(UnsupportedLayerError, match=r"1 of 2 quantized layers") as caught:
        build_plan(src)
    assert f"{DOWN}: {reason}" in caught.value.message and "--skip-incompatible" in caught.value.hint
    assert main([str(src), str(tmp_path / "refused"), "-q"]) == 2 and not (tmp_path / "refused").exists()
    assert f"{DOWN}: {reason}" in capsys.readouterr().err

    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--skip-incompatible"]) == 0
    assert "1 kept in compressed-tensors form" in capsys.readouterr().out
    manifest = load_manifest(out)
    assert manifest["checkpoint_format"] == "marlin-partial" and [e["name"] for e in manifest["layers"]] == [Q]
    (kept,) = manifest["kept"]
    assert kept["name"] == DOWN and reason in kept["reason"]
    assert set(kept["tensors"]) == {"weight_packed", "weight_scale", "weight_shape"}
    source, written = read_all(src / "model.safetensors"), all_tensors(out)
    for name in kept["tensors"].values():
        assert written[name].tobytes() == source[name][1].tobytes()
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((out / name).read_text())
        section = data.get("quantization_config", data)
        assert (section["checkpoint_format"], section["is_marlin_format"]) == ("marlin-partial", False)
        assert section["modules_in_compressed_tensors_form"] == [DOWN] and "modules_in_gptq_form" not in section
    assert main(["verify", str(out), "--skip-kernel", "--source", str(src)]) == 0
    assert f"kept in compressed-tensors form: {DOWN}" in capsys.readouterr().out
    assert main(["verify", str(out), "--skip-kernel", "-q", "--source", str(src)]) == 0
    assert f"kept in compressed-tensors form: {DOWN}" not in capsys.readouterr().out  # -q: failures, the summary


def test_the_read_as_note_counts_layers_only_where_some_can_be_converted(tmp_path, capsys):
    """A checkpoint whose every layer is 3-bit: inspect lists the refused layers and says nothing of "0 layer(s) read
    as GPTQ v2"; with one 4-bit layer beside them the note counts it alone."""
    config = quantization_config({"group_0": config_group(["Linear"], scheme(3))})
    src = write_compressed_tensors(tmp_path / "ct3", [Linear(Q, 128, 128, bits=3)], config)
    assert main(["inspect", str(src)]) == 0
    text = capsys.readouterr().out
    assert f"{Q}" in text and "read as GPTQ v2" not in text, text
    src = _two_groups(tmp_path, *REFUSALS["3-bit"][:2])
    assert main(["inspect", str(src)]) == 0
    assert "1 layer(s) read as GPTQ v2" in capsys.readouterr().out


def test_a_layer_in_another_compressed_tensors_form_is_refused_or_kept(tmp_path, capsys):
    """mixed-precision: down_proj's group is int-quantized (an int8 ``weight`` and ``weight_scale``, no
    weight_packed): found by its weight_scale, refused, kept whole with --skip-incompatible."""
    rng = np.random.default_rng(1)
    group = config_group(["re:.*down_proj$"], scheme(8, None), format="int-quantized")
    config = quantization_config({"group_0": config_group(["Linear"], scheme()), "group_1": group},
                                 format="mixed-precision")
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128)], config)
    tensors = read_all(src / "model.safetensors")
    tensors[f"{DOWN}.weight"] = ("I8", rng.integers(-128, 128, size=(128, 256)).astype(np.int8))
    tensors[f"{DOWN}.weight_scale"] = ("BF16", np.full((128, 1), 0x3C00, np.uint16))
    write_tensors(src / "model.safetensors", tensors)
    with pytest.raises(UnsupportedLayerError, match=f'{DOWN}: compressed-tensors format "int-quantized": only '
                                                    "pack-quantized layers are read"):
        build_plan(src)
    convert(src, tmp_path / "out", workers=1, skip_incompatible=True)
    (kept,) = load_manifest(tmp_path / "out")["kept"]
    assert set(kept["tensors"]) == {"weight", "weight_scale"}
    assert main(["verify", str(tmp_path / "out"), "--skip-kernel", "-q"]) == 0


def test_an_nvfp4_group_beside_w4a16_is_refused_by_its_group_or_kept(tmp_path, capsys):
    """mixed-precision with an nvfp4-pack-quantized group (compressed-tensors stores weight_packed as uint8 [N, K/2],
    fp8 weight_scale [N, K/16] and a weight_global_scale, and no weight_shape): the layer is refused for its group's
    format, not for the missing weight_shape, so --skip-incompatible keeps it; inspect describes it as stored."""
    rng = np.random.default_rng(2)
    group = config_group(["re:.*down_proj$"], scheme(4, 16, type="float", strategy="tensor_group"),
                         format="nvfp4-pack-quantized")
    config = quantization_config({"group_0": config_group(["Linear"], scheme()), "group_1": group},
                                 format="mixed-precision")
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128)], config)
    tensors = read_all(src / "model.safetensors")
    tensors[f"{DOWN}.weight_packed"] = ("U8", rng.integers(0, 256, size=(128, 128)).astype(np.uint8))
    tensors[f"{DOWN}.weight_scale"] = ("F8_E4M3", rng.integers(0, 120, size=(128, 16)).astype(np.uint8))
    tensors[f"{DOWN}.weight_global_scale"] = ("F32", np.ones(1, np.float32))
    write_tensors(src / "model.safetensors", tensors)
    with pytest.raises(UnsupportedLayerError, match=f'{DOWN}: compressed-tensors format "nvfp4-pack-quantized"'):
        build_plan(src)
    assert main(["inspect", str(src), "--json", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    (down,) = [layer for layer in json.loads((tmp_path / "plan.json").read_text())["layers"] if layer["name"] == DOWN]
    assert (down["in_features"], down["out_features"], down["scale_dtype"], down["convert"]) == (
        256, 128, "float8_e4m3fn", False)
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--skip-incompatible"]) == 0
    (kept,) = load_manifest(out)["kept"]
    assert set(kept["tensors"]) == {"weight_packed", "weight_scale"}
    assert main(["verify", str(out), "--skip-kernel", "-q", "--source", str(src)]) == 0
    capsys.readouterr()


def test_the_most_specific_target_wins_and_the_config_states_each_layers_settings(tmp_path, capsys):
    """Exact name beats ``re:`` beats class name; the output's GPTQ-style config takes the settings most layers
    share and states the others in GPTQModel-style ``dynamic`` rules."""
    config = quantization_config({
        "group_0": config_group(["Linear"], scheme()),
        "group_1": config_group(["re:.*mlp.*"], scheme(8, None)),
        "group_2": config_group([DOWN], scheme(4, 64, False)),
    })
    linears = [Linear(Q, 128, 128), Linear("model.layers.0.self_attn.k_proj", 128, 64),
               Linear("model.layers.0.mlp.up_proj", 128, 256, bits=8, group_size=None),
               Linear(DOWN, 256, 128, group_size=64, symmetric=False)]
    src = write_compressed_tensors(tmp_path / "ct", linears, config)
    layers = {layer.prefix: layer for layer in build_plan(src).layers}
    assert [(layers[lin.name].spec.bits, layers[lin.name].spec.group_size, layers[lin.name].spec.sym,
             layers[lin.name].settings.group) for lin in linears] == [
        (4, 128, True, "group_0"), (4, 128, True, "group_0"), (8, -1, True, "group_1"), (4, 64, False, "group_2")]
    convert(src, tmp_path / "out", workers=1)
    written = json.loads((tmp_path / "out" / "quantize_config.json").read_text())
    assert {key: written[key] for key in ("bits", "group_size", "sym", "desc_act", "lm_head")} == \
        {"bits": 4, "group_size": 128, "sym": True, "desc_act": False, "lm_head": False}
    assert written["dynamic"] == {r"+:^model\.layers\.0\.mlp\.up_proj$": {"bits": 8, "group_size": -1},
                                  r"+:^model\.layers\.0\.mlp\.down_proj$": {"group_size": 64, "sym": False}}
    assert verify(tmp_path / "out", gpus=None, workers=1, source_dir=src).ok
    # the output says Marlin: converting it again is refused as such
    assert main([str(tmp_path / "out"), str(tmp_path / "again"), "-q"]) == 2
    assert "already in Marlin format" in capsys.readouterr().err


K_PROJ = "model.layers.0.self_attn.k_proj"
EXPERT_W1 = "model.layers.0.block_sparse_moe.experts.0.w1"


@pytest.mark.parametrize("targets, ignore, plain, rules", [
    # the third attacker round: an ignored linear
    (["Linear"], ["lm_head", DOWN, "re:.*self_attn.k_proj$"], [DOWN, K_PROJ],
     {r"-:^model\.layers\.0\.mlp\.down_proj$": {}, r"-:^model\.layers\.0\.self_attn\.k_proj$": {}}),
    # an attack helper (twenty-fourth session): a plain linear no config group targets, not in ignore
    (["re:.*self_attn\\..*"], ["lm_head"], [DOWN], {r"-:^model\.layers\.0\.mlp\.down_proj$": {}}),
    # one deeper in the same numbered block (an expert) too; an embedding, in no block, needs no rule
    (["re:.*self_attn\\..*"], ["lm_head"], [EXPERT_W1, "model.embed_tokens"],
     {r"-:^model\.layers\.0\.block_sparse_moe\.experts\.0\.w1$": {}}),
])
def test_a_linear_the_config_leaves_unquantized_gets_a_not_quantized_rule(tmp_path, targets, ignore, plain, rules):
    """The output's GPTQ-style configs must say that a linear the source's config leaves unquantized (ignored, or
    targeted by no config group) is not quantized (GPTQModel's '-:' rule): without it a loader reading them expects
    the module's B and s."""
    config = quantization_config({"group_0": config_group(targets, scheme())}, ignore=ignore)
    rng = np.random.default_rng(5)
    shapes = {DOWN: (128, 256), K_PROJ: (64, 128), EXPERT_W1: (256, 128), "model.embed_tokens": (64, 128),
              "lm_head": (64, 128)}
    extras = {f"{module}.weight": ("F16", rng.normal(size=shapes[module]).astype(np.float16))
              for module in [*plain, "lm_head"]}
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128)], config, extras=extras)
    convert(src, tmp_path / "out", workers=1)
    for name in ("config.json", "quantize_config.json"):
        written = json.loads((tmp_path / "out" / name).read_text())
        written = written.get("quantization_config", written)
        assert written["dynamic"] == rules, name
        assert written["lm_head"] is False
    assert verify(tmp_path / "out", gpus=None, workers=1, source_dir=src).ok


def _drop(name: str):
    def change(tensors):
        del tensors[name]
    return change


def _replace(name: str, dtype: str, array: np.ndarray):
    def change(tensors):
        tensors[name] = (dtype, array)
    return change


MALFORMED = {
    "ignored-but-stored": ({"ignore": [DOWN]}, None, f'ignore entry "{DOWN}"'),
    "ignored-by-regex": ({"ignore": ["lm_head", "re:.*down_proj$"]}, None, 'ignore entry "re:.*down_proj$"'),
    "no-group-targets-it": ({"targets": ["re:.*q_proj$"]}, None, "no config group"),
    "weight-shape-missing": ({}, _drop(f"{DOWN}.weight_shape"), f"tensor '{DOWN}.weight_shape' is missing"),
    "weight-shape-wrong": ({}, _replace(f"{DOWN}.weight_shape", "I64", np.array([128, 512])),
                           f"'{DOWN}.weight_packed' has shape [128, 32], expected [128, 64]"),
    "scales-of-another-group-size": ({"weights": scheme(group_size=64)}, None,
                                     f"'{DOWN}.weight_scale' has shape [128, 2], expected [128, 4]"),
    "zero-point-but-symmetric": ({"stored": Linear(DOWN, 256, 128, symmetric=False)}, None,
                                "is symmetric, but"),
    "asymmetric-without-zero-point": ({"weights": scheme(symmetric=False)}, None,
                                      f"tensor '{DOWN}.weight_zero_point' is missing (config group 'group_0' is "
                                      "asymmetric (symmetric: false), so each layer needs its zero points"),
    "actorder-group-without-g-idx": ({"weights": scheme(actorder="group")}, None,
                                     "actorder \"group\", but"),
    "ill-typed-symmetric": ({"weights": scheme(symmetric="false")}, None,
                            "'symmetric' must be a JSON boolean"),
    "another-format": ({"format": "float-quantized"}, None, 'compressed-tensors format "float-quantized"'),
    "sparse": ({"sparsity_config": {"format": "sparse-24-bitmask"}}, None, "sparse checkpoints are not read"),
    "not-compressed": ({"quantization_status": "frozen"}, None, "quantization_status is \"frozen\""),
    "transformed": ({"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}, None,
                    "transform_config is set"),
    "ambiguous-class-targets": ({"second": config_group(["Linear"], scheme(8))}, None,
                                "cannot tell which applies"),
    "stacked-3d": ({}, _replace(f"{DOWN}.weight_packed", "I32", np.zeros((2, 128, 32), np.int32)),
                   "one 2-D tensor each"),
    "bad-regex": ({"targets": ["re:(unclosed"]}, None, "not a valid regular expression"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_is_an_error_naming_what_and_where(tmp_path, case, capsys):
    settings, change, fragment = MALFORMED[case]
    group = config_group(settings.get("targets", ["Linear"]), settings.get("weights", scheme()))
    groups = {"group_0": group, **({"group_1": settings["second"]} if "second" in settings else {})}
    config = quantization_config(groups, **{key: settings[key] for key in
                                            ("ignore", "format", "sparsity_config", "quantization_status",
                                             "transform_config")
                                            if key in settings})
    src = write_compressed_tensors(tmp_path / "ct", [settings.get("stored", Linear(DOWN, 256, 128))], config)
    if change is not None:
        tensors = read_all(src / "model.safetensors")
        change(tensors)
        write_tensors(src / "model.safetensors", tensors)
    with pytest.raises(InputError) as caught:
        build_plan(src)
    assert fragment in caught.value.message
    assert main(["inspect", str(src)]) == 2 and fragment in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{"sparsity_config": {}, "transform_config": {}}, {"sparsity_config": None},
                                   {"sparsity_config": {"format": "dense"}}, {"transform_config": None}])
def test_an_empty_or_null_sparsity_or_transform_config_is_read_as_none(tmp_path, extra):
    # the README's rule: refused only where sparsity_config names a format other than dense, or transform_config is
    # an object with keys; llm-compressor writes {} for both
    config = quantization_config({"group_0": config_group(["Linear"], scheme())}, **extra)
    src = write_compressed_tensors(tmp_path / "ct", [Linear(DOWN, 256, 128)], config)
    assert [layer.convertible for layer in build_plan(src).layers] == [True]


def test_zero_points_with_data_in_the_unused_slots_are_refused(tmp_path):
    src = _single(tmp_path, [Linear(DOWN, 256, 100, symmetric=False)], scheme(symmetric=False))
    tensors = read_all(src / "model.safetensors")
    zeros = tensors[f"{DOWN}.weight_zero_point"][1].copy()
    zeros[-1] |= np.int32(0x3 << 28)  # N = 100: slots 4..7 of the last word along N are unused
    tensors[f"{DOWN}.weight_zero_point"] = ("I32", zeros)
    write_tensors(src / "model.safetensors", tensors)
    with pytest.raises(UnsupportedLayerError, match=r"weight_zero_point: the unused slots past N = 100 .* not 0"):
        build_plan(src)


def test_k_that_does_not_fill_whole_words_is_refused(tmp_path):
    src = _single(tmp_path, [Linear(DOWN, 100, 128, group_size=None)], scheme(group_size=None))
    assert read_all(src / "model.safetensors")[f"{DOWN}.weight_packed"][1].shape == (128, 13)
    with pytest.raises(UnsupportedLayerError, match="K = 100 is not a multiple of 8"):
        build_plan(src)


@pytest.fixture
def converted(tmp_path):
    src = _single(tmp_path, [Linear(DOWN, 256, 128, symmetric=False)], scheme(symmetric=False))
    convert(src, tmp_path / "out", workers=1)
    return src, tmp_path / "out"


def _edit(out: Path, change) -> None:
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    change(manifest)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_verify_checks_the_recorded_weight_shape(converted):
    src, out = converted
    _edit(out, lambda m: m["layers"][0]["sources"][0].update(weight_shape=[128, 512]))
    report = verify(out, gpus=None, workers=1)
    assert not report.ok and "weight_shape [128, 512] is not [N, K] = [128, 256]" in \
        report.failures[0].integrity_problems[0]


def test_verify_fails_when_a_source_digest_does_not_match(converted):
    src, out = converted
    _edit(out, lambda m: m["layers"][0]["sources"][0]["digests"].update(weight_zero_point="sha256:" + "0" * 64))
    report = verify(out, gpus=None, workers=1)
    assert [r.name for r in report.failures] == [DOWN]
    assert "rebuilt weight_zero_point" in report.failures[0].integrity_problems[0]


@pytest.mark.parametrize("change, field", [
    (lambda m: m["layers"][0]["sources"][0].pop("weight_shape"), "layers[0].sources[0].weight_shape"),
    (lambda m: m["layers"][0]["sources"][0]["tensors"].update(qweight="x"), "layers[0].sources[0].tensors"),
    (lambda m: m["source"].update(format="awq"), "source.format"),
    # quantization_defaults: the config as it states it, with the types the reader accepted (any value passed)
    (lambda m: m["quantization_defaults"].update(format=7), "'quantization_defaults.format': expected a string"),
    (lambda m: m["quantization_defaults"].update(format="float-quantized"), "quantization_defaults.format"),
    (lambda m: m["quantization_defaults"].update(config_groups={}), "'quantization_defaults.config_groups': empty"),
    (lambda m: m["quantization_defaults"].update(config_groups={"g": []}), "quantization_defaults.config_groups.g"),
    (lambda m: m["quantization_defaults"].update(ignore=[1]), "quantization_defaults.ignore[0]"),
    (lambda m: m["quantization_defaults"].pop("ignore"), "'quantization_defaults.ignore' is missing"),
])
def test_a_malformed_compressed_tensors_record_exits_2_naming_the_field(converted, capsys, change, field):
    _, out = converted
    _edit(out, change)
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 2
    assert field in capsys.readouterr().err


def test_the_configs_must_name_the_source_format(converted):
    _, out = converted
    config = json.loads((out / "quantize_config.json").read_text())
    del config["source_format"]
    (out / "quantize_config.json").write_text(json.dumps(config))
    report = verify(out, gpus=None, workers=1)
    assert any('quantize_config.json: source_format is null, the manifest\'s source is "compressed-tensors"' in p
               for p in report.problems)


def test_pack_matches_format_md_section_9():
    """The test's packer: element k of a row in word k*b/32 at bit (k*b) % 32, low bits first; 3-bit: 10 a word."""
    codes = np.arange(16).reshape(1, 16) % 16
    assert pack(codes, 4, axis=1).view(np.uint32).tolist() == [[0x76543210, 0xFEDCBA98]]
    assert pack(np.arange(1, 6).reshape(1, 5), 8, axis=1).view(np.uint32).tolist() == [[0x04030201, 0x00000005]]
    assert pack(np.ones((1, 10)), 3, axis=1).view(np.uint32).tolist() == [[int("001" * 10, 2)]]


def test_a_missing_expert_is_named_with_the_compressed_tensors_key(tmp_path):
    experts = [Linear(f"model.layers.0.mlp.experts.{e}.down_proj", 128, 128) for e in (0, 2)]
    src = _single(tmp_path, experts, scheme())
    with pytest.raises(InputError, match=r"expert\(s\) 1 of 0..2 missing for 'down_proj' "
                                         r"\(no model.layers.0.mlp.experts.<e>.down_proj.weight_packed\)"):
        build_plan(src)


@pytest.mark.parametrize("dtype", [{"x": 1}, ["bfloat16"], 16])
def test_a_model_dtype_that_is_not_a_string_is_refused_here_too(tmp_path, capsys, dtype):
    """config.json's dtype becomes the manifest's model_dtype: the compressed-tensors reader checks it like the GPTQ
    one (before the fix the conversion succeeded and its own verify refused the manifest)."""
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128)],
                                   quantization_config({"group_0": config_group(["Linear"], scheme())}))
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = dtype
    (src / "config.json").write_text(json.dumps(config))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    assert "'dtype' must be a JSON string" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_expert_beside_experts_in_another_form_is_named_not_an_internal_error(tmp_path, capsys):
    """Per-expert keys of a mixed-precision checkpoint whose experts are stored int-quantized (weight +
    weight_scale, no weight_packed), expert 1 missing: the error names the gap (it was KeyError: 'qweight')."""
    rng = np.random.default_rng(2)
    base = "model.layers.0.mlp.experts"
    group = config_group(["re:.*experts.*"], scheme(8, None), format="int-quantized")
    config = quantization_config({"group_0": config_group(["Linear"], scheme()), "group_1": group},
                                 format="mixed-precision")
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128)], config)
    tensors = read_all(src / "model.safetensors")
    for e in (0, 2):
        tensors[f"{base}.{e}.down_proj.weight"] = ("I8", rng.integers(-128, 128, size=(128, 64)).astype(np.int8))
        tensors[f"{base}.{e}.down_proj.weight_scale"] = ("BF16", np.full((128, 1), 0x3C00, np.uint16))
    write_tensors(src / "model.safetensors", tensors)
    assert main(["inspect", str(src)]) == 2
    err = capsys.readouterr().err
    assert f"layer '{base}': expert(s) 1 of 0..2 missing for 'down_proj' (no {base}.<e>.down_proj.weight)" in err
    assert "internal error" not in err


def test_a_broken_quantize_config_link_is_named_and_the_method_compares_in_any_case(tmp_path, capsys):
    """quantize_config.json beside a compressed-tensors config.json: a broken link is an error naming it (as for
    GPTQ); a quant_method that differs only in case is the same method."""
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128)],
                                   quantization_config({"group_0": config_group(["Linear"], scheme())}))
    (src / "quantize_config.json").symlink_to(tmp_path / "nowhere.json")
    assert main(["inspect", str(src)]) == 2
    assert "quantize_config.json: broken link" in capsys.readouterr().err
    (src / "quantize_config.json").unlink()
    (src / "quantize_config.json").write_text(json.dumps({"quant_method": "Compressed-Tensors"}))
    assert main(["inspect", str(src)]) == 0


def test_a_target_naming_a_module_that_is_not_stored_matches_nothing(tmp_path):
    """'lm_head' as a target of its own group with lm_head not stored (tied embeddings) was taken as a class name
    matching every layer, and the checkpoint refused for two schemes on each (the third attacker round)."""
    config = quantization_config({"group_0": config_group(["Linear"], scheme()),
                                  "group_1": config_group(["lm_head"], scheme(8, None))}, ignore=[])
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128), Linear(DOWN, 256, 128)], config,
                                   extras={})
    layers = {layer.prefix: layer for layer in build_plan(src).layers}
    assert {prefix: (layer.spec.bits, layer.settings.group) for prefix, layer in layers.items()} == \
        {Q: (4, "group_0"), DOWN: (4, "group_0")}


def test_a_class_target_that_is_not_a_linear_matches_no_linear(tmp_path):
    """A group targeting LlamaAttention (an attention scheme's target) collided with the Linear group on every layer
    (a review helper)."""
    config = quantization_config({"group_0": config_group(["Linear"], scheme()),
                                  "group_1": config_group(["LlamaAttention"], scheme(8, None))})
    src = write_compressed_tensors(tmp_path / "ct", [Linear(Q, 128, 128)], config)
    assert [(layer.spec.bits, layer.settings.group) for layer in build_plan(src).layers] == [(4, "group_0")]


def test_stacked_experts_whose_settings_are_not_the_most_common_get_rules_by_their_own_names(tmp_path):
    """Converted from compressed-tensors with --stack-experts: the configs' rules name each expert (what a loader
    resolves), not the stacked output, so verify's resolution agrees (it failed: 'experts.0.down_proj bits 8')."""
    experts = [Linear(f"model.layers.0.mlp.experts.{e}.down_proj", 256, 128) for e in range(2)]
    attention = [Linear(f"model.layers.0.self_attn.{p}_proj", 128, 128, bits=8, group_size=None)
                 for p in ("q", "k", "v", "o")]
    config = quantization_config({"group_0": config_group(["re:.*self_attn.*"], scheme(8, None)),
                                  "group_1": config_group(["re:.*experts.*"], scheme())})
    src = write_compressed_tensors(tmp_path / "ct", attention + experts, config)
    data = json.loads((src / "config.json").read_text())
    data["num_experts"] = 2
    (src / "config.json").write_text(json.dumps(data))
    convert(src, tmp_path / "out", workers=1, stack_experts=True)
    written = json.loads((tmp_path / "out" / "quantize_config.json").read_text())
    assert written["bits"] == 8 and written["dynamic"] == {
        rf"+:^model\.layers\.0\.mlp\.experts\.{e}\.down_proj$": {"bits": 4, "group_size": 128} for e in range(2)}
    assert verify(tmp_path / "out", gpus=None, workers=1, source_dir=src).ok


def test_an_early_compression_config_key_is_named_with_the_fix(tmp_path):
    """Early compressed-tensors releases (2024) saved the config as config.json's 'compression_config' (vLLM and SGLang
    still fall back to that key). It was refused as 'no quantization config: neither config.json with
    quantization_config nor quantize_config.json found', which says nothing of the key that is there. The error
    now names it and the rename that makes the checkpoint read."""
    src = _single(tmp_path, [Linear("model.layers.0.mlp.down_proj", 256, 128)], scheme())
    config = json.loads((src / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="under 'compression_config'") as caught:
        convert(src, tmp_path / "out", workers=1)
    assert "rename the key 'compression_config' to 'quantization_config'" in caught.value.hint
    config["quantization_config"] = config.pop("compression_config")
    (src / "config.json").write_text(json.dumps(config))
    _assert_same_as_twin_and_verified(src, tmp_path)
