"""AutoRound's per-module overrides, ``extra_config`` (module name or regex -> bits, group_size, sym, ...), in a GPTQ
config: each module resolved once, as GPTQModel's ``dynamic`` rules are; what Marlin cannot serve refused by entry
and value; ``dynamic`` beside it held to the same settings; the output keeping it, and ``verify`` holding it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from edit_checkpoint import rerecord, set_quant_config
from make_gptq_checkpoint import TensorSpec, tiny_llama, write_checkpoint

from marlin_convert.cli.app import main
from marlin_convert.config_regex import compile_config_search, config_regex_match
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError
from marlin_convert.manifest import load_manifest
from marlin_convert.verify import verify

K_PROJ = "model.layers.0.self_attn.k_proj"
O_PROJ = "model.layers.1.self_attn.o_proj"
UP_PROJ = "model.layers.1.mlp.up_proj"
#: the keys AutoRound's GPTQ export states beside the GPTQ ones (auto_round/export/export_to_autogptq)
AUTOROUND_KEYS = {"provider": "auto-round", "data_type": "int", "damp_percent": 0.01, "true_sequential": False}
#: one module 8-bit by its name, one left unquantized (bits 16, as AutoRound writes it), one group size by a regex
MIXED = {K_PROJ: {"bits": 8}, O_PROJ: {"bits": 16, "data_type": "fp"},
         r".*layers\.1\.mlp\.up_proj.*": {"group_size": 32}}


def _checkpoint(path: Path, extra_config: dict | None = None, *, stored: dict | None = None, plain=(), **extra) -> Path:
    """A two-layer tiny Llama (group size 64) whose modules in ``stored`` are stored with those LinearSpec fields,
    those in ``plain`` as an unquantized ``.weight``, and whose configs state AutoRound's keys and ``extra_config``."""
    spec = tiny_llama(num_layers=2, group_size=64)
    for lin in list(spec.linears):
        for key, value in (stored or {}).get(lin.name, {}).items():
            setattr(lin, key, value)
        if lin.name in plain:
            spec.linears.remove(lin)
            spec.extras.append(TensorSpec(f"{lin.name}.weight", (lin.out_features, lin.in_features), "float16"))
    spec.quantization_extra = {**AUTOROUND_KEYS, **extra}
    if extra_config is not None:
        spec.quantization_extra["extra_config"] = extra_config
    return write_checkpoint(path, spec)


def _mixed(path: Path, extra_config: dict = MIXED, **extra) -> Path:
    return _checkpoint(path, extra_config, stored={K_PROJ: {"bits": 8}, UP_PROJ: {"group_size": 32}}, plain=(O_PROJ,),
                       **extra)


def _only_in_config_json(src: Path) -> None:
    """Drop ``extra_config`` from quantize_config.json (AutoRound's own format states it in config.json alone)."""
    quantize = json.loads((src / "quantize_config.json").read_text())
    del quantize["extra_config"]
    (src / "quantize_config.json").write_text(json.dumps(quantize))


def _layers(plan) -> dict:
    return {layer.prefix: layer for layer in plan.layers}


# ------------------------------------------------------------------------------------------------- converting


def test_each_module_takes_its_extra_config_entry_and_verify_source_passes(tmp_path, capsys):
    src = _mixed(tmp_path / "in")
    layers = _layers(build_plan(src))
    assert O_PROJ not in layers  # bits 16: not quantized, its plain weight passes through
    k, up, q = layers[K_PROJ], layers[UP_PROJ], layers["model.layers.0.self_attn.q_proj"]
    assert (k.spec.bits, k.spec.group_size, k.settings.rule.key) == (8, 64, K_PROJ)
    assert (up.spec.bits, up.spec.group_size, up.spec.num_groups) == (4, 32, 4)
    assert up.settings.origin.startswith(r'extra_config entry ".*layers\\.1\\.mlp\\.up_proj.*" in ')
    assert (q.spec.bits, q.spec.group_size, q.settings.rule) == (4, 64, None)
    out = tmp_path / "out"
    convert(src, out)
    manifest = load_manifest(out)
    assert {e["name"]: (e["bits"], e["group_size"], e["num_groups"]) for e in manifest["layers"]
            if e["name"] in (K_PROJ, UP_PROJ)} == {K_PROJ: (8, 64, 2), UP_PROJ: (4, 32, 4)}
    assert f"{O_PROJ}.weight" in {entry["name"] for entry in manifest["passthrough"]}
    assert manifest["quantization_defaults"]["extra_config"] == MIXED  # as read
    for config in (json.loads((out / "config.json").read_text())["quantization_config"],
                   json.loads((out / "quantize_config.json").read_text())):
        assert config["extra_config"] == MIXED and config["checkpoint_format"] == "marlin"
    assert main(["verify", str(out), "--skip-kernel", "-q", "--source", str(src)]) == 0
    assert "passed: 13/13 layers ok" in capsys.readouterr().out


def test_extra_config_in_one_file_only_is_written_in_both(tmp_path):
    src = _mixed(tmp_path / "in")
    _only_in_config_json(src)
    out = tmp_path / "out"
    convert(src, out)
    assert json.loads((out / "quantize_config.json").read_text())["extra_config"] == MIXED
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


