"""The quantization config and the per-layer spec: GPTQModel ``dynamic`` rules, type checks, what each layer
resolves to, and what the converted configs say."""

from __future__ import annotations

import json

import numpy as np
import pytest
from edit_checkpoint import set_quant_config
from make_gptq_checkpoint import (
    CheckpointSpec,
    LinearSpec,
    TensorSpec,
    tiny_llama,
    with_quantized_lm_head,
    write_checkpoint,
)

from marlin_convert.cli.app import main
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError, UnsupportedLayerError
from marlin_convert.gptq import open_checkpoint
from marlin_convert.manifest import load_manifest
from marlin_convert.spec import QuantSpec

LAYER = "model.layers.0.mlp.down_proj"


def _specs(plan) -> dict:
    return {layer.prefix: layer for layer in plan.layers}


def _llama(tmp_path, overrides: dict[str, dict], dynamic: dict, **kw):
    """A one-layer tiny Llama whose projections named in ``overrides`` (by suffix) get those LinearSpec fields,
    with ``dynamic`` written to the config."""
    spec = tiny_llama(num_layers=1, group_size=64, dynamic=dynamic, **kw)
    for lin in spec.linears:
        for suffix, fields in overrides.items():
            if lin.name.endswith(suffix):
                for key, value in fields.items():
                    setattr(lin, key, value)
    return spec


# ----------------------------------------------------------------------------------------------- the spec


def test_spec_derives_groups_and_checks_its_fields():
    spec = QuantSpec.create(bits=4, group_size=128, sym=True, zero_format="v1", act_order=False, in_features=1024,
                            out_features=512, scale_dtype="float16")
    assert (spec.effective_group_size, spec.num_groups, spec.pack_factor, spec.bias) == (128, 8, 8, 8)
    channel = QuantSpec.create(bits=8, group_size=-1, sym=False, zero_format="v2", act_order=False, in_features=256,
                               out_features=64, scale_dtype="bfloat16", num_experts=4)
    assert (channel.channelwise, channel.effective_group_size, channel.num_groups, channel.bias) == (True, 256, 1, 128)
    wide = QuantSpec.create(bits=4, group_size=128, sym=True, zero_format="v1", act_order=False, in_features=64,
                            out_features=64, scale_dtype="float16")
    assert wide.channelwise and wide.num_groups == 1  # a group size of at least K is one group
    partial = QuantSpec.create(bits=4, group_size=128, sym=True, zero_format="v1", act_order=False,
                               in_features=1000, out_features=64, scale_dtype="float16")
    assert partial.num_groups == 8
    for bad in ({"bits": 4.0}, {"bits": True}, {"zero_format": "v3"}, {"sym": "false"}, {"scale_dtype": "F16"},
                {"group_size": 0}, {"source_format": "awq"}):
        args = dict(bits=4, group_size=128, sym=True, zero_format="v1", act_order=False, in_features=256,
                    out_features=64, scale_dtype="float16")
        args.update(bad)
        with pytest.raises(ValueError):
            QuantSpec.create(**args)


# ------------------------------------------------------------------------------------------ dynamic rules


def test_plus_rule_overrides_bits_and_bare_rule_overrides_group_size(tmp_path):
    spec = _llama(tmp_path, {"down_proj": {"bits": 8}, "up_proj": {"group_size": 32}},
                  {"+:.*down_proj": {"bits": 8}, ".*up_proj": {"group_size": 32}})
    plan = build_plan(write_checkpoint(tmp_path / "in", spec), skip_incompatible=True)
    layers = _specs(plan)
    down, up, gate = (layers[f"model.layers.0.mlp.{p}"] for p in ("down_proj", "up_proj", "gate_proj"))
    assert (down.spec.bits, down.spec.group_size, down.settings.rule.key) == (8, 64, "+:.*down_proj")
    assert (up.spec.bits, up.spec.group_size, up.spec.num_groups, up.settings.rule.key) == (4, 32, 4, ".*up_proj")
    assert up.convertible
    assert (gate.spec.bits, gate.spec.group_size, gate.settings.rule) == (4, 64, None)


