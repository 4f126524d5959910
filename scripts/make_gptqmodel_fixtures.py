#!/usr/bin/env python3
"""Make the GPTQModel fixtures in ``tests/fixtures/gptqmodel/``: real GPTQModel output for tiny random models.

Not needed by CI or by the tests (the fixtures are committed); re-run it only to regenerate them. GPTQModel
is not a dependency of marlin-convert: install it in a virtual environment outside the repository. GPTQModel
7.7 declares ``torch>=2.14.1`` but runs with the local torch 2.13 CPU wheel, so its requirements are installed
without torch and the package itself with ``--no-deps`` (it compiles nothing at install time)::

    python3.11 -m venv /tmp/gptqmodel-venv
    /tmp/gptqmodel-venv/bin/pip install torch==2.13.0
    /tmp/gptqmodel-venv/bin/pip download --no-deps gptqmodel==7.7.0 -d /tmp/dl
    tar xzf /tmp/dl/gptqmodel-7.7.0.tar.gz -C /tmp/dl
    grep -v '^torch>=' /tmp/dl/gptqmodel-7.7.0/requirements.txt > /tmp/gptq-reqs.txt
    echo 'torch==2.13.0' > /tmp/torch-pin.txt
    /tmp/gptqmodel-venv/bin/pip install -r /tmp/gptq-reqs.txt -c /tmp/torch-pin.txt
    /tmp/gptqmodel-venv/bin/pip install --no-deps /tmp/dl/gptqmodel-7.7.0.tar.gz

    GPTQMODEL_CPU_WORKERS=2 /tmp/gptqmodel-venv/bin/python scripts/make_gptqmodel_fixtures.py      # all cases
    GPTQMODEL_CPU_WORKERS=2 /tmp/gptqmodel-venv/bin/python scripts/make_gptqmodel_fixtures.py --case asym_v2

Each case builds a tiny model from a transformers config with random weights (seeded, nothing downloaded), a
word-level tokenizer over the same vocabulary (GPTQModel's loader insists on one; it is never used for
calibration), quantizes it with GPTQModel's GPTQ on the CPU from random token ids, saves it, and keeps the
files a loader needs (safetensors, config.json, quantize_config.json, generation_config.json, tokenizer files;
GPTQModel's quant_log.csv is dropped).

It then writes ``reference_dequant.safetensors`` beside them with GPTQModel's own dequantization of a few
layers: the saved checkpoint is loaded back with ``GPTQModel.load(..., backend=BACKEND.TORCH, dtype=D)`` where D is
the dtype of the stored scales (otherwise GPTQModel's CPU default, bfloat16, would round float16 scales; GPTQModel's
loader turns v1 zeros into its internal v2 form, so this is the producer's meaning of the file), the layer's
scales are upcast to float32, and GPTQModel's ``PackableQuantLinear.dequantize_weight`` computes
``scales[g_idx] * (q - z[g_idx])`` in float32, exact for every code. Per reference layer ``P``:

    P.weight  float32 [R, N]  rows of the dequantized W[K, N] (K = in_features, the GPTQ qweight orientation)
    P.rows    int64   [R]     which rows of W they are: all K rows when K * N <= 16384, else a fixed random
                              subset of 56 rows plus the last 8 (the last group, partial when g does not divide K)

Its one metadata entry, "reference", is JSON: producer and versions, case, layout, formula, how it was computed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import fixture_common

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "gptqmodel"
KEPT_FILES = (
    "config.json",
    "quantize_config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class Case:
    """One fixture: the model to build, GPTQModel's QuantizeConfig arguments, and the layers to dequantize."""

    name: str
    what: str
    arch: str  # "llama" or "qwen3_moe"
    quantize: dict
    reference_layers: tuple[str, ...]
    intermediate_size: int = 256
    dtype: str = "float16"


DYNAMIC_RULES = {
    r"-:.*o_proj": {},
    r"+:.*down_proj": {"bits": 8},
    r"+:.*up_proj": {"group_size": 32},
}

