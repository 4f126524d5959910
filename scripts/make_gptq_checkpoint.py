#!/usr/bin/env python3
"""Generate realistic GPTQ safetensors checkpoints with random weights, for tests and benchmarks.

    python scripts/make_gptq_checkpoint.py /tmp/tiny --preset tiny
    python scripts/make_gptq_checkpoint.py /tmp/llama7b --preset llama-7b --shards 4          # ~3.9 GB
    python scripts/make_gptq_checkpoint.py /tmp/qwen --preset qwen3-moe --experts 16 --stacked --act-order
    python scripts/make_gptq_checkpoint.py /tmp/padded --hidden 1000 --intermediate 1000    # shapes that don't tile

Importable too (``tests/conftest.py`` puts ``scripts/`` on ``sys.path``)::

    from make_gptq_checkpoint import tiny_llama, write_checkpoint
    write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, shards=2, group_size=64))

What is written is the GPTQ layout as GPTQ tools store it. Per quantized linear with prefix ``P``
(``K`` = in_features, ``N`` = out_features, ``b`` = bits, ``p = 32 / b``, ``G = ceil(K / g)`` groups; K must
divide by p, N need not, g need not divide K):

    P.qweight  int32        [K/p, N]        uniformly random codes (random 32-bit words are valid random codes)
    P.qzeros   int32        [G, ceil(N/p)]  symmetric: 2**(b-1) - 1 everywhere (v1) or 2**(b-1) (v2); asymmetric:
                                            random true zero points, stored minus 1 (v1: 0..2**b - 2) or as
                                            they are (v2: 0..2**b - 1); unused high slots of the last word 0
    P.scales   scale_dtype  [G, N]          uniform in [0.001, 0.02)
    P.g_idx    int32        [K]             k // g, or with act_order a shuffled assignment of g rows per group
                                            (the last group K - (G-1)*g)
    P.bias     float16      [N]             only when the spec asks for it

Each linear takes the checkpoint's bits, group size and sym unless its :class:`LinearSpec` sets its own; the
``dynamic`` rules written to the config (GPTQModel's per-module overrides) are the spec's ``dynamic`` verbatim,
so a test states both sides and can make them agree or not. :func:`with_quantized_lm_head` turns ``lm_head``
into an 8-bit g32 linear with the rule GPTQModel writes for it.

Stacked experts (``num_experts > 0``) get a leading ``[E, ...]`` dimension on all five. Every tensor is drawn
from its own generator seeded by ``(seed, sha256(name))``, so the values do not depend on the shard count and
the same spec always gives the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from marlin_convert import layout  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
ZERO_FORMATS = ("v1", "v2")
CHECKPOINT_FORMAT_LABELS = ("gptq", "gptq_v2")
CONFIG_LOCATIONS = ("config", "quantize_config", "both")
SUPPORTED_BITS = (2, 4, 8)  # 3-bit packs 32 values across three words; not generated here
SCALE_RANGE = (0.001, 0.02)


@dataclass
class LinearSpec:
    """One GPTQ-quantized linear layer: tensors ``{name}.qweight`` etc."""

    name: str  # prefix P, e.g. "model.layers.0.self_attn.q_proj"
    in_features: int  # K
    out_features: int  # N
    bias: bool = False
    num_experts: int = 0  # > 0: stacked 3-D tensors [E, ...] under the same names
    bits: int | None = None  # None: the checkpoint's
    group_size: int | None = None  # None: the checkpoint's
    sym: bool | None = None  # None: the checkpoint's


@dataclass
class TensorSpec:
    """A tensor that is not quantized (embeddings, norms, lm_head, router gate)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float16" | "bfloat16" | "float32"