def test_minus_rule_means_not_quantized_and_the_plain_weight_passes_through(tmp_path):
    spec = _llama(tmp_path, {}, {"-:.*o_proj": {}})
    o_proj = next(lin for lin in spec.linears if lin.name.endswith("o_proj"))
    spec.linears.remove(o_proj)
    spec.extras.append(TensorSpec(f"{o_proj.name}.weight", (128, 128), "float16"))
    src = write_checkpoint(tmp_path / "in", spec)
    plan = build_plan(src)
    assert all(not layer.prefix.endswith("o_proj") for layer in plan.layers) and len(plan.layers) == 6
    out = tmp_path / "out"
    convert(src, out)
    assert load_manifest(out)["checkpoint_format"] == "marlin"


def test_minus_rule_on_a_stored_quantized_layer_is_a_contradiction(tmp_path):
    src = write_checkpoint(tmp_path / "in", _llama(tmp_path, {}, {"-:.*o_proj": {}}))
    with pytest.raises(InputError, match=r"layer 'model.layers.0.self_attn.o_proj': dynamic rule \"-:\.\*o_proj\" "
                                         r"in .*quantize_config.json says this module is not quantized"):
        build_plan(src)


def test_an_lm_head_flag_the_stored_tensors_contradict_is_refused(tmp_path, capsys):
    """An attack helper: "lm_head": false with lm_head.qweight stored (and true with a plain lm_head.weight) converted;
    refused as the -: rule on a stored qweight is, naming the config file, the flag and the tensor."""
    quantized = write_checkpoint(tmp_path / "q", with_quantized_lm_head(tiny_llama(num_layers=1, vocab=256)))
    set_quant_config(quantized, lm_head=False)
    with pytest.raises(InputError, match=r"quantize_config.json: lm_head is false, but 'lm_head.qweight' is stored$"):
        build_plan(quantized)
    plain = write_checkpoint(tmp_path / "p", tiny_llama(num_layers=1, vocab=256))
    set_quant_config(plain, lm_head=True)
    assert main([str(plain), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "quantize_config.json: lm_head is true, but 'lm_head.weight' is stored unquantized" in err
    assert err.count("Error:") == 1


def test_an_lm_head_flag_that_agrees_or_is_absent_converts(tmp_path):
    quantized = write_checkpoint(tmp_path / "q", with_quantized_lm_head(tiny_llama(num_layers=1, vocab=256)))
    assert "lm_head" in _specs(build_plan(quantized))
    plain = write_checkpoint(tmp_path / "p", tiny_llama(num_layers=1, vocab=256))
    set_quant_config(plain, lm_head=False)
    assert "lm_head" not in _specs(build_plan(plain))


def test_first_matching_rule_wins_and_rules_match_at_the_start_of_the_name(tmp_path):
    spec = _llama(tmp_path, {"down_proj": {"group_size": 32}},
                  {"down_proj": {"group_size": 128},  # re.match: anchored at the start, so this matches nothing
                   r"model\.layers\.0\.mlp\.down": {"group_size": 32},  # matches (re.match needs no full match)
                   ".*down_proj": {"group_size": 128}})  # never reached: the rule above matched first
    layer = _specs(build_plan(write_checkpoint(tmp_path / "in", spec)))[LAYER]
    assert (layer.spec.group_size, layer.settings.rule.key) == (32, r"model\.layers\.0\.mlp\.down")


def test_quantized_lm_head_gets_its_own_bits_and_group_size(tmp_path):
    spec = with_quantized_lm_head(tiny_llama(num_layers=1, group_size=128, vocab=256))
    plan = build_plan(write_checkpoint(tmp_path / "in", spec), skip_incompatible=True)
    head = _specs(plan)["lm_head"]
    assert (head.spec.bits, head.spec.group_size, head.spec.num_groups) == (8, 32, 4)
    assert (head.spec.in_features, head.spec.out_features) == (128, 256)
    assert all(layer.convertible for layer in plan.layers) and len(plan.layers) == 8


def test_a_rule_the_stored_tensors_contradict_is_named(tmp_path):
    spec = _llama(tmp_path, {}, {"+:.*up_proj": {"group_size": 32}})  # the tensors keep group size 64
    src = write_checkpoint(tmp_path / "in", spec)
    with pytest.raises(InputError, match=r"up_proj.scales' has 2 rows: that is group size 64 for K = 128 "
                                         r"\(qweight's 16 rows at 4 bits\), but "
                                         r"dynamic rule \"\+:\.\*up_proj\" in .* says group size 32 \(4 rows\)"):
        build_plan(src, skip_incompatible=True)


def test_bits_the_stored_g_idx_contradicts_are_named(tmp_path):
    src = write_checkpoint(tmp_path / "in", _llama(tmp_path, {}, {"+:.*down_proj": {"bits": 8}}))
    with pytest.raises(InputError, match=r"down_proj.g_idx' has shape \[256\], expected \[128\]: .*K = 128 "
                                         r"\(dynamic rule .* says bits = 8\)"):
        build_plan(src, skip_incompatible=True)


# --------------------------------------------------------------------------------------- type confusion


@pytest.mark.parametrize("key, value, wanted, found", [
    ("desc_act", "false", "a JSON boolean", 'a string "false"'),
    ("sym", "false", "a JSON boolean", 'a string "false"'),
    ("sym", 0, "a JSON boolean", "an integer 0"),
    ("bits", 4.7, "a JSON integer", "a non-integer number 4.7"),
    ("bits", 4.0, "a JSON integer", "a float 4.0"),
    ("bits", "4", "a JSON integer", 'a string "4"'),
    ("bits", True, "a JSON integer", "a boolean true"),
    ("group_size", "128", "a JSON integer", 'a string "128"'),
    ("checkpoint_format", 2, "a JSON string", "an integer 2"),
    ("dynamic", ["lm_head"], "a JSON object", 'a list ["lm_head"]'),
])
def test_config_values_of_the_wrong_json_type_are_refused_naming_key_and_file(capsys, tmp_path, key, value,
                                                                               wanted, found):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, config_location="quantize_config"))
    quantize = json.loads((src / "quantize_config.json").read_text())
    quantize[key] = value
    (src / "quantize_config.json").write_text(json.dumps(quantize))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"quantize_config.json: '{key}' must be {wanted}" in err and found in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("rule, fragment", [
    ({"+:.*down_proj": {"bits": "8"}}, "dynamic rule \"+:.*down_proj\": 'bits' must be a JSON integer"),
    ({"+:.*down_proj": {"sym": "false"}}, "dynamic rule \"+:.*down_proj\": 'sym' must be a JSON boolean"),
    ({"+:.*down_proj": {"group_size": 32.5}}, "'group_size' must be a JSON integer"),
    ({"+:.*down_proj": {"bits": None}}, "'bits' must be a JSON integer, found null"),  # (not "null null")
    ({"+:.*down_proj": 8}, "dynamic rule \"+:.*down_proj\": 'value' must be a JSON object"),
    ({"+:.*down_proj": {"bits": 5}}, "'bits' is 5; GPTQ has 2, 3, 4, 8 bits"),
    ({"+:(unclosed": {"bits": 8}}, "dynamic rule \"+:(unclosed\": not a valid regular expression"),
])
def test_bad_dynamic_rules_are_refused_naming_the_rule_and_file(tmp_path, rule, fragment):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, dynamic=rule, config_location="config"))
    with pytest.raises(InputError) as caught:
        open_checkpoint(src)
    assert "config.json (quantization_config): " + fragment in caught.value.message or fragment in caught.value.message
    assert "config.json" in caught.value.message and "null null" not in caught.value.message