def test_a_modules_own_name_wins_over_a_regex_and_regexes_match_anywhere_in_the_name(tmp_path):
    src = _checkpoint(tmp_path / "in", {r"self_attn\.k_proj$": {"bits": 2}, K_PROJ: {"bits": 8}},
                      stored={K_PROJ: {"bits": 8}, "model.layers.1.self_attn.k_proj": {"bits": 2}})
    layers = _layers(build_plan(src, skip_incompatible=True))
    assert layers[K_PROJ].spec.bits == 8 and layers[K_PROJ].convertible
    other = layers["model.layers.1.self_attn.k_proj"]  # (re.search: the regex needs no match at the start)
    assert (other.spec.bits, other.convertible, other.reason) == (2, False, "2-bit weights: Marlin has 4- and 8-bit "
                                                                            "forms only")


def test_dynamic_rules_that_agree_with_extra_config_convert(tmp_path):
    """AutoRound's newer GPTQ export writes the overrides as dynamic rules; a config holding both forms converts where
    they give every module the same settings."""
    dynamic = {r"+:.*model\.layers\.0\.self_attn\.k_proj.*": {"bits": 8, "group_size": 64, "sym": True},
               r"-:.*model\.layers\.1\.self_attn\.o_proj.*": {},
               r"+:.*layers\.1\.mlp\.up_proj.*": {"group_size": 32}}
    src = _mixed(tmp_path / "in", dynamic=dynamic)
    layers = _layers(build_plan(src))
    assert layers[K_PROJ].spec.bits == 8 and layers[UP_PROJ].spec.group_size == 32
    out = tmp_path / "out"
    convert(src, out)
    assert load_manifest(out)["quantization_defaults"]["extra_config"] == MIXED  # (recorded beside dynamic)
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


# ------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("entry, said", [
    ({"act_bits": 8}, "act_bits is 8: quantized activations have no Marlin form"),
    ({"bits": 8, "data_type": "fp"}, 'data_type is "fp": only integer weights'),
    ({"data_type": "mx_fp"}, 'data_type is "mx_fp": only integer weights'),  # (the config's 4 bits: quantized)
    ({"bits": 6}, "'bits' is 6; GPTQ has 2, 3, 4, 8 bits, or 16 for a module left unquantized"),
    ({"bits": 4, "super_bits": 6, "super_group_size": 8}, "super_bits is 6: double-quantized scales"),
    ({"group_size": [1, 128]}, "'group_size' must be a JSON integer, found a list"),
])
def test_what_marlin_cannot_serve_is_refused_naming_the_file_key_entry_and_value(tmp_path, capsys, entry, said):
    src = _checkpoint(tmp_path / "in", {K_PROJ: entry})
    _only_in_config_json(src)  # (where both files state it, they must agree, and quantize_config.json is named)
    where = f'{src}/config.json (quantization_config): extra_config entry "{K_PROJ}": '
    with pytest.raises(InputError, match=re.escape(where + said)):
        build_plan(src)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("Error:") == 1 and f'extra_config entry "{K_PROJ}": ' in err and said in err
    assert not (tmp_path / "out").exists()


def test_an_unquantized_entry_is_not_held_to_data_type_and_the_config_level_keys_are_checked_too(tmp_path):
    src = _checkpoint(tmp_path / "in", {O_PROJ: {"bits": 16, "data_type": "float", "act_bits": 16}}, plain=(O_PROJ,))
    assert O_PROJ not in _layers(build_plan(src))
    set_quant_config(src, act_bits=4)
    with pytest.raises(InputError, match=r"quantize_config.json: act_bits is 4: quantized activations have no Marlin"):
        build_plan(src)


def test_an_entry_leaving_a_stored_quantized_module_unquantized_is_a_contradiction(tmp_path):
    src = _checkpoint(tmp_path / "in", {K_PROJ: {"bits": 16}})
    with pytest.raises(InputError, match=rf"layer '{K_PROJ}': extra_config entry \"{K_PROJ}\" in .*quantize_config"
                                         r".json says this module is not quantized, but '.*k_proj.qweight' is stored"):
        build_plan(src)


def test_settings_the_stored_tensors_contradict_name_the_entry_not_a_bare_shape(tmp_path):
    """The gap this fixes: an 8-bit layer under a 4-bit config stopped with a shape error naming neither."""
    src = _checkpoint(tmp_path / "in", {K_PROJ: {"bits": 8}})  # stored 4-bit
    with pytest.raises(InputError, match=rf"k_proj.g_idx' has shape \[128\], expected \[64\]: .* \(extra_config entry "
                                         rf"\"{K_PROJ}\" in .* says bits = 8\)"):
        build_plan(src)


