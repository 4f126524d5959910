"""Real llm-compressor output: every compressed-tensors ``pack-quantized`` checkpoint under
tests/fixtures/llmcompressor/ (README there) converts with no flags into exactly the Marlin checkpoint that the
same weights written as GPTQ convert into (the GPTQ twin is built here from the stored tensors with the test's
own packer, :mod:`ct_checkpoint`), ``verify --skip-kernel --source FIXTURE`` rebuilds every source tensor bit for
bit, the Marlin tensors dequantize to compressed-tensors' own dequantization (reference_dequant.safetensors),
and a flipped bit in any Marlin tensor fails verify by layer name."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from ct_checkpoint import assert_same_tensors, gptq_twin
from decode_output import all_tensors, decode_layer, dequantize

from marlin_convert.cli.app import main
from marlin_convert.convert import convert
from marlin_convert.manifest import load_manifest
from marlin_convert.safetensors_io import read_header, read_tensor
from marlin_convert.verify import verify

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llmcompressor"
CASES = ("w4a16_g128", "w4a16_channel", "w4a16_asym", "w8a16", "qwen3_moe", "w4a16_fp16", "w4a16_lm_head")
#: (bits, group_size, sym, scale dtype) of every layer of each case
KINDS = {"w4a16_g128": (4, 128, True, "bfloat16"), "w4a16_channel": (4, -1, True, "bfloat16"),
         "w4a16_asym": (4, 128, False, "bfloat16"), "w8a16": (8, 128, True, "bfloat16"),
         "qwen3_moe": (4, 128, True, "bfloat16"), "w4a16_fp16": (4, 128, True, "float16"),
         "w4a16_lm_head": (4, 128, True, "bfloat16")}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (output of the fixture, output of its GPTQ twin), each converted once with no flags."""
    root = tmp_path_factory.mktemp("llmcompressor-out")
    out = {}
    for case in CASES:
        twin = gptq_twin(FIXTURES / case, root / f"{case}-gptq")
        convert(FIXTURES / case, root / case, workers=1)
        convert(twin, root / f"{case}-twin", workers=1)
        out[case] = (root / case, root / f"{case}-twin")
    return out


@pytest.mark.parametrize("case", CASES)
def test_converts_with_no_flags_into_the_same_marlin_checkpoint_as_its_gptq_twin(converted, case):
    out, twin = converted[case]
    manifest, twin_manifest = load_manifest(out), load_manifest(twin)
    assert manifest["checkpoint_format"] == "marlin" and manifest["kept"] == []
    assert manifest["source"]["format"] == "compressed-tensors"
    # every tensor of the output, Marlin or passed through, equals the twin's bit for bit, with the same dtype
    assert_same_tensors(out, twin)
    # the layer records agree but for where they came from
    for entry, twin_entry in zip(manifest["layers"], twin_manifest["layers"], strict=True):
        assert entry["source_format"] == "compressed-tensors" and twin_entry["source_format"] == "gptq"
        differ = {"source_format", "sources"}
        assert {k: v for k, v in entry.items() if k not in differ} == \
            {k: v for k, v in twin_entry.items() if k not in differ}
        bits, group_size, sym, scale_dtype = KINDS[case]
        assert (entry["bits"], entry["group_size"], entry["sym"], entry["scale_dtype"], entry["zero_format"]) == \
            (bits, group_size, sym, scale_dtype, "v2")
        assert ("zp" in entry["outputs"]) is (not sym) and entry["act_order"] is False


@pytest.mark.parametrize("case", CASES)
def test_sources_record_the_stored_tensors_and_weight_shape(converted, case):
    out, _ = converted[case]
    source = read_header(FIXTURES / case / "model.safetensors")
    for entry in load_manifest(out)["layers"]:
        (record,) = entry["sources"]
        kinds = {"weight_packed", "weight_scale", "weight_shape"} | (set() if entry["sym"] else {"weight_zero_point"})
        assert set(record["tensors"]) == set(record["digests"]) == kinds
        assert record["tensors"]["weight_packed"] == f"{entry['name']}.weight_packed"
        shape = read_tensor(source, record["tensors"]["weight_shape"])
        assert record["weight_shape"] == shape.tolist() == [entry["out_features"], entry["in_features"]]
        assert record["zero_format"] == "v2" and record["zero_stored"] == (1 << (entry["bits"] - 1) if entry["sym"]
                                                                           else None)


@pytest.mark.parametrize("case", CASES)
def test_verify_with_the_source_passes(converted, case, capsys):
    out, _ = converted[case]
    assert main(["verify", str(out), "--skip-kernel", "-q", "--workers", "1", "--source", str(FIXTURES / case)]) == 0
    text = capsys.readouterr().out
    assert "0 kept in compressed-tensors form" in text and "0 problem(s) with the files" in text


@pytest.mark.parametrize("case", CASES)
def test_marlin_tensors_dequantize_to_compressed_tensors_own_dequantization(converted, case):
    out, _ = converted[case]
    marlin = all_tensors(out)
    reference = all_tensors(FIXTURES / case, "reference_dequant.safetensors")
    checked = 0
    for entry in load_manifest(out)["layers"]:
        if f"{entry['name']}.weight" in reference:
            weight = dequantize(entry, decode_layer(entry, marlin))
            rows = reference[f"{entry['name']}.rows"]
            assert np.array_equal(weight[rows], reference[f"{entry['name']}.weight"]), entry["name"]
            checked += 1
    assert checked == len([name for name in reference if name.endswith(".weight")]) >= 2