CASES = (
    Case(
        "dynamic_lm_head",
        "4-bit g64 Llama with `dynamic` rules (o_proj not quantized, down_proj 8-bit, up_proj g32) and lm_head",
        "llama",
        dict(bits=4, group_size=64, dynamic=DYNAMIC_RULES, lm_head=True),
        ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj", "lm_head", "model.layers.0.self_attn.k_proj"),
    ),
    Case(
        "k1000_g128",
        "4-bit g128 Llama, intermediate 1000: down_proj has K = 1000 (seven groups of 128, then 104)",
        "llama",
        dict(bits=4, group_size=128),
        ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.k_proj"),
        intermediate_size=1000,
    ),
    Case(
        "k1000_channelwise",
        "4-bit channelwise (group_size -1) Llama, intermediate 1000, act_group_aware off (GPTQModel needs g > 0 "
        "for it)",
        "llama",
        dict(bits=4, group_size=-1, act_group_aware=False),
        ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.k_proj"),
        intermediate_size=1000,
    ),
    Case(
        "qwen3_moe",
        "4-bit g32 Qwen3-MoE, 4 experts (top 2), moe_intermediate 64, router mlp.gate not quantized",
        "qwen3_moe",
        dict(bits=4, group_size=32),
        (
            "model.layers.0.mlp.experts.0.down_proj",
            "model.layers.0.mlp.experts.3.gate_proj",
            "model.layers.0.self_attn.k_proj",
        ),
        intermediate_size=64,
    ),
    Case(
        "v2_zeros",
        "4-bit g32 symmetric Llama saved as checkpoint_format gptq_v2",
        "llama",
        dict(bits=4, group_size=32, format="gptq_v2"),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"),
    ),
    Case(
        "desc_act",
        "4-bit g32 Llama with desc_act true (act-order, act_group_aware off)",
        "llama",
        dict(bits=4, group_size=32, desc_act=True, act_group_aware=False),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"),
    ),
    Case(
        "k1000_desc_act",
        "4-bit g128 Llama with desc_act true, intermediate 1000: act-order over a partial last group (K = 1000)",
        "llama",
        dict(bits=4, group_size=128, desc_act=True, act_group_aware=False),
        ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj"),
        intermediate_size=1000,
    ),
    Case(
        "bf16_model",
        "4-bit g32 symmetric Llama whose model dtype is bfloat16",
        "llama",
        dict(bits=4, group_size=32),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"),
        dtype="bfloat16",
    ),
    Case(
        "asym_v1",
        "4-bit g32 asymmetric (sym false) Llama, v1 zeros (checkpoint_format gptq)",
        "llama",
        dict(bits=4, group_size=32, sym=False),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"),
    ),
    Case(
        "asym_v2",
        "4-bit g32 asymmetric (sym false) Llama, v2 zeros (checkpoint_format gptq_v2)",
        "llama",
        dict(bits=4, group_size=32, sym=False, format="gptq_v2"),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"),
    ),
    Case(
        "int8",
        "8-bit g32 symmetric Llama",
        "llama",
        dict(bits=8, group_size=32),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"),
    ),
    Case(
        "int8_asym",
        "8-bit g64 asymmetric (sym false) Llama, v1 zeros",
        "llama",
        dict(bits=8, group_size=64, sym=False),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"),
    ),
)


def stored_scales_dtype(quantized_dir: Path):
    """The torch dtype of the checkpoint's ``.scales`` tensors (one dtype for all, else an error)."""
    import torch
    from safetensors import safe_open

    dtypes = set()
    for path in sorted(quantized_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            dtypes |= {f.get_slice(key).get_dtype() for key in f.keys() if key.endswith(".scales")}
    if len(dtypes) != 1:
        raise RuntimeError(f"{quantized_dir}: scales dtypes {sorted(dtypes)}, expected exactly one")
    return {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[dtypes.pop()]


def producer_dequant(quantized_dir: Path, layer_names: tuple[str, ...]) -> dict:
    """GPTQModel's own float32 dequantization of ``layer_names`` in the saved checkpoint, as row subsets."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear

    # Load in the stored scales' dtype: GPTQModel's CPU default (bfloat16) would round float16 scales.
    scales_dtype = stored_scales_dtype(quantized_dir)
    loaded = GPTQModel.load(str(quantized_dir), device="cpu", backend=BACKEND.TORCH, dtype=scales_dtype)
    modules = dict(loaded.model.named_modules())
    tensors = {}
    for index, name in enumerate(layer_names):
        module = modules.get(name)
        if not isinstance(module, PackableQuantLinear):
            raise RuntimeError(f"{name}: not a GPTQModel quantized linear after loading ({type(module).__name__})")
        module.scales = module.scales.to(torch.float32)
        with torch.no_grad():
            weight = PackableQuantLinear.dequantize_weight(module).to(torch.float32)
        if tuple(weight.shape) != (module.in_features, module.out_features):
            raise RuntimeError(f"{name}: dequantized shape {tuple(weight.shape)} is not [K, N]")
        tensors.update(fixture_common.reference_entries(name, weight, seed=index))
    return tensors


def make_case(case: Case, out_root: Path, work: Path, seed: int) -> Path:
    """Quantize ``case`` with GPTQModel and write its fixture directory; returns it."""
    import gptqmodel
    import torch
    import transformers
    from gptqmodel import GPTQModel, QuantizeConfig

    source, quantized = fixture_common.fresh_work_dirs(work, case.name)
    fixture_common.save_source(source, case.arch, case.intermediate_size, case.dtype, seed)

    config = QuantizeConfig(offload_to_disk=False, **case.quantize)
    model = GPTQModel.load(str(source), config, device="cpu", dtype=getattr(torch, case.dtype))
    token_ids = fixture_common.random_token_ids(seed)
    calibration = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in token_ids]
    model.quantize(calibration, batch_size=1)
    model.save(str(quantized))
    del model

    target = out_root / case.name
    fixture_common.keep_loader_files(quantized, target, KEPT_FILES)

    reference = producer_dequant(target, case.reference_layers)
    fixture_common.save_reference(
        target / "reference_dequant.safetensors",
        reference,
        {
            "producer": "gptqmodel",
            "producer_version": gptqmodel.__version__,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "formula": "W = scales[g_idx] * (q - z), z in GPTQModel's internal v2 form",
            "how": "GPTQModel.load(backend=BACKEND.TORCH, dtype=stored scales dtype), scales upcast to float32, "
            "PackableQuantLinear.dequantize_weight",
            "case": case.name,
            "what": case.what,
        },
    )
    return target


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    return fixture_common.run_cases(argv, __doc__.split("\n\n")[0], CASES, DEFAULT_OUT, make_case)


if __name__ == "__main__":
    raise SystemExit(main())
