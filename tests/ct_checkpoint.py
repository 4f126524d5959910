"""Test helper: compressed-tensors ``pack-quantized`` checkpoints, and the same weights written as GPTQ.

Written from FORMAT.md sections 1 and 9 with a packer of its own (plain shifts over numpy arrays), independent
of ``marlin_convert``: :func:`pack` / :func:`unpack` put ``32 // b`` codes in each int32 word along one axis, low
bits first, the last word zero-filled. :func:`write_compressed_tensors` writes a small synthetic checkpoint
(any bit width, symmetric or not, group or channel, with or without ``weight_g_idx``);
:func:`gptq_twin` rewrites any compressed-tensors checkpoint (a synthetic one or real llm-compressor output) as
the GPTQ v2 checkpoint that holds the same weights: ``qweight`` packed along K from ``weight_packed``'s codes,
``scales = weight_scale.T``, ``qzeros`` packed along N from the zero points (``2^(b-1)`` when symmetric), and
``g_idx`` (``weight_g_idx``, or ``k // g``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marlin_convert.safetensors_io import PlannedTensor, ShardWriter, read_header, read_tensor

NUMPY_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "int32": "I32", "int64": "I64",
               "int8": "I8"}


def pack(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned codes -> int32 words holding ``32 // bits`` of them along ``axis``, code ``i`` of a word in bits
    ``bits * i ..``; a last word that is not full is zero-filled."""
    per_word = 32 // bits
    moved = np.moveaxis(np.asarray(codes, dtype=np.uint64), axis, -1)
    padded = -moved.shape[-1] % per_word
    moved = np.concatenate([moved, np.zeros((*moved.shape[:-1], padded), np.uint64)], axis=-1)
    grouped = moved.reshape(*moved.shape[:-1], -1, per_word)
    shifts = np.arange(per_word, dtype=np.uint64) * np.uint64(bits)
    words = (grouped << shifts).sum(axis=-1).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis))


