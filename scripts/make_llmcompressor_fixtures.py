#!/usr/bin/env python3
"""Make the llm-compressor fixtures in ``tests/fixtures/llmcompressor/``: real compressed-tensors
``pack-quantized`` output for tiny random models, quantized by llm-compressor's GPTQModifier on the CPU.

Not needed by CI or by the tests (the fixtures are committed); re-run it only to regenerate them.
llm-compressor is not a dependency of marlin-convert: install it in a virtual environment outside the
repository. llmcompressor 0.14.0.1 accepts torch 2.13, but its install resolves other packages against a
newer torch, so pin the local CPU wheel with a constraint and install the package with ``--no-deps``::

    python3.11 -m venv /tmp/llmc-venv
    /tmp/llmc-venv/bin/pip install torch==2.13.0
    echo 'torch==2.13.0' > /tmp/torch-pin.txt
    /tmp/llmc-venv/bin/pip install -c /tmp/torch-pin.txt 'transformers>=5.15.0,<=5.17.0' \\
        'compressed-tensors==0.19.0' 'auto-round>=0.14.1,<=0.15.1' 'accelerate>=1.15.0' 'datasets>=4.8.4' \\
        loguru pyyaml numpy requests tqdm nvidia-ml-py pillow pydantic psutil
    /tmp/llmc-venv/bin/pip install --no-deps llmcompressor==0.14.0.1

    /tmp/llmc-venv/bin/python scripts/make_llmcompressor_fixtures.py                   # all cases
    /tmp/llmc-venv/bin/python scripts/make_llmcompressor_fixtures.py --case w4a16_asym

Each case builds a tiny model from a transformers config with random weights (seeded, nothing downloaded;
bfloat16 unless the case says float16), saves it with a word-level tokenizer (``oneshot`` wants a processor),
loads it back with ``AutoModelForCausalLM.from_pretrained``, runs ``oneshot`` with ``GPTQModifier`` on 16
rows of 64 random token ids, and saves with ``save_pretrained(save_compressed=True)``. Kept: the safetensors,
config.json, generation_config.json and llm-compressor's recipe.yaml.

``reference_dequant.safetensors`` holds compressed-tensors' own dequantization of a few layers: the layer's
tensors are read from the saved file, its scheme is the checkpoint's config group, ``weight_scale`` is upcast
to float32, and ``PackedQuantizationCompressor.decompress`` (the code compressed-tensors runs to decompress a
checkpoint) computes ``(u - zu) * scale`` in float32, exact for every code. compressed-tensors returns W[N, K];
the reference stores its transpose, like the GPTQModel fixtures. Per reference layer ``P``:

    P.weight  float32 [R, N]  rows of the dequantized W[K, N] (K = in_features)
    P.rows    int64   [R]     which rows of W they are: all K rows when K * N <= 16384, else a fixed random
                              subset of 56 rows plus the last 8

Its one metadata entry, "reference", is JSON: producer and versions, case, layout, formula, how it was computed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import fixture_common

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "llmcompressor"
KEPT_FILES = ("config.json", "generation_config.json", "recipe.yaml")

CHANNEL_W4 = {
    "group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
    }
}


@dataclass(frozen=True)
class Case:
    """One fixture: the model to build, the GPTQModifier arguments, and the layers to dequantize."""

    name: str
    what: str
    modifier: dict
    reference_layers: tuple[str, ...]
    arch: str = "llama"
    dtype: str = "bfloat16"
    intermediate_size: int = 256


CASES = (
    Case(
        "w4a16_g128",
        "preset W4A16 (4-bit symmetric, group 128), bfloat16 Llama, lm_head ignored",
        dict(scheme="W4A16", ignore=["lm_head"]),
        ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"),
    ),
    Case(
        "w4a16_channel",
        "4-bit symmetric channelwise (strategy channel), bfloat16 Llama, lm_head ignored",
        dict(config_groups=CHANNEL_W4, ignore=["lm_head"]),
        ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"),
    ),
    Case(
        "w4a16_asym",
        "preset W4A16_ASYM (4-bit asymmetric, group 128, weight_zero_point), bfloat16 Llama, lm_head ignored",
        dict(scheme="W4A16_ASYM", ignore=["lm_head"]),
        ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"),
    ),
    Case(
        "w8a16",
        "preset W8A16 (8-bit symmetric, group 128), bfloat16 Llama, lm_head ignored",
        dict(scheme="W8A16", ignore=["lm_head"]),
        ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"),
    ),
    Case(
        "qwen3_moe",
        "preset W4A16, bfloat16 Qwen3-MoE (4 experts, top 2, moe_intermediate 128), routers mlp.gate and lm_head "
        "ignored",
        dict(scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"]),
        ("model.layers.0.mlp.experts.0.down_proj", "model.layers.0.mlp.experts.3.gate_proj"),
        arch="qwen3_moe",
        intermediate_size=128,
    ),
    Case(
        "w4a16_fp16",
        "preset W4A16, float16 Llama (float16 scales), lm_head ignored",
        dict(scheme="W4A16", ignore=["lm_head"]),
        ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"),
        dtype="float16",
    ),
    Case(
        "w4a16_lm_head",
        "preset W4A16 with nothing ignored: lm_head quantized too, bfloat16 Llama",
        dict(scheme="W4A16", ignore=[]),
        ("lm_head", "model.layers.0.self_attn.k_proj"),
    ),
)


def scheme_of(quantization_config: dict, layer: str):
    """The compressed-tensors QuantizationScheme of ``layer``: the config group whose targets name it.

    Targets are "Linear" (every linear not ignored), a plain module name, or a "re:" regex.
    """
    import re

    from compressed_tensors.quantization import QuantizationScheme

    for group in quantization_config["config_groups"].values():
        for target in group["targets"]:
            if (
                target == "Linear"
                or target == layer
                or (target.startswith("re:") and re.fullmatch(target[3:], layer))
            ):
                return QuantizationScheme.model_validate(group)
    raise RuntimeError(f"{layer}: no config group targets it")


def producer_dequant(quantized_dir: Path, layer_names: tuple[str, ...]) -> dict:
    """compressed-tensors' own float32 dequantization of ``layer_names``, as row subsets of W[K, N]."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from safetensors import safe_open

    quantization_config = json.loads((quantized_dir / "config.json").read_text())["quantization_config"]
    if quantization_config.get("format") != "pack-quantized":
        raise RuntimeError(f"{quantized_dir}: format {quantization_config.get('format')!r}, not pack-quantized")
    stored = {}
    for path in sorted(quantized_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            stored.update({key: f.get_tensor(key) for key in f.keys()})
    tensors = {}
    for index, name in enumerate(layer_names):
        state = {key[len(name) + 1 :]: value for key, value in stored.items() if key.startswith(name + ".")}
        if "weight_packed" not in state:
            raise RuntimeError(f"{name}: no {name}.weight_packed in the checkpoint")
        state["weight_scale"] = state["weight_scale"].to(torch.float32)
        weight_n_k = PackedQuantizationCompressor.decompress(state, scheme_of(quantization_config, name))["weight"]
        if tuple(weight_n_k.shape) != tuple(state["weight_shape"].tolist()):
            raise RuntimeError(f"{name}: decompressed shape {tuple(weight_n_k.shape)} is not weight_shape")
        tensors.update(fixture_common.reference_entries(name, weight_n_k.to(torch.float32).T, seed=index))
    return tensors


def make_case(case: Case, out_root: Path, work: Path, seed: int) -> Path:
    """Quantize ``case`` with llm-compressor and write its fixture directory; returns it."""
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, quantized = fixture_common.fresh_work_dirs(work, case.name)
    fixture_common.save_source(source, case.arch, case.intermediate_size, case.dtype, seed)

    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, case.dtype))
    ids = fixture_common.random_token_ids(seed)
    calibration = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]})
    oneshot(
        model=model,
        processor=AutoTokenizer.from_pretrained(source),
        dataset=calibration,
        recipe=GPTQModifier(targets="Linear", **case.modifier),
        num_calibration_samples=len(ids),
        max_seq_length=len(ids[0]),
    )
    model.save_pretrained(quantized, save_compressed=True)
    del model

    target = out_root / case.name
    fixture_common.keep_loader_files(quantized, target, KEPT_FILES)

    fixture_common.save_reference(
        target / "reference_dequant.safetensors",
        producer_dequant(target, case.reference_layers),
        {
            "producer": "llmcompressor",
            "producer_version": llmcompressor.__version__,
            "compressed_tensors_version": compressed_tensors.__version__,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "formula": "W = (u - zu) * scale, compressed-tensors' W[N, K] transposed",
            "how": "weight_scale upcast to float32, PackedQuantizationCompressor.decompress",
            "case": case.name,
            "what": case.what,
        },
    )
    return target


def main(argv: list[str] | None = None) -> int:
    return fixture_common.run_cases(argv, __doc__.split("\n\n")[0], CASES, DEFAULT_OUT, make_case)


if __name__ == "__main__":
    raise SystemExit(main())
