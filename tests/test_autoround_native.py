"""AutoRound's own format (``quant_method: "auto-round"``) where its ``packing_format`` is a GPTQ tensor layout:
``auto_round:auto_gptq`` (zero points stored minus 1, v1) and ``auto_round`` (AutoRound's asymmetric packing, zero
points as they are, v2) are read as GPTQ; AWQ and every other packing are refused by key and value;
``block_name_to_quantize`` leaves a module outside every block unquantized unless an ``extra_config`` entry names it;
the output says Marlin in every format key, keeps the source's quant_method and packing as ``source_*``, and
``verify`` holds both configs to the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from edit_checkpoint import rerecord
from make_gptq_checkpoint import TensorSpec, qwen3_moe, tiny_llama, with_quantized_lm_head, write_checkpoint

from marlin_convert.cli.app import main
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError
from marlin_convert.manifest import load_manifest
from marlin_convert.verify import verify

K_PROJ = "model.layers.0.self_attn.k_proj"
O_PROJ = "model.layers.1.self_attn.o_proj"
#: one module 8-bit by its name, one left unquantized (bits 16, data_type fp, as AutoRound writes it)
EXTRA = {K_PROJ: {"bits": 8}, O_PROJ: {"bits": 16, "data_type": "fp"}}


def _autoround(path: Path, packing: str | None = "auto_round:auto_gptq", *, sym: bool = True,
               zero_format: str = "v1", extra_config: dict | None = EXTRA, lm_head: bool = False, **keys) -> Path:
    """A two-layer tiny Llama (group size 64) as AutoRound's native export writes it: config.json alone, with
    quant_method "auto-round", ``packing`` (None: no packing_format key), data_type, block_name_to_quantize
    "model.layers", and ``extra_config``: k_proj stored 8-bit, o_proj stored as a plain ``.weight``."""
    spec = tiny_llama(num_layers=2, group_size=64, sym=sym, zero_format=zero_format, config_location="config")
    if lm_head:
        spec = with_quantized_lm_head(spec)
        spec.dynamic = None
        spec.quantization_extra = {}
    for lin in list(spec.linears):
        if lin.name == K_PROJ:
            lin.bits = 8
        if lin.name == O_PROJ:
            spec.linears.remove(lin)
            spec.extras.append(TensorSpec(f"{lin.name}.weight", (lin.out_features, lin.in_features), "float16"))
    spec.quantization_extra = {"quant_method": "auto-round", "data_type": "int", "autoround_version": "0.6.0",
                               "block_name_to_quantize": "model.layers", **keys}
    if packing is not None:
        spec.quantization_extra["packing_format"] = packing
    if extra_config is not None:
        spec.quantization_extra["extra_config"] = extra_config
    src = write_checkpoint(path, spec)
    config = json.loads((src / "config.json").read_text())
    for key in ("desc_act", "true_sequential", "static_groups"):  # (GPTQ's keys: AutoRound's export has none)
        config["quantization_config"].pop(key, None)
    (src / "config.json").write_text(json.dumps(config, indent=2))
    return src


# ------------------------------------------------------------------------------------------------- converting


@pytest.mark.parametrize("packing, sym, zero_format", [
    ("auto_round:auto_gptq", True, "v1"),  # Intel/*-int4-AutoRound, OPEA/*-int4-sym-inc
    ("auto_round:auto_gptq", False, "v1"),
    ("auto_round", False, "v2"),  # AutoRound's asymmetric packing: the zero points as they are
    (None, True, "v1"),  # no packing_format: vLLM's default, auto_round:auto_gptq
])
def test_autoround_gptq_packing_converts_and_verify_source_passes(tmp_path, capsys, packing, sym, zero_format):
    src = _autoround(tmp_path / "in", packing, sym=sym, zero_format=zero_format)
    out = tmp_path / "out"
    convert(src, out)
    manifest = load_manifest(out)
    layers = {entry["name"]: entry for entry in manifest["layers"]}
    assert layers[K_PROJ]["bits"] == 8 and O_PROJ not in layers
    assert {entry["sym"] for entry in layers.values()} == {sym}
    assert {entry["zero_format"] for entry in layers.values()} == {zero_format}
    defaults = manifest["quantization_defaults"]
    assert defaults["quant_method"] == "auto-round" and defaults["block_name_to_quantize"] == "model.layers"
    assert defaults.get("packing_format") == packing
    for section in (json.loads((out / "config.json").read_text())["quantization_config"],
                    json.loads((out / "quantize_config.json").read_text())):
        assert section["quant_method"] == "gptq" and section["checkpoint_format"] == "marlin"
        assert section["source_quant_method"] == "auto-round" and section["extra_config"] == EXTRA
        if packing is None:
            assert "packing_format" not in section and "source_packing_format" not in section
        else:
            assert section["packing_format"] == "marlin" and section["source_packing_format"] == packing
    assert main(["verify", str(out), "--skip-kernel", "-q", "--source", str(src)]) == 0
    assert "passed: 13/13 layers ok" in capsys.readouterr().out


def test_zero_format_follows_the_packing_not_the_gptq_default(tmp_path):
    """Asymmetric layers cannot tell v1 from v2 by their values: the packing decides (auto_round: v2)."""
    plan = build_plan(_autoround(tmp_path / "in", "auto_round", sym=False, zero_format="v2"))
    assert {layer.spec.zero_format for layer in plan.layers if layer.convertible} == {"v2"}
    assert any("from packing_format auto_round" in note for note in plan.notes), plan.notes


def test_a_module_outside_the_blocks_is_quantized_only_by_its_extra_config_entry(tmp_path):
    src = _autoround(tmp_path / "in", lm_head=True, extra_config={**EXTRA, "lm_head": {"bits": 8, "group_size": 32}})
    out = tmp_path / "out"
    convert(src, out)
    assert {entry["name"]: entry["bits"] for entry in load_manifest(out)["layers"]}["lm_head"] == 8
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


def test_a_stored_qweight_outside_the_blocks_without_an_entry_is_refused(tmp_path, capsys):
    src = _autoround(tmp_path / "in", lm_head=True)
    with pytest.raises(InputError, match=r"layer 'lm_head': block_name_to_quantize \"model\.layers\" in .*config\.json "
                                         r"\(quantization_config\) says this module is not quantized"):
        build_plan(src)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    assert "block_name_to_quantize" in capsys.readouterr().err


def test_stacked_experts_outside_the_blocks_quantized_by_their_entries_convert(tmp_path):
    """Stacked 3-D experts outside every block, each named by an extra_config entry: every per-expert name is left
    out by block_name_to_quantize as the stacked name is, so no rule singles the experts out (the check of
    per-expert rules ended in an AttributeError on the BlockScope)."""
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64, group_size=32, stacked=True)
    stacked = [lin.name for lin in spec.linears if ".experts." in lin.name]
    spec.quantization_extra = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq",
                               "block_name_to_quantize": "model.layers.0.self_attn",
                               "extra_config": {name: {"bits": 4} for name in stacked}}
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    convert(src, out)
    assert {entry["name"] for entry in load_manifest(out)["layers"]} >= set(stacked)
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


#: dynamic rules that say what EXTRA says (k_proj 8-bit, o_proj not quantized), as a tool that leaves both writes them
AGREEING_DYNAMIC = {"+:" + K_PROJ.replace(".", r"\.") + "$": {"bits": 8}, "-:" + O_PROJ.replace(".", r"\.") + "$": {}}


def test_dynamic_beside_extra_config_agreeing_converts_with_the_embeddings_outside_the_blocks(tmp_path):
    """embed_tokens and lm_head, stored as plain ``.weight`` outside every block, with no rule and no entry: a GPTQ
    loader reading dynamic leaves them alone as block_name_to_quantize does, so they are no disagreement."""
    src = _autoround(tmp_path / "in", dynamic=AGREEING_DYNAMIC)
    out = tmp_path / "out"
    convert(src, out)
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


def test_dynamic_beside_extra_config_still_refuses_a_stored_qweight_outside_the_blocks(tmp_path):
    src = _autoround(tmp_path / "in", lm_head=True, dynamic=AGREEING_DYNAMIC)
    with pytest.raises(InputError, match=r"module 'lm_head': the config's dynamic rules and its extra_config disagree"):
        build_plan(src)


def test_autoround_quantization_config_json_is_not_copied(tmp_path):
    src = _autoround(tmp_path / "in")
    (src / "quantization_config.json").write_text(json.dumps(
        json.loads((src / "config.json").read_text())["quantization_config"]))
    out = tmp_path / "out"
    report = convert(src, out)
    assert not (out / "quantization_config.json").exists()
    assert any("quantization_config.json: AutoRound's copy" in note for note in report.notes), report.notes
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


# ------------------------------------------------------------------------------------------------- refused


@pytest.mark.parametrize("method, suggested", [("auto_round", "auto-round"), ("autoround", "auto-round"),
                                               ("gptqq", "gptq"), ("compressed_tensors", "compressed-tensors"),
                                               ("awq", None)])
def test_a_mistyped_quant_method_names_the_file_and_the_likely_value(tmp_path, capsys, method, suggested):
    src = _autoround(tmp_path / "in", quant_method=method)
    assert main(["inspect", str(src)]) == 2
    err = capsys.readouterr().err
    assert f'config.json (quantization_config): not a GPTQ checkpoint: quant_method is "{method}"' in err
    assert ("did you mean" in err) == (suggested is not None)
    if suggested:
        assert f'did you mean "{suggested}"?' in err


@pytest.mark.parametrize("packing, said", [
    ("auto_round:auto_awq", "AWQ's tensor layout"),
    ("auto_round:fp8_static", "not a GPTQ tensor layout"),
    ("auto_round:llm_compressor", "not a GPTQ tensor layout"),
    ("auto_round:gptqmodel", "not a GPTQ tensor layout"),
])
def test_packing_that_is_no_gptq_layout_is_refused_naming_the_key_and_value(tmp_path, capsys, packing, said):
    src = _autoround(tmp_path / "in", packing)
    with pytest.raises(InputError, match=rf"config\.json \(quantization_config\): packing_format is "
                                         rf"\"{packing}\": {said}"):
        build_plan(src)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert f'config.json (quantization_config): packing_format is "{packing}"' in err and "Hint:" in err
    assert not (tmp_path / "out").exists()


def test_older_backend_key_states_the_packing(tmp_path):
    """Releases before packing_format (quant_method intel/auto-round) wrote the packing under ``backend``."""
    src = _autoround(tmp_path / "in", None, quant_method="intel/auto-round", backend="auto_round:exllamav2")
    with pytest.raises(InputError, match=r"backend is \"auto_round:exllamav2\": not a GPTQ tensor layout"):
        build_plan(src)
    src = _autoround(tmp_path / "ok", None, quant_method="intel/auto-round", backend="auto_round:gptq:exllamav2")
    out = tmp_path / "out"
    convert(src, out)
    section = json.loads((out / "config.json").read_text())["quantization_config"]
    assert section["backend"] == "marlin" and section["source_backend"] == "auto_round:gptq:exllamav2"
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


def test_a_checkpoint_format_that_contradicts_the_packing_is_refused(tmp_path):
    src = _autoround(tmp_path / "in", "auto_round:auto_gptq", checkpoint_format="gptq_v2")
    with pytest.raises(InputError, match=r"checkpoint_format \"gptq_v2\" and packing_format "
                                         r"\"auto_round:auto_gptq\" say different zero formats"):
        build_plan(src)


# ------------------------------------------------------------------------------------------------- verify


@pytest.mark.parametrize("key, value, said", [
    ("packing_format", "auto_round:auto_gptq", 'packing_format is "auto_round:auto_gptq", expected "marlin"'),
    ("source_packing_format", "auto_round", "source_packing_format is \"auto_round\", the manifest's "
                                            "quantization_defaults.packing_format is \"auto_round:auto_gptq\""),
    ("source_quant_method", None, "source_quant_method is null, the manifest's quantization_defaults.quant_method"),
    ("quant_method", "auto-round", 'quant_method is "auto-round", expected "gptq"'),
    ("block_name_to_quantize", "model", "block_name_to_quantize is \"model\", the manifest's"),
    ("block_name_to_quantize", None, "block_name_to_quantize is missing, the manifest's quantization_defaults"),
])
def test_verify_fails_an_output_whose_autoround_keys_were_edited(tmp_path, key, value, said):
    src = _autoround(tmp_path / "in")
    out = tmp_path / "out"
    convert(src, out)
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((out / name).read_text())
        section = data["quantization_config"] if name == "config.json" else data
        if value is None:
            del section[key]
        else:
            section[key] = value
        (out / name).write_text(json.dumps(data, indent=2))
        rerecord(out, name)
    for source in (None, src):
        report = verify(out, gpus=None, workers=1, source_dir=source)
        assert not report.ok
        assert any(said in problem for problem in report.problems), report.problems


def test_config_json_and_quantize_config_json_stating_different_backends_are_refused(tmp_path, capsys):
    """Releases before packing_format state the packing under backend: config.json's auto_round (zero points as
    they are) against quantize_config.json's auto_round:auto_gptq (stored minus 1) took quantize_config.json's, so
    every zero point was read one off what config.json's readers take, where the stored values allowed both."""
    src = _autoround(tmp_path / "in", None, sym=False, zero_format="v1", quant_method="intel/auto-round",
                     backend="auto_round")
    quantize = json.loads((src / "config.json").read_text())["quantization_config"]
    (src / "quantize_config.json").write_text(json.dumps({**quantize, "backend": "auto_round:auto_gptq"}))
    with pytest.raises(InputError, match=r"'backend' disagrees: \"auto_round\" against \"auto_round:auto_gptq\""):
        build_plan(src)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    assert "'backend' disagrees" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (src / "quantize_config.json").write_text(json.dumps({**quantize, "backend": "AUTO_ROUND"}))
    assert {layer.spec.zero_format for layer in build_plan(src).layers if layer.convertible} == {"v2"}