def test_format_keys_that_disagree_or_say_marlin_are_refused(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, checkpoint_format_label="gptq"))
    set_quant_config(src, format="gptq_v2")
    with pytest.raises(InputError, match=r"format keys disagree: checkpoint_format is \"gptq\", format is "
                                         r"\"gptq_v2\""):
        open_checkpoint(src)
    set_quant_config(src, format="marlin", checkpoint_format="marlin")
    with pytest.raises(InputError, match="already in Marlin format"):
        open_checkpoint(src)


def test_gptqmodel_format_key_alone_gives_the_zero_format(tmp_path):
    spec = tiny_llama(num_layers=1, zero_format="v2", quantization_extra={"format": "gptq_v2"}, sym=False)
    plan = build_plan(write_checkpoint(tmp_path / "in", spec), skip_incompatible=True)
    assert {layer.spec.zero_format for layer in plan.layers} == {"v2"}
    assert plan.checkpoint.config.checkpoint_format == "gptq_v2"


# ------------------------------------------------------------------------------------------ zero points


def test_explicit_sym_false_never_becomes_symmetric(tmp_path):
    """Issue #7.6: sym false, gptq_v2, qzeros all 7 means zero point 7 (not the symmetric 8 of v1)."""
    spec = tiny_llama(num_layers=1, sym=True, zero_format="v1", checkpoint_format_label="gptq_v2")
    src = write_checkpoint(tmp_path / "in", spec)
    set_quant_config(src, sym=False)
    for layer in build_plan(src, skip_incompatible=True).layers:
        assert (layer.spec.sym, layer.spec.zero_format, layer.zero_stored) == (False, "v2", None)