@dataclass
class CheckpointSpec:
    linears: list[LinearSpec]
    extras: list[TensorSpec]
    bits: int = 4
    group_size: int = 128  # -1 = channelwise
    act_order: bool = False  # non-trivial g_idx: exactly g rows per group, shuffled
    desc_act_label: bool | None = None  # what the config says; None = same as act_order
    sym: bool = True
    zero_format: str = "v1"  # "v1" stores z - 1 (7 for symmetric 4-bit), "v2" stores z (8)
    checkpoint_format_label: str | None = None  # None = omit the key, else "gptq" or "gptq_v2"
    scale_dtype: str = "float16"
    shards: int = 1
    config_location: str = "both"  # "config" | "quantize_config" | "both"
    include_g_idx: bool = True
    model_type: str = "llama"
    extra_files: bool = True  # tokenizer.json, tokenizer_config.json, generation_config.json
    seed: int = 0
    config_extra: dict = field(default_factory=dict)  # more config.json keys (presets: sizes, architectures)
    dynamic: dict | None = None  # GPTQModel per-module rules, written to the quantization config as given
    quantization_extra: dict = field(default_factory=dict)  # more quantization config keys (format, lm_head, ...)


def layer_settings(lin: LinearSpec, spec: CheckpointSpec) -> tuple[int, int, bool]:
    """(bits, group_size, sym) of one linear: its own where set, else the checkpoint's."""
    return (spec.bits if lin.bits is None else lin.bits, spec.group_size if lin.group_size is None else lin.group_size,
            spec.sym if lin.sym is None else lin.sym)


# ----------------------------------------------------------------------------------------------------------
# tensors


def _rng(seed: int, name: str) -> np.random.Generator:
    """A generator of its own for every tensor name, so the values do not depend on shard layout or order."""
    digest = np.frombuffer(hashlib.sha256(name.encode()).digest()[:16], dtype="<u4")
    return np.random.default_rng(np.random.SeedSequence([seed, *digest.tolist()]))


