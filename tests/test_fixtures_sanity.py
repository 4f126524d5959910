"""The committed producer fixtures (tests/fixtures/, see its README.md) are all there and well-formed.

Only presence and form: every expected case directory, its configs parse as JSON and name the producer's
format, every safetensors header parses with our reader, and each reference_dequant.safetensors pairs
``P.weight`` float32 [R, N] with ``P.rows`` int64 [R] for a layer the checkpoint really quantizes, with N
matching the stored tensors. What the converter does with them is tested elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlin_convert.safetensors_io import read_header

FIXTURES = Path(__file__).resolve().parent / "fixtures"

GPTQMODEL_CASES = (
    "dynamic_lm_head",
    "k1000_g128",
    "k1000_channelwise",
    "qwen3_moe",
    "v2_zeros",
    "desc_act",
    "k1000_desc_act",
    "bf16_model",
    "asym_v1",
    "asym_v2",
    "int8",
    "int8_asym",
)
LLMCOMPRESSOR_CASES = (
    "w4a16_g128",
    "w4a16_channel",
    "w4a16_asym",
    "w8a16",
    "qwen3_moe",
    "w4a16_fp16",
    "w4a16_lm_head",
)
SIZE_BUDGET = {"gptqmodel": 10 * 2**20, "llmcompressor": 6 * 2**20}
ALL_CASES = [("gptqmodel", c) for c in GPTQMODEL_CASES] + [("llmcompressor", c) for c in LLMCOMPRESSOR_CASES]


def checkpoint_tensors(case_dir: Path) -> dict:
    """Every tensor's header entry across the case's model safetensors files (the reference excluded)."""
    tensors = {}
    for path in sorted(case_dir.glob("*.safetensors")):
        if path.name != "reference_dequant.safetensors":
            tensors.update(read_header(path).tensors)
    return tensors


def out_features(producer: str, layer: str, tensors: dict) -> int:
    """N of a quantized layer from its stored tensors: qweight [K/p, N] or weight_packed [N, K*b/32]."""
    if producer == "gptqmodel":
        return tensors[f"{layer}.qweight"].shape[1]
    return tensors[f"{layer}.weight_packed"].shape[0]


@pytest.mark.parametrize("producer", sorted(SIZE_BUDGET))
def test_no_unexpected_cases_and_within_size_budget(producer):
    root = FIXTURES / producer
    expected = GPTQMODEL_CASES if producer == "gptqmodel" else LLMCOMPRESSOR_CASES
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(expected)
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert total <= SIZE_BUDGET[producer], f"{producer} fixtures are {total} bytes"


@pytest.mark.parametrize(("producer", "case"), ALL_CASES, ids=[f"{p}-{c}" for p, c in ALL_CASES])
def test_configs_are_json_and_name_the_format(producer, case):
    case_dir = FIXTURES / producer / case
    quantization = json.loads((case_dir / "config.json").read_text())["quantization_config"]
    if producer == "gptqmodel":
        standalone = json.loads((case_dir / "quantize_config.json").read_text())
        assert quantization["quant_method"] == standalone["quant_method"] == "gptq"
        assert quantization["checkpoint_format"] == standalone["checkpoint_format"]
        assert standalone["meta"]["quantizer"] == ["gptqmodel:7.7.0"]
    else:
        assert quantization["quant_method"] == "compressed-tensors"
        assert quantization["format"] == "pack-quantized"
        assert quantization["config_groups"]


@pytest.mark.parametrize(("producer", "case"), ALL_CASES, ids=[f"{p}-{c}" for p, c in ALL_CASES])
def test_headers_parse_and_reference_matches_checkpoint(producer, case):
    case_dir = FIXTURES / producer / case
    tensors = checkpoint_tensors(case_dir)
    assert tensors, f"{case_dir}: no model safetensors"
    reference = read_header(case_dir / "reference_dequant.safetensors")
    assert json.loads(reference.metadata["reference"])["producer"] == producer
    layers = sorted({name.rsplit(".", 1)[0] for name in reference.tensors})
    assert len(layers) >= 2
    for layer in layers:
        weight = reference.tensors[f"{layer}.weight"]
        rows = reference.tensors[f"{layer}.rows"]
        assert (weight.dtype, rows.dtype) == ("F32", "I64")
        assert len(weight.shape) == 2 and rows.shape == (weight.shape[0],)
        assert weight.shape[1] == out_features(producer, layer, tensors), layer
    assert len(reference.tensors) == 2 * len(layers)