def test_dynamic_and_extra_config_that_disagree_on_a_module_are_refused(tmp_path, capsys):
    dynamic = {r"+:.*self_attn\.k_proj": {"bits": 8}, r"-:.*1\.self_attn\.o_proj": {}}  # up_proj: nothing
    src = _mixed(tmp_path / "in", dynamic=dynamic)
    with pytest.raises(InputError, match=rf"module '{UP_PROJ}': the config's dynamic rules and its extra_config "
                                         r"disagree: 4-bit, group size 64, sym true by no dynamic rule \(the config's "
                                         r"defaults\), 4-bit, group size 32, sym true by extra_config entry"):
        build_plan(src)
    # a module stored unquantized is held to it too: extra_config leaves o_proj unquantized, dynamic quantizes it
    src = _mixed(tmp_path / "in2", dynamic={r"+:.*self_attn\.k_proj": {"bits": 8}, r"+:.*up_proj": {"group_size": 32}})
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"module '{O_PROJ}': the config's dynamic rules and its extra_config disagree: 4-bit" in err
    assert "not quantized by extra_config entry" in err


def test_a_plain_key_that_only_matches_as_a_regex_is_refused(tmp_path):
    """vLLM takes a key with no regex character for a module's name, AutoRound's loader for a regex: 'mlp.up_proj'
    would be applied by one and not the other."""
    src = _checkpoint(tmp_path / "in", {"model.layers.1.mlp.up": {"group_size": 32}})
    with pytest.raises(InputError, match=rf"module '{UP_PROJ}': .*extra_config entry \"model.layers.1.mlp.up\" is not "
                                         "this module's name but matches it as a regular expression"):
        build_plan(src)


def test_regex_entries_that_give_a_module_different_settings_are_refused(tmp_path):
    first, second = r".*layers\.1\.mlp\.up_proj$", r".*\.1\.mlp\.up.*"
    src = _checkpoint(tmp_path / "in", {first: {"group_size": 32}, second: {"bits": 8}},
                      stored={UP_PROJ: {"group_size": 32}})
    with pytest.raises(InputError, match=re.escape(
            f"module '{UP_PROJ}': extra_config entry {json.dumps(first)} in {src}/quantize_config.json gives it 4-bit, "
            f"group size 32, sym true, extra_config entry {json.dumps(second)} in {src}/quantize_config.json 8-bit, "
            "group size 64, sym true: readers that take the first")):
        build_plan(src)


def test_config_json_and_quantize_config_json_stating_different_entries_are_refused(tmp_path):
    src = _mixed(tmp_path / "in")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["extra_config"][K_PROJ] = {"bits": 8, "group_size": 32}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=rf"'extra_config' disagrees: entry \"{K_PROJ}\" is "):
        build_plan(src)


# ------------------------------------------------------------------------------------------------- verify


def test_verify_fails_an_output_whose_extra_config_was_edited(tmp_path):
    src = _mixed(tmp_path / "in")
    out = tmp_path / "out"
    convert(src, out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]["extra_config"][K_PROJ]  # a loader would build k_proj 4-bit
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rerecord(out, "config.json")
    for source in (None, src):
        report = verify(out, gpus=None, workers=1, source_dir=source)
        assert not report.ok
        assert any(f"config.json: gives module '{K_PROJ}' bits 4 (the config); it was converted with 8" in problem
                   for problem in report.problems), report.problems


def test_a_key_whose_search_over_a_long_name_could_run_for_hours_is_refused_and_one_that_cannot_converts(tmp_path,
                                                                                                        capsys):
    """Keys are matched anywhere in a name (re.search), which tries every start: a factor of the name's length that
    a match's bound on repeats does not count (a three-repeat key took 1.4 s on one 256-character name searched,
    0.02 s matched; a few thousand names and entries, hours). A key is checked with that start counted as one more
    repeat; one that starts with '.*' (which reaches every start itself) or '^' costs what it is."""
    src = _checkpoint(tmp_path / "in", {**MIXED, "a.*a.*a.*!": {"bits": 8}}, stored={K_PROJ: {"bits": 8},
                                                                                     UP_PROJ: {"group_size": 32}},
                      plain=(O_PROJ,))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert 'extra_config entry "a.*a.*a.*!" (matched anywhere in a module name' in err
    assert "has 4 repeats of a chosen count" in err and not (tmp_path / "out").exists()
    src = _mixed(tmp_path / "ok", {**MIXED, ".*a.*a.*a!": {"bits": 8}, "^lm_head$": {"bits": 16},
                                   r"(?i)LAYERS\.0\.SELF_ATTN\.Q_PROJ$": {"group_size": 64}})
    plan = build_plan(src)
    assert _layers(plan)["model.layers.0.self_attn.q_proj"].settings.rule.key.startswith("(?i)")
    assert _layers(plan)[UP_PROJ].settings.group_size == 32


@pytest.mark.parametrize("key", [r"(?x) layers\.1\.mlp\.up_proj  # by name", r"(?x) .* layers\.1\.mlp\.up_proj # x"])
def test_a_verbose_key_ending_in_a_comment_matches_as_re_search_would(key):
    """Under (?x) a ``#`` comments out the rest of the key: the form matched anywhere must not lose its closing
    parenthesis to it (it was refused as "missing )")."""
    pattern = compile_config_search(key, "w")
    assert config_regex_match(pattern, UP_PROJ) and re.search(key, UP_PROJ)
    assert not config_regex_match(pattern, K_PROJ)