@pytest.mark.parametrize("case", CASES)
def test_the_output_config_says_marlin_converted_from_compressed_tensors(converted, case):
    out, twin = converted[case]
    original = json.loads((FIXTURES / case / "config.json").read_text())["quantization_config"]
    twin_config = json.loads((twin / "quantize_config.json").read_text())
    for written in (json.loads((out / "config.json").read_text())["quantization_config"],
                    json.loads((out / "quantize_config.json").read_text())):
        assert written["quant_method"] == "gptq" and written["checkpoint_format"] == "marlin"
        assert written["is_marlin_format"] is True and "format" not in written
        # the modules the ignore list keeps unquantized (the MoE router; lm_head has its own key) as -: rules
        unquantized = [m for m in original["ignore"] if m.rsplit(".", 1)[-1] != "lm_head"]
        assert written.get("dynamic") == ({f"-:^{re.escape(m)}$": {} for m in unquantized} or None)
        assert written["source_format"] == "compressed-tensors" and written["source_quantization_config"] == original
        for key in ("bits", "group_size", "sym", "desc_act", "lm_head"):
            assert written[key] == twin_config[key], key
    assert twin_config["lm_head"] is (case == "w4a16_lm_head")


@pytest.mark.parametrize("case", CASES)
def test_a_flipped_bit_in_a_marlin_tensor_fails_its_layer(converted, case, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted[case][0], out)
    manifest = load_manifest(out)
    rng = random.Random(case)
    pristine = (out / "model.safetensors").read_bytes()
    for kind in ("B", "s", "zp"):
        candidates = [entry for entry in manifest["layers"] if kind in entry["outputs"]]
        if not candidates:
            continue
        entry = rng.choice(candidates)
        info = read_header(out / entry["shards"][kind]).tensors[entry["outputs"][kind]]
        offset = rng.randrange(info.begin, info.end)
        with open(out / entry["shards"][kind], "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        report = verify(out, gpus=None, workers=1, source_dir=FIXTURES / case)
        assert [r.name for r in report.failures] == [entry["name"]], kind
        (out / "model.safetensors").write_bytes(pristine)


def test_stacked_experts_equal_the_gptq_twins_and_verify(converted, tmp_path):
    out, twin = tmp_path / "stacked", tmp_path / "twin-stacked"
    convert(FIXTURES / "qwen3_moe", out, workers=2, stack_experts=True)
    convert(converted["qwen3_moe"][1].parent / "qwen3_moe-gptq", twin, workers=1, stack_experts=True)
    tensors = assert_same_tensors(out, twin)
    layers = {entry["name"]: entry for entry in load_manifest(out)["layers"]}
    stacked = layers["model.layers.0.mlp.experts.down_proj"]
    assert stacked["num_experts"] == 4 and len(stacked["sources"]) == 4
    assert stacked["sources"][3]["tensors"]["weight_packed"] == "model.layers.0.mlp.experts.3.down_proj.weight_packed"
    assert "model.layers.0.mlp.gate.weight" in tensors  # the ignored router passes through
    assert verify(out, gpus=None, workers=2, source_dir=FIXTURES / "qwen3_moe").ok


def test_inspect_shows_the_source_format_and_each_layers_config_group(tmp_path, capsys):
    assert main(["inspect", str(FIXTURES / "w4a16_asym"), "--json", str(tmp_path / "plan.json")]) == 0
    text = capsys.readouterr().out
    assert "config: compressed-tensors pack-quantized: group_0 (4-bit int asym group 128" in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["source_format"] == "compressed-tensors" and plan["converted"] == 7
    assert plan["quantization_defaults"]["ignore"] == ["lm_head"]
    layer = plan["layers"][0]
    assert layer["settings_from"].startswith("config group 'group_0' in ") and layer["zero_format"] == "v2"


@pytest.mark.parametrize("case", ["w4a16_asym", "w8a16", "w4a16_channel", "w4a16_fp16"])
def test_what_verify_stages_for_the_gpu_gives_compressed_tensors_own_dequantization(converted, case):
    """On the CPU, what the kernel check uploads: each slice's rebuilt GPTQ tensors give, through the GPU
    reference's own code, compressed-tensors' dequantization; the stored tensors rebuilt for the digests lie after
    everything uploaded."""
    torch = pytest.importorskip("torch")
    from marlin_convert.audit import audit
    from marlin_convert.gpu_check import UPLOADED, reference_weight
    from marlin_convert.rebuild import Stage, TensorReader, rebuild_slice, stage_bytes

    out, _ = converted[case]
    manifest = load_manifest(out)
    checked = audit(out, manifest)
    reference = all_tensors(FIXTURES / case, "reference_dequant.safetensors")
    compared = 0
    for entry, layer in zip(manifest["layers"], checked.layers, strict=True):
        stage = Stage(bytearray(stage_bytes(layer)))
        (source,) = entry["sources"]
        assert rebuild_slice(layer, source, None, TensorReader(out, checked.headers), stage).complete
        end = max(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
                  for name, (offset, dtype, shape) in stage.placed.items() if name in UPLOADED)
        assert min(stage.placed[kind][0] for kind in source["tensors"]) >= end

        def tensor(name):
            array = torch.from_numpy(stage.view(name).copy())
            return array.view(torch.bfloat16) if name == "scales" and entry["scale_dtype"] == "bfloat16" else array

        weight = reference_weight(tensor("qweight"), tensor("scales"), tensor("qzeros"), tensor("g_idx"),
                                  entry["bits"], source["zero_format"]).float().numpy()
        if f"{entry['name']}.weight" in reference:
            rows = reference[f"{entry['name']}.rows"]
            assert np.array_equal(weight[rows], reference[f"{entry['name']}.weight"]), entry["name"]
            compared += 1
    assert compared == 2