def test_sym_true_with_zero_points_that_vary_is_a_contradiction(tmp_path):
    spec = CheckpointSpec(linears=[LinearSpec(LAYER, 256, 128, sym=False)],
                          extras=[TensorSpec("model.norm.weight", (128,), "float16")], sym=True)
    src = write_checkpoint(tmp_path / "in", spec)
    with pytest.raises(UnsupportedLayerError, match=rf"{LAYER}: the config says sym: true, but qzeros hold 15 "
                                                    r"different values \(0..14\).*contradicts"):
        build_plan(src)


def test_sym_true_with_a_constant_non_symmetric_zero_is_a_contradiction(tmp_path):
    src = write_checkpoint(tmp_path / "in", CheckpointSpec(
        linears=[LinearSpec(LAYER, 256, 128)], extras=[TensorSpec("model.norm.weight", (128,), "float16")]))
    from make_gptq_checkpoint import _pack_along_last
    from safetensors.numpy import save_file

    from marlin_convert.safetensors_io import read_header, read_tensor

    path = src / "model.safetensors"
    tensors = {name: read_tensor(read_header(path), name) for name in read_header(path).tensors}
    tensors[f"{LAYER}.qzeros"] = _pack_along_last(np.full((2, 128), 5, dtype=np.uint8), 4)  # zero 5 everywhere
    save_file(tensors, str(path))
    with pytest.raises(UnsupportedLayerError, match=r"qzeros hold 5 everywhere, not the symmetric value 7 \(v1\) "
                                                    r"or 8 \(v2\)"):
        build_plan(src)


def test_sym_not_stated_lets_the_values_decide(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, zero_format="v2"))
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((src / name).read_text())
        (data.get("quantization_config", data)).pop("sym")
        (src / name).write_text(json.dumps(data))
    plan = build_plan(src)
    assert {(layer.spec.sym, layer.spec.zero_format) for layer in plan.layers} == {(True, "v2")}
    assert any("no 'sym' in the config for 7 layer(s)" in note for note in plan.notes)


# ---------------------------------------------------------------------------------------- output configs


def test_configs_are_written_back_as_read_with_every_format_key_agreeing(tmp_path):
    extra = {"format": "gptq", "meta": {"quantizer": ["gptqmodel:7.7"]}, "pack_dtype": "int32", "lm_head": False}
    spec = tiny_llama(num_layers=1, group_size=64, quantization_extra=extra, dynamic={".*up_proj": {"desc_act": False}})
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    convert(src, out)
    read = json.loads((src / "quantize_config.json").read_text())
    for written in (json.loads((out / "config.json").read_text())["quantization_config"],
                    json.loads((out / "quantize_config.json").read_text())):
        assert (written["checkpoint_format"], written["format"], written["is_marlin_format"]) == ("marlin", "marlin",
                                                                                                  True)
        assert {k: v for k, v in written.items() if k not in ("checkpoint_format", "format", "is_marlin_format")} \
            == {k: v for k, v in read.items() if k != "format"}
        assert "modules_in_gptq_form" not in written


