"""Real producer output: every tiny checkpoint GPTQModel 7.7 wrote under tests/fixtures/gptqmodel/ converts with no
flags, decodes back to its source tensors bit for bit, and dequantizes from the Marlin tensors to exactly the rows
GPTQModel itself dequantized (reference_dequant.safetensors: ``P.weight`` float32 [R, N] for rows ``P.rows``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from decode_output import all_tensors, assert_decodes_to_source, decode_layer, dequantize

from marlin_convert.convert import convert
from marlin_convert.manifest import load_manifest
from marlin_convert.safetensors_io import read_header, read_tensor

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gptqmodel"
CASES = ("asym_v1", "asym_v2", "bf16_model", "desc_act", "dynamic_lm_head", "int8", "int8_asym",
         "k1000_channelwise", "k1000_desc_act", "k1000_g128", "qwen3_moe", "v2_zeros")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (output directory, manifest), each fixture converted once with no flags."""
    root = tmp_path_factory.mktemp("gptqmodel-out")
    out = {}
    for case in CASES:
        convert(FIXTURES / case, root / case, workers=1)
        out[case] = (root / case, load_manifest(root / case))
    return out


def test_every_fixture_is_here():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_fixture_converts_fully_and_decodes_to_the_source_and_to_gptqmodels_own_dequantization(converted, case):
    out, manifest = converted[case]
    source, marlin = all_tensors(FIXTURES / case, "model*.safetensors"), all_tensors(out)
    assert manifest["checkpoint_format"] == "marlin" and manifest["kept"] == [] and manifest["layers"]
    reference_file = read_header(FIXTURES / case / "reference_dequant.safetensors")
    reference = {name: read_tensor(reference_file, name) for name in reference_file.tensors}
    checked = 0
    for entry in manifest["layers"]:
        assert_decodes_to_source(entry, marlin, source)
        if f"{entry['name']}.weight" in reference and not entry["num_experts"]:
            rows = reference[f"{entry['name']}.rows"]
            weight = dequantize(entry, decode_layer(entry, marlin))
            assert np.array_equal(weight[rows], reference[f"{entry['name']}.weight"]), entry["name"]
            checked += 1
    assert checked == len([n for n in reference if n.endswith(".weight")])
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((out / name).read_text())
        written = data.get("quantization_config", data)
        formats = {written[key] for key in ("checkpoint_format", "format") if key in written}
        assert formats == {"marlin"} and written["is_marlin_format"] is True


def _layers(converted, case) -> dict[str, dict]:
    return {entry["name"]: entry for entry in converted[case][1]["layers"]}


def test_model_dtype_is_recorded_as_written(converted):
    assert converted["bf16_model"][1]["model_dtype"] == "bfloat16"  # transformers 5 writes "dtype"
    assert {e["scale_dtype"] for e in converted["bf16_model"][1]["layers"]} == {"float16"}


def test_dynamic_rules_and_quantized_lm_head(converted):
    layers = _layers(converted, "dynamic_lm_head")
    settings = {name.split(".")[-1]: (e["bits"], e["group_size"]) for name, e in layers.items()}
    assert settings == {"q_proj": (4, 64), "k_proj": (4, 64), "v_proj": (4, 64), "gate_proj": (4, 64),
                        "up_proj": (4, 32), "down_proj": (8, 64), "lm_head": (8, 32)}
    o_proj = "model.layers.0.self_attn.o_proj.weight"  # "-:.*o_proj": not quantized, passed through
    assert o_proj in all_tensors(converted["dynamic_lm_head"][0])


@pytest.mark.parametrize("case", ["k1000_g128", "k1000_channelwise", "k1000_desc_act"])
def test_intermediate_1000_is_padded(converted, case):
    down = next(e for name, e in _layers(converted, case).items() if name.endswith("down_proj"))
    k_pad = 1008 if case == "k1000_channelwise" else 1024
    assert (down["in_features"], down["padded_in_features"]) == (1000, k_pad)
    assert down["act_order"] is (case == "k1000_desc_act")
    up = next(e for name, e in _layers(converted, case).items() if name.endswith("up_proj"))
    assert (up["out_features"], up["padded_out_features"]) == (1000, 1024)


@pytest.mark.parametrize("case, bits, sym, zero_format, act_order", [
    ("asym_v1", 4, False, "v1", None), ("asym_v2", 4, False, "v2", None), ("int8", 8, True, "v1", None),
    ("int8_asym", 8, False, "v1", None), ("v2_zeros", 4, True, "v2", None), ("desc_act", 4, True, "v1", True),
    ("bf16_model", 4, True, "v1", False)])
def test_kinds_are_recorded_per_layer(converted, case, bits, sym, zero_format, act_order):
    for entry in _layers(converted, case).values():
        assert (entry["bits"], entry["sym"], entry["zero_format"]) == (bits, sym, zero_format)
        assert ("zp" in entry["outputs"]) == (not sym)
        if act_order is not None:
            assert entry["act_order"] is act_order


@pytest.mark.parametrize("case", ["k1000_g128", "k1000_desc_act"])
def test_intermediate_1000_converts_fully_with_skip_incompatible_too(tmp_path, case):
    """#7 item 2: K = 1000, g = 128 (seven groups of 128, then 104 rows) is converted, never kept, with the flag."""
    report = convert(FIXTURES / case, tmp_path / "out", workers=1, skip_incompatible=True)
    manifest = load_manifest(tmp_path / "out")
    assert report.skipped == [] and manifest["kept"] == [] and manifest["checkpoint_format"] == "marlin"
    down = next(e for e in manifest["layers"] if e["name"].endswith("down_proj"))
    assert (down["in_features"], down["group_size"], down["num_groups"]) == (1000, 128, 8)