def _random_words(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniformly random int32 words of ``shape``, generated 64 bits at a time (about 0.4 s per GB)."""
    count = math.prod(shape)
    wide = rng.integers(0, 2**64 - 1, size=(count + 1) // 2, dtype=np.uint64, endpoint=True)
    return wide.astype("<u8", copy=False).view("<i4")[:count].astype(np.int32, copy=False).reshape(shape)


def _pack_along_last(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``values`` uint8 ``[..., M]`` into int32 ``[..., ceil(M*bits/32)]``, low bits first; the slots past M
    in the last word are 0."""
    per_word = 32 // bits
    m = values.shape[-1]
    padded = np.zeros((*values.shape[:-1], -(-m // per_word) * per_word), dtype=np.uint32)
    padded[..., :m] = values
    grouped = padded.reshape(*values.shape[:-1], -1, per_word)
    words = np.zeros(grouped.shape[:-1], dtype=np.uint32)
    for i in range(per_word):
        words |= grouped[..., i] << np.uint32(bits * i)
    return words.view(np.int32)


def num_groups(in_features: int, group_size: int) -> int:
    """Rows of ``scales``/``qzeros``: ``ceil(K / g)`` as GPTQ writers compute it (1 when channelwise)."""
    return 1 if group_size == -1 else -(-in_features // group_size)


def _balanced_g_idx(rng: np.random.Generator, k: int, group_size: int) -> np.ndarray:
    """Act-order g_idx: exactly ``g`` rows per group (the last group takes the remainder), shuffled until it is
    not the trivial ``k // g`` (impossible only with a single group)."""
    g = k if num_groups(k, group_size) == 1 else group_size
    trivial = layout.trivial_g_idx(k, g)
    g_idx = trivial.copy()
    if num_groups(k, group_size) > 1:
        while np.array_equal(g_idx, trivial):
            g_idx = rng.permutation(trivial)
    return g_idx.astype(np.int32)


def _validate(spec: CheckpointSpec) -> None:
    for bits, group_size, _ in [(spec.bits, spec.group_size, None)] + [layer_settings(x, spec) for x in spec.linears]:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits = {bits} is not generated (supported: {SUPPORTED_BITS})")
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"group_size = {group_size} must be positive or -1 (channelwise)")
    if spec.zero_format not in ZERO_FORMATS:
        raise ValueError(f"zero_format = {spec.zero_format!r} must be one of {ZERO_FORMATS}")
    if spec.checkpoint_format_label not in (None, *CHECKPOINT_FORMAT_LABELS):
        raise ValueError(f"checkpoint_format_label = {spec.checkpoint_format_label!r} must be None or one of "
                         f"{CHECKPOINT_FORMAT_LABELS}")
    if spec.config_location not in CONFIG_LOCATIONS:
        raise ValueError(f"config_location = {spec.config_location!r} must be one of {CONFIG_LOCATIONS}")
    for dtype in [spec.scale_dtype] + [t.dtype for t in spec.extras]:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} must be one of {DTYPES}")
    for lin in spec.linears:
        bits = layer_settings(lin, spec)[0]
        if lin.in_features % (32 // bits):
            raise ValueError(f"{lin.name}: K = {lin.in_features} must divide by {32 // bits} to pack {bits}-bit "
                             "values into int32 words")
    if spec.shards < 1:
        raise ValueError(f"shards = {spec.shards} must be at least 1")


def _float_array(rng: np.random.Generator, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(np.float32)


def _to_torch(values: np.ndarray, dtype: str):
    """float32 numpy -> torch tensor of ``dtype`` (torch only for bfloat16, which numpy lacks)."""
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(values))
    return tensor.to(getattr(torch, dtype)) if dtype != "float32" else tensor


def linear_tensors(lin: LinearSpec, spec: CheckpointSpec) -> dict:
    """name -> torch tensor for one quantized linear (stacked when ``lin.num_experts > 0``)."""
    import torch

    k, n = lin.in_features, lin.out_features
    bits, group_size, sym = layer_settings(lin, spec)
    per_word = 32 // bits
    groups = num_groups(k, group_size)
    lead = (lin.num_experts,) if lin.num_experts else ()
    p = lin.name
    out = {}

    out[f"{p}.qweight"] = torch.from_numpy(_random_words(_rng(spec.seed, f"{p}.qweight"), (*lead, k // per_word, n)))

    v1 = spec.zero_format == "v1"
    if sym:
        z = np.full((*lead, groups, n), 2 ** (bits - 1) - (1 if v1 else 0), dtype=np.uint8)
    else:  # true zero points 1..2**b - 1 (v1 cannot store 0) or 0..2**b - 1, stored minus 1 in v1
        z = _rng(spec.seed, f"{p}.qzeros").integers(0, 2 ** bits - (1 if v1 else 0), size=(*lead, groups, n),
                                                    dtype=np.uint8)
    out[f"{p}.qzeros"] = torch.from_numpy(np.ascontiguousarray(_pack_along_last(z, bits)))

    scales = _float_array(_rng(spec.seed, f"{p}.scales"), (*lead, groups, n), *SCALE_RANGE)
    out[f"{p}.scales"] = _to_torch(scales, spec.scale_dtype)

    if spec.include_g_idx:
        rng = _rng(spec.seed, f"{p}.g_idx")
        g = k if groups == 1 else group_size
        if spec.act_order:
            rows = [_balanced_g_idx(rng, k, group_size) for _ in range(lin.num_experts or 1)]
            g_idx = np.stack(rows) if lead else rows[0]
        else:
            g_idx = np.broadcast_to(layout.trivial_g_idx(k, g), (*lead, k))
        out[f"{p}.g_idx"] = torch.from_numpy(np.array(g_idx, dtype=np.int32, order="C"))

    if lin.bias:
        bias = _float_array(_rng(spec.seed, f"{p}.bias"), (*lead, n), -0.1, 0.1)
        out[f"{p}.bias"] = _to_torch(bias, "float16")
    return out


def extra_tensor(t: TensorSpec, spec: CheckpointSpec):
    """A non-quantized tensor: 1-D (norms) near 1, others small normal values."""
    rng = _rng(spec.seed, t.name)
    shape = tuple(t.shape)
    if len(shape) == 1:
        values = 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
    else:
        values = 0.02 * rng.standard_normal(shape, dtype=np.float32)
    return _to_torch(values, t.dtype)


def _linear_bytes(lin: LinearSpec, spec: CheckpointSpec) -> int:
    bits, group_size, _ = layer_settings(lin, spec)
    k, n, per_word = lin.in_features, lin.out_features, 32 // bits
    groups = num_groups(k, group_size)
    scale_bytes = 4 if spec.scale_dtype == "float32" else 2
    total = 4 * (k // per_word) * n + 4 * groups * -(-n // per_word) + scale_bytes * groups * n
    total += 4 * k if spec.include_g_idx else 0
    total += 2 * n if lin.bias else 0
    return total * max(lin.num_experts, 1)


def _extra_bytes(t: TensorSpec) -> int:
    return math.prod(t.shape) * (4 if t.dtype == "float32" else 2)


# ----------------------------------------------------------------------------------------------------------
# sharding

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _units(spec: CheckpointSpec) -> list[list]:
    """Items (LinearSpec or TensorSpec) grouped so that one layer's tensors stay in one shard, in file order:
    non-layer tensors whose name mentions ``embed`` first, then layers by index, then the other non-layer ones
    (final norm, lm_head)."""
    before, layers, after = [], {}, []
    for item in [*spec.linears, *spec.extras]:
        match = _LAYER.search(item.name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(item)
        elif "embed" in item.name:
            before.append([item])
        else:
            after.append([item])
    return before + [layers[i] for i in sorted(layers)] + after


def _assign_shards(sizes: list[int], shards: int) -> list[int]:
    """Shard index per unit: in order, roughly equal bytes, no shard left empty."""
    if shards > len(sizes):
        raise ValueError(f"shards = {shards} but only {len(sizes)} layer/tensor groups to split across them")
    total = max(sum(sizes), 1)
    assignment, current, filled, done = [], 0, 0, 0
    for i, size in enumerate(sizes):
        empty_ahead = shards - 1 - current
        if filled:
            wanted = min(shards - 1, int((done + size / 2) * shards / total))
            if wanted > current or len(sizes) - i <= empty_ahead:
                current, filled = current + 1, 0
        assignment.append(current)
        filled += 1
        done += size
    return assignment


def shard_file_names(shards: int) -> list[str]:
    if shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]


# ----------------------------------------------------------------------------------------------------------
# configs and side files


def _hidden_size(spec: CheckpointSpec) -> int:
    if "hidden_size" in spec.config_extra:
        return spec.config_extra["hidden_size"]
    features = [lin.in_features for lin in spec.linears]
    return max(set(features), key=features.count) if features else 0


def quantization_config(spec: CheckpointSpec) -> dict:
    config = {
        "quant_method": "gptq",
        "bits": spec.bits,
        "group_size": spec.group_size,
        "desc_act": spec.act_order if spec.desc_act_label is None else spec.desc_act_label,
        "sym": spec.sym,
        "true_sequential": True,
        "static_groups": False,
    }
    if spec.checkpoint_format_label is not None:
        config["checkpoint_format"] = spec.checkpoint_format_label
    if spec.dynamic is not None:
        config["dynamic"] = spec.dynamic
    config.update(spec.quantization_extra)
    return config


def model_config(spec: CheckpointSpec) -> dict:
    torch_dtype = spec.extras[0].dtype if spec.extras else spec.scale_dtype
    config = {"model_type": spec.model_type, "hidden_size": _hidden_size(spec), "torch_dtype": torch_dtype}
    config.update(spec.config_extra)
    if spec.config_location in ("config", "both"):
        config["quantization_config"] = quantization_config(spec)
    return config


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_side_files(out: Path, spec: CheckpointSpec) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    _write_json(out / "tokenizer.json", {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    })
    _write_json(out / "tokenizer_config.json", {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    _write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})


# ----------------------------------------------------------------------------------------------------------
# the writer


def write_checkpoint(out_dir, spec: CheckpointSpec) -> Path:
    """Write ``spec`` as a GPTQ model directory at ``out_dir`` (created; existing files are overwritten).

    One shard's tensors are in memory at a time. Returns the directory as a ``Path``.
    """
    from safetensors.torch import save_file

    _validate(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    units = _units(spec)
    sizes = [sum(_linear_bytes(x, spec) if isinstance(x, LinearSpec) else _extra_bytes(x) for x in unit)
             for unit in units]
    assignment = _assign_shards(sizes, spec.shards)
    files = shard_file_names(spec.shards)
    weight_map, total_size = {}, 0
    for shard, file_name in enumerate(files):
        tensors = {}
        for unit, where in zip(units, assignment):
            if where != shard:
                continue
            for item in unit:
                if isinstance(item, LinearSpec):
                    tensors.update(linear_tensors(item, spec))
                else:
                    tensors[item.name] = extra_tensor(item, spec)
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_size += tensor.numel() * tensor.element_size()
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors

    if spec.shards > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / "model.safetensors.index.json", index)
    _write_json(out / "config.json", model_config(spec))
    if spec.config_location in ("quantize_config", "both"):
        _write_json(out / "quantize_config.json", quantization_config(spec))
    if spec.extra_files:
        _write_side_files(out, spec)
    return out


# ----------------------------------------------------------------------------------------------------------
# presets


def _llama_layer(i: int, hidden: int, intermediate: int, dtype: str) -> tuple[list[LinearSpec], list[TensorSpec]]:
    p = f"model.layers.{i}"
    linears = [LinearSpec(f"{p}.self_attn.{name}", hidden, hidden) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [LinearSpec(f"{p}.mlp.gate_proj", hidden, intermediate),
                LinearSpec(f"{p}.mlp.up_proj", hidden, intermediate),
                LinearSpec(f"{p}.mlp.down_proj", intermediate, hidden)]
    norms = [TensorSpec(f"{p}.input_layernorm.weight", (hidden,), dtype),
             TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), dtype)]
    return linears, norms


def _outer_extras(hidden: int, vocab: int, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    return ([TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype)],
            [TensorSpec("model.norm.weight", (hidden,), dtype), TensorSpec("lm_head.weight", (vocab, hidden), dtype)])


def tiny_llama(num_layers: int = 2, hidden: int = 128, intermediate: int = 256, vocab: int = 512,
               extra_dtype: str = "float16", **kw) -> CheckpointSpec:
    """A Llama-shaped model: q/k/v/o_proj and gate/up/down_proj quantized per layer; embeddings, norms and
    lm_head in ``extra_dtype``. ``kw`` goes to :class:`CheckpointSpec`."""
    linears, extras = [], []
    before, after = _outer_extras(hidden, vocab, extra_dtype)
    extras += before
    for i in range(num_layers):
        layer_linears, norms = _llama_layer(i, hidden, intermediate, extra_dtype)
        linears += layer_linears
        extras += norms
    extras += after
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": num_layers, "vocab_size": vocab}
    config.update(kw.pop("config_extra", {}))
    return CheckpointSpec(linears=linears, extras=extras, model_type="llama", config_extra=config, **kw)


def llama_7b(num_layers: int = 32, **kw) -> CheckpointSpec:
    """Llama-2-7B shapes (hidden 4096, intermediate 11008, vocab 32000): about 3.9 GB with group size 128."""
    return tiny_llama(num_layers=num_layers, hidden=4096, intermediate=11008, vocab=32000, **kw)


def qwen3_moe(num_layers: int = 2, num_experts: int = 128, hidden: int = 2048, expert_intermediate: int = 768,
              stacked: bool = False, vocab: int = 2048, extra_dtype: str = "float16", **kw) -> CheckpointSpec:
    """Qwen3-MoE-shaped layers (Qwen3-30B-A3B: 128 experts, hidden 2048, expert intermediate 768).

    Attention projections are quantized, all ``hidden x hidden`` for simplicity. Experts are per-expert keys
    ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`` or, with ``stacked``, 3-D
    ``mlp.experts.gate_up_proj`` [E, K=hidden, N=2*inter] and ``mlp.experts.down_proj`` [E, K=inter, N=hidden].
    The router ``mlp.gate.weight`` [E, hidden] is not quantized.
    """
    linears, extras = [], []
    before, after = _outer_extras(hidden, vocab, extra_dtype)
    extras += before
    for i in range(num_layers):
        p = f"model.layers.{i}"
        linears += [LinearSpec(f"{p}.self_attn.{n}", hidden, hidden) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if stacked:
            linears += [LinearSpec(f"{p}.mlp.experts.gate_up_proj", hidden, 2 * expert_intermediate,
                                   num_experts=num_experts),
                        LinearSpec(f"{p}.mlp.experts.down_proj", expert_intermediate, hidden, num_experts=num_experts)]
        else:
            for e in range(num_experts):
                q = f"{p}.mlp.experts.{e}"
                linears += [LinearSpec(f"{q}.gate_proj", hidden, expert_intermediate),
                            LinearSpec(f"{q}.up_proj", hidden, expert_intermediate),
                            LinearSpec(f"{q}.down_proj", expert_intermediate, hidden)]
        extras += [TensorSpec(f"{p}.mlp.gate.weight", (num_experts, hidden), extra_dtype),
                   TensorSpec(f"{p}.input_layernorm.weight", (hidden,), extra_dtype),
                   TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), extra_dtype)]
    extras += after
    config = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden, "num_hidden_layers": num_layers,
              "num_experts": num_experts, "moe_intermediate_size": expert_intermediate, "vocab_size": vocab}
    config.update(kw.pop("config_extra", {}))
    return CheckpointSpec(linears=linears, extras=extras, model_type="qwen3_moe", config_extra=config, **kw)


def mixtral_like(num_layers: int = 1, num_experts: int = 8, hidden: int = 256, intermediate: int = 512,
                 vocab: int = 512, extra_dtype: str = "float16", **kw) -> CheckpointSpec:
    """Mixtral names: ``model.layers.{i}.block_sparse_moe.experts.{e}.w1|w2|w3`` (w1, w3: hidden -> inter;
    w2: inter -> hidden) and the router ``block_sparse_moe.gate.weight`` [E, hidden], not quantized."""
    linears, extras = [], []
    before, after = _outer_extras(hidden, vocab, extra_dtype)
    extras += before
    for i in range(num_layers):
        p = f"model.layers.{i}"
        linears += [LinearSpec(f"{p}.self_attn.{n}", hidden, hidden) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        for e in range(num_experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            linears += [LinearSpec(f"{q}.w1", hidden, intermediate), LinearSpec(f"{q}.w2", intermediate, hidden),
                        LinearSpec(f"{q}.w3", hidden, intermediate)]
        extras += [TensorSpec(f"{p}.block_sparse_moe.gate.weight", (num_experts, hidden), extra_dtype),
                   TensorSpec(f"{p}.input_layernorm.weight", (hidden,), extra_dtype),
                   TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), extra_dtype)]
    extras += after
    config = {"architectures": ["MixtralForCausalLM"], "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": num_layers, "num_local_experts": num_experts, "vocab_size": vocab}
    config.update(kw.pop("config_extra", {}))
    return CheckpointSpec(linears=linears, extras=extras, model_type="mixtral", config_extra=config, **kw)


def with_quantized_lm_head(spec: CheckpointSpec, bits: int = 8, group_size: int = 32) -> CheckpointSpec:
    """``spec`` with the plain ``lm_head.weight`` [vocab, hidden] replaced by a quantized linear ``lm_head``
    (K = hidden, N = vocab) of its own bits and group size, and what GPTQModel writes for it in the config:
    ``lm_head: true`` and the rule ``"lm_head": {"bits": ..., "group_size": ...}`` after any existing rules."""
    head = next(t for t in spec.extras if t.name == "lm_head.weight")
    vocab, hidden = head.shape
    spec.extras = [t for t in spec.extras if t is not head]
    spec.linears.append(LinearSpec("lm_head", hidden, vocab, bits=bits, group_size=group_size))
    spec.dynamic = {**(spec.dynamic or {}), "lm_head": {"bits": bits, "group_size": group_size}}
    spec.quantization_extra = {**spec.quantization_extra, "lm_head": True}
    return spec


# ----------------------------------------------------------------------------------------------------------
# CLI

PRESETS = ("tiny", "llama-7b", "qwen3-moe", "mixtral")


def spec_from_args(args: argparse.Namespace) -> CheckpointSpec:
    kw = dict(shards=args.shards, group_size=args.group_size, act_order=args.act_order, zero_format=args.zero_format,
              checkpoint_format_label=args.label, scale_dtype=args.scale_dtype, extra_dtype=args.extra_dtype,
              seed=args.seed, bits=args.bits, sym=not args.asym)
    if args.layers is not None:
        kw["num_layers"] = args.layers
    if args.vocab is not None:
        if args.preset == "llama-7b":
            raise SystemExit("--vocab does not apply to the llama-7b preset (its vocabulary is 32000)")
        kw["vocab"] = args.vocab
    if args.preset in ("qwen3-moe", "mixtral"):
        if args.experts is not None:
            kw["num_experts"] = args.experts
    elif args.experts is not None:
        raise SystemExit(f"--experts applies to the qwen3-moe and mixtral presets, not {args.preset}")
    if args.stacked and args.preset != "qwen3-moe":
        raise SystemExit(f"--stacked applies to the qwen3-moe preset, not {args.preset}")
    for option, value in (("--layers", args.layers), ("--vocab", args.vocab), ("--experts", args.experts),
                          ("--hidden", args.hidden), ("--intermediate", args.intermediate)):
        if value is not None and value <= 0:  # (0 or -1 layers wrote a checkpoint without a quantized linear)
            raise SystemExit(f"{option} {value}: expected a positive size")
    for option, value in (("--hidden", args.hidden), ("--intermediate", args.intermediate)):
        if value is not None and args.preset == "llama-7b":
            raise SystemExit(f"{option} does not apply to the llama-7b preset (its shapes are Llama-2-7B's)")
    if args.hidden is not None:
        kw["hidden"] = args.hidden
    if args.intermediate is not None:  # (qwen3-moe: each expert's)
        kw["expert_intermediate" if args.preset == "qwen3-moe" else "intermediate"] = args.intermediate
    if args.preset == "tiny":
        spec = tiny_llama(**kw)
    elif args.preset == "llama-7b":
        spec = llama_7b(**kw)
    elif args.preset == "qwen3-moe":
        spec = qwen3_moe(stacked=args.stacked, **kw)
    else:
        spec = mixtral_like(**kw)
    return with_quantized_lm_head(spec) if args.quantized_lm_head else spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="directory to write (created; an existing one must be empty)")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--layers", type=int, help="number of decoder layers (preset default otherwise)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (embed_tokens, lm_head); not for llama-7b")
    parser.add_argument("--experts", type=int, help="experts per MoE layer (qwen3-moe, mixtral)")
    parser.add_argument("--stacked", action="store_true", help="qwen3-moe: stacked 3-D expert tensors")
    parser.add_argument("--hidden", type=int, help="hidden size (preset default otherwise; not for llama-7b): sizes "
                        "that do not divide by 64 / 128 give layers the converter pads, e.g. 1000")
    parser.add_argument("--intermediate", type=int, help="MLP intermediate size (qwen3-moe: each expert's; preset "
                        "default otherwise; not for llama-7b)")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=128, help="-1 = channelwise")
    parser.add_argument("--act-order", action="store_true", help="shuffled, balanced g_idx (desc_act: true)")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--asym", action="store_true", help="asymmetric: random zero points (sym: false)")
    parser.add_argument("--quantized-lm-head", action="store_true",
                        help="quantize lm_head 8-bit g32 with the dynamic rule GPTQModel writes (lm_head: true)")
    parser.add_argument("--zero-format", choices=ZERO_FORMATS, default="v1", help="values stored in qzeros")
    parser.add_argument("--label", choices=CHECKPOINT_FORMAT_LABELS, help="checkpoint_format written to the config")
    parser.add_argument("--scale-dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--extra-dtype", choices=("float16", "bfloat16"), default="float16",
                        help="dtype of the tensors that are not quantized")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # an existing directory with files in it would end up holding two checkpoints' shards and indexes
    if args.out_dir.exists() and (not args.out_dir.is_dir() or any(args.out_dir.iterdir())):
        print(f"Error: {args.out_dir} exists and is not an empty directory: give a new or an empty one",
              file=sys.stderr)
        return 2
    created = not args.out_dir.exists()
    try:
        spec = spec_from_args(args)
        out = write_checkpoint(args.out_dir, spec)
    except ValueError as error:
        if created:  # (nothing half-written is left behind)
            shutil.rmtree(args.out_dir, ignore_errors=True)
        print(f"Error: {error}", file=sys.stderr)
        return 2
    files = sorted(p for p in out.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {out}: {len(spec.linears)} quantized linears, {spec.shards} shard(s), {len(files)} files, "
          f"{total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