def test_partly_converted_checkpoint_says_so_in_every_config_and_the_manifest(tmp_path):
    spec = _llama(tmp_path, {"down_proj": {"bits": 2}}, {"+:.*down_proj": {"bits": 2}},
                  quantization_extra={"format": "gptq"})
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    report = convert(src, out, skip_incompatible=True)
    assert [s["name"] for s in report.skipped] == [LAYER]
    for written in (json.loads((out / "config.json").read_text())["quantization_config"],
                    json.loads((out / "quantize_config.json").read_text())):
        assert (written["checkpoint_format"], written["format"]) == ("marlin-partial", "marlin-partial")
        assert written["is_marlin_format"] is False
        assert written["modules_in_gptq_form"] == [LAYER]
        assert written["dynamic"] == {"+:.*down_proj": {"bits": 2}}
    manifest = load_manifest(out)
    assert manifest["checkpoint_format"] == "marlin-partial"
    assert [k["name"] for k in manifest["kept"]] == [LAYER] and len(manifest["layers"]) == 6
    with pytest.raises(InputError, match="already in Marlin format"):
        open_checkpoint(out)


# ---------------------------------------------------------------------------------------------- inspect


def test_inspect_shows_each_layers_resolved_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    spec = with_quantized_lm_head(_llama(tmp_path, {"up_proj": {"group_size": 32}}, {".*up_proj": {"group_size": 32}},
                                         vocab=256))
    src = write_checkpoint(tmp_path / "in", spec)
    assert main(["inspect", str(src), "--json", str(tmp_path / "plan.json")]) == 0
    table = capsys.readouterr().out
    for column in ("bits", "group", "zeros", "act-order", "K x N", "padded to"):
        assert column in table
    assert any("lm_head" in line and "8" in line and "32" in line and "sym v1" in line for line in table.splitlines())
    layers = {layer["name"]: layer for layer in json.loads((tmp_path / "plan.json").read_text())["layers"]}
    up = layers["model.layers.0.mlp.up_proj"]
    assert (up["bits"], up["group_size"], up["num_groups"], up["sym"], up["zero_format"], up["act_order"]) == \
        (4, 32, 4, True, "v1", False)
    assert (up["in_features"], up["out_features"], up["padded_in_features"], up["padded_out_features"]) == \
        (128, 256, 128, 256)
    assert up["dynamic_rule"] == ".*up_proj" and up["zero_stored"] == 7
    head = layers["lm_head"]
    assert (head["bits"], head["group_size"], head["dynamic_rule"]) == (8, 32, "lm_head")


def test_a_g_idx_that_is_not_trivial_under_desc_act_false_is_converted_with_act_order_and_noted(tmp_path, capsys):
    """The stored g_idx decides (FORMAT.md: trivial or not), and the report says so: the configs keep
    desc_act false, which a loader going by desc_act alone would follow (the third attacker round)."""
    from make_gptq_checkpoint import tiny_llama, write_checkpoint

    from marlin_convert.cli.app import main

    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, act_order=True))
    set_quant_config(src, desc_act=False)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0
    assert "while the config says desc_act false: converted with act-order" in capsys.readouterr().out


def test_scales_of_another_group_size_with_no_group_size_stated_say_so(tmp_path):
    """An attack helper: with no group_size in the config the message ended "the config says group size -1"."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, group_size=64))
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((src / name).read_text())
        (data.get("quantization_config", data)).pop("group_size")
        (src / name).write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"group size 64 for K = \d+ .*but the config states no group_size \(so -1, "
                                         r"channelwise\) \(1 row\)"):
        build_plan(src)