def unpack(words: np.ndarray, bits: int, axis: int, count: int) -> np.ndarray:
    """The inverse of :func:`pack`: the first ``count`` codes along ``axis`` (int64)."""
    per_word = 32 // bits
    moved = np.moveaxis(words.view(np.uint32).astype(np.int64), axis, -1)
    shifts = np.arange(per_word, dtype=np.int64) * bits
    codes = ((moved[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*moved.shape[:-1], -1)[..., :count]
    return np.ascontiguousarray(np.moveaxis(codes, -1, axis))


def read_all(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (safetensors dtype, raw array) of one safetensors file."""
    header = read_header(path)
    return {name: (info.dtype, read_tensor(header, name)) for name, info in header.tensors.items()}


def write_tensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write ``name -> (safetensors dtype, array of raw values)`` (bfloat16 as its uint16 bits) as one file."""
    writer = ShardWriter(path, [PlannedTensor(name, dtype, array.shape) for name, (dtype, array) in tensors.items()],
                         {"format": "pt"})
    for name, (_, array) in tensors.items():
        writer.record(name, writer.write_array(name, array))
    writer.close()


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values (exact in bfloat16) -> their bfloat16 bits."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@dataclass
class Linear:
    """One synthetic quantized linear: W [N, K] stored as compressed-tensors would, with its own scheme."""

    name: str
    in_features: int
    out_features: int
    bits: int = 4
    group_size: int | None = 128  # None: channel
    symmetric: bool = True
    g_idx: str | None = None  # actorder "group": a "shuffled" or a "trivial" (k // g) weight_g_idx


def scheme(bits: int = 4, group_size: int | None = 128, symmetric: bool = True, **extra) -> dict:
    """A config group's ``weights`` as compressed-tensors 0.19 writes it."""
    return {"actorder": "static", "block_structure": None, "dynamic": False, "group_size": group_size,
            "num_bits": bits, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": None,
            "strategy": "group" if group_size else "channel", "symmetric": symmetric, "type": "int",
            "zp_dtype": None if symmetric else "torch.int8", **extra}


def config_group(targets: list[str], weights: dict | None, **extra) -> dict:
    return {"format": "pack-quantized", "input_activations": None, "output_activations": None, "targets": targets,
            "weights": weights, **extra}


def quantization_config(groups: dict, ignore: list[str] | None = None, **extra) -> dict:
    return {"config_groups": groups, "format": "pack-quantized", "global_compression_ratio": None,
            "ignore": ["lm_head"] if ignore is None else ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": "0.19.0", **extra}


def layer_tensors(linear: Linear, rng: np.random.Generator,
                  scale_dtype: str = "bfloat16") -> dict[str, tuple[str, np.ndarray]]:
    """The stored tensors of one pack-quantized linear, random codes and scales (FORMAT.md section 9)."""
    n, k, bits = linear.out_features, linear.in_features, linear.bits
    group = linear.group_size or k
    groups = -(-k // group)
    codes = rng.integers(0, 1 << bits, size=(n, k))
    scales = rng.uniform(0.001, 0.02, size=(n, groups)).astype(np.float32)
    scales = _bf16_bits(scales) if scale_dtype == "bfloat16" else scales.astype(scale_dtype)
    out = {f"{linear.name}.weight_packed": ("I32", pack(codes, bits, axis=1)),
           f"{linear.name}.weight_scale": (NUMPY_CODES[scale_dtype], scales),
           f"{linear.name}.weight_shape": ("I64", np.array([n, k], dtype=np.int64))}
    if not linear.symmetric:
        zeros = rng.integers(0, 1 << bits, size=(n, groups))
        out[f"{linear.name}.weight_zero_point"] = ("I32", pack(zeros, bits, axis=0))
    if linear.g_idx:
        g_idx = (np.arange(k) // group).astype(np.int32)
        out[f"{linear.name}.weight_g_idx"] = ("I32", rng.permutation(g_idx) if linear.g_idx == "shuffled" else g_idx)
    return out


def write_compressed_tensors(out_dir: Path, linears: list[Linear], config: dict, *, seed: int = 0,
                             scale_dtype: str = "bfloat16", extras: dict | None = None) -> Path:
    """A compressed-tensors checkpoint: ``linears`` as stored by pack-quantized, ``extras`` (name -> (dtype,
    array)) beside them (default: an embedding and an lm_head), config.json with ``config`` as
    ``quantization_config``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for linear in linears:
        tensors.update(layer_tensors(linear, rng, scale_dtype))
    if extras is None:
        extras = {"model.embed_tokens.weight": ("BF16", _bf16_bits(rng.normal(size=(64, 128)))),
                  "lm_head.weight": ("BF16", _bf16_bits(rng.normal(size=(64, 128))))}
    tensors.update(extras)
    write_tensors(out_dir / "model.safetensors", tensors)
    (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "dtype": scale_dtype,
                                                     "quantization_config": config}, indent=2))
    return out_dir


def gptq_twin(source: Path, out_dir: Path) -> Path:
    """The GPTQ v2 checkpoint holding the same weights as the compressed-tensors checkpoint ``source`` (each
    layer's bits and group size read from its stored tensors and its config group's ``weights``): every
    other tensor as it is, ``weight_shape`` dropped, config.json with a GPTQ ``quantization_config``."""
    source, out_dir = Path(source), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    assert len(groups) == 1, "one scheme per twin: GPTQ's global settings"
    weights = next(iter(groups.values()))["weights"]
    bits, symmetric = weights["num_bits"], weights["symmetric"]
    group_size = weights["group_size"] if weights["strategy"] == "group" else -1
    stored = read_all(source / "model.safetensors")
    prefixes = [name[: -len(".weight_packed")] for name in stored if name.endswith(".weight_packed")]
    tensors = {name: value for name, value in stored.items()
               if not name.rpartition(".")[0] in prefixes}
    for prefix in prefixes:
        n, k = (int(v) for v in stored[f"{prefix}.weight_shape"][1])
        codes = unpack(stored[f"{prefix}.weight_packed"][1], bits, axis=1, count=k)  # [N, K]
        scale_dtype, scales = stored[f"{prefix}.weight_scale"]
        groups_k = scales.shape[1]
        if symmetric:
            zeros = np.full((n, groups_k), 1 << (bits - 1))
        else:
            zeros = unpack(stored[f"{prefix}.weight_zero_point"][1], bits, axis=0, count=n)  # [N, G]
        if f"{prefix}.weight_g_idx" in stored:
            g_idx = stored[f"{prefix}.weight_g_idx"][1]
        else:
            g_idx = (np.arange(k) // (k if group_size == -1 else group_size)).astype(np.int32)
        tensors[f"{prefix}.qweight"] = ("I32", pack(codes.T, bits, axis=0))
        tensors[f"{prefix}.qzeros"] = ("I32", pack(zeros.T, bits, axis=1))
        tensors[f"{prefix}.scales"] = (scale_dtype, np.ascontiguousarray(scales.T))
        tensors[f"{prefix}.g_idx"] = ("I32", g_idx)
    write_tensors(out_dir / "model.safetensors", tensors)
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                     "sym": symmetric, "desc_act": any(f"{p}.weight_g_idx" in stored
                                                                       for p in prefixes),
                                     "checkpoint_format": "gptq_v2", "lm_head": "lm_head" in prefixes}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def assert_same_tensors(out: Path, twin: Path) -> dict[str, np.ndarray]:
    """Every tensor of the converted directory ``out`` equals the one of the same name in ``twin``, dtype and bytes,
    and neither has one the other lacks. Returns ``out``'s tensors."""
    from decode_output import all_tensors

    tensors, twin_tensors = all_tensors(Path(out)), all_tensors(Path(twin))
    assert sorted(tensors) == sorted(twin_tensors)
    for name, array in tensors.items():
        assert array.dtype == twin_tensors[name].dtype and array.tobytes() == twin_tensors[name].tobytes(), name
    return tensors
