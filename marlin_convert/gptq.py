"""Reading a GPTQ checkpoint: its config, its shards, and one checked plan per quantized linear.

Everything here reads; nothing writes. :func:`open_checkpoint` parses the configs and every shard header and
checks the index; :func:`plan_layers` finds each quantized linear (prefix ``P`` with ``P.qweight``), checks the
shapes and dtypes of its tensors against each other and the config, reads the small tensors (``qzeros``,
``g_idx``) to decide the zero format and act-order, and says whether the layer can become Marlin and, if not,
why. All of that happens before a single byte is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import layout, strict_json
from .errors import InputError
from .safetensors_io import DTYPE_NAMES, SafetensorsFile, TensorInfo, read_header, read_tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"

#: Marlin has a form for these group sizes (plus group size == K, which uses the channelwise layout)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SCALE_DTYPES = ("F16", "BF16", "F32")
#: stored zero point of a symmetric 4-bit layer: v1 stores z - 1, v2 stores z (z = 8)
SYMMETRIC_ZERO = {"v1": 7, "v2": 8}


@dataclass
class QuantConfig:
    """The quantization settings that matter, merged from ``config.json`` and ``quantize_config.json``."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str  # "gptq" (v1) or "gptq_v2"; absent in the files means v1
    sources: list[str]

    @property
    def zero_format_label(self) -> str:
        return "v2" if self.checkpoint_format == "gptq_v2" else "v1"


def _read_json(path: Path) -> dict:
    try:
        data = strict_json.loads(path.read_bytes())
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def load_quant_config(in_dir: Path) -> tuple[QuantConfig, dict | None, dict | None]:
    """Merge the GPTQ settings. Returns ``(config, config_json, quantize_config_json)`` (the raw dicts or None).

    ``quantize_config.json`` wins where both name a key (it is what GPTQ tools write and read).
    """
    config_path, quantize_path = in_dir / CONFIG_FILE, in_dir / QUANTIZE_CONFIG_FILE
    config_json = _read_json(config_path) if config_path.exists() else None
    quantize_json = _read_json(quantize_path) if quantize_path.exists() else None
    merged: dict = {}
    sources: list[str] = []
    if config_json is not None and isinstance(config_json.get("quantization_config"), dict):
        merged.update(config_json["quantization_config"])
        sources.append(f"{CONFIG_FILE}:quantization_config")
    if quantize_json is not None:
        merged.update(quantize_json)
        sources.append(QUANTIZE_CONFIG_FILE)
    if not sources:
        raise InputError(
            f"{in_dir}: no quantization config: neither {CONFIG_FILE} with 'quantization_config' "
            f"nor {QUANTIZE_CONFIG_FILE} found",
            hint="is this a GPTQ checkpoint directory?",
        )
    method = merged.get("quant_method", "gptq")
    if str(method).lower() != "gptq":
        raise InputError(f"{in_dir}: not a GPTQ checkpoint: quant_method is {method!r}")
    if str(merged.get("checkpoint_format", "")).lower() == "marlin" or merged.get("is_marlin_format"):
        raise InputError(f"{in_dir}: already in Marlin format (checkpoint_format says so)")
    try:
        config = QuantConfig(
            bits=int(merged["bits"]),
            group_size=int(merged.get("group_size", -1)),
            desc_act=bool(merged.get("desc_act", False)),
            sym=bool(merged.get("sym", True)),
            checkpoint_format=str(merged.get("checkpoint_format", "gptq")).lower(),
            sources=sources,
        )
    except KeyError as exc:
        raise InputError(f"{in_dir}: quantization config ({', '.join(sources)}) has no {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise InputError(f"{in_dir}: quantization config ({', '.join(sources)}) has a malformed value: {exc}") from exc
    if config.checkpoint_format not in ("gptq", "gptq_v2"):
        raise InputError(f"{in_dir}: unknown checkpoint_format {config.checkpoint_format!r} (expected gptq or gptq_v2)")
    return config, config_json, quantize_json


@dataclass
class Checkpoint:
    """An opened GPTQ directory: configs, shard headers, and where every tensor lives."""

    path: Path
    config: QuantConfig
    config_json: dict | None
    quantize_json: dict | None
    shards: list[SafetensorsFile]
    index_json: dict | None
    location: dict[str, SafetensorsFile] = field(default_factory=dict)

    def info(self, name: str) -> TensorInfo:
        return self.location[name].tensors[name]

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Read one tensor (or, with ``index``, one leading-dimension slice of it)."""
        return read_tensor(self.location[name], name, index)

    @property
    def total_bytes(self) -> int:
        return sum(s.path.stat().st_size for s in self.shards)


def open_checkpoint(in_dir: Path) -> Checkpoint:
    """Open ``in_dir``: configs, the index (if sharded), every shard's header. Raises :class:`InputError`."""
    in_dir = Path(in_dir)
    if not in_dir.is_dir():
        raise InputError(f"{in_dir}: not a directory")
    config, config_json, quantize_json = load_quant_config(in_dir)
    index_path = in_dir / INDEX_FILE
    index_json = None
    if index_path.exists():
        index_json = _read_json(index_path)
        weight_map = _check_index(index_path, index_json)
        shard_names = list(dict.fromkeys(weight_map.values()))
    elif os.path.lexists(in_dir / SINGLE_FILE):
        weight_map, shard_names = None, [SINGLE_FILE]
    else:
        found = sorted(p.name for p in in_dir.glob("*.safetensors"))
        if len(found) != 1:
            what = "no .safetensors file" if not found else f"{len(found)} .safetensors files and no {INDEX_FILE}"
            raise InputError(f"{in_dir}: not a GPTQ safetensors checkpoint: {what}")
        weight_map, shard_names = None, found

    where = index_path if index_json is not None else in_dir
    shards = [read_header(shard_path(in_dir, name, where)) for name in shard_names]
    checkpoint = Checkpoint(in_dir, config, config_json, quantize_json, shards, index_json)
    for shard in shards:
        for name in shard.tensors:
            if name in checkpoint.location:
                raise InputError(f"{shard.path}: tensor '{name}' also appears in {checkpoint.location[name].path.name}")
            checkpoint.location[name] = shard
    if weight_map is not None:
        by_name = {s.path.name: s for s in shards}
        for name, shard_name in weight_map.items():
            if name not in by_name[shard_name].tensors:
                raise InputError(f"{index_path}: maps tensor '{name}' to '{shard_name}', which does not contain it")
        for name, shard in checkpoint.location.items():
            if name not in weight_map:
                raise InputError(f"{index_path}: does not list tensor '{name}' found in {shard.path.name}")
    return checkpoint


def _check_index(index_path: Path, index_json: dict) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name, both strings); ``metadata`` an object if present."""
    weight_map = index_json.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{index_path}: no 'weight_map' object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise InputError(f"{index_path}: 'weight_map' maps tensor '{name}' to {shard!r}, not a file name")
    if not isinstance(index_json.get("metadata", {}), dict):
        raise InputError(f"{index_path}: 'metadata' is a JSON {type(index_json['metadata']).__name__}, not an object")
    return weight_map


def shard_path(directory: Path, name: str, where: Path) -> Path:
    """``directory / name`` for a shard file ``name`` read from ``where`` (an index, a manifest), checked.

    The name must be a plain file name in ``directory`` (no path separator, not ``.`` or ``..``), so nothing
    outside the directory is reached through it. The entry must be a regular file, or a symbolic link to one
    (as in the Hugging Face cache, where snapshot files link to ``../../blobs/<hash>``). Raises
    :class:`InputError` naming ``where`` and the name.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InputError(f"{where}: shard name {name!r} is not a plain file name in {directory}",
                         hint="shards must lie directly in the checkpoint directory")
    path = directory / name
    if not os.path.lexists(path):
        raise InputError(f"{where}: names shard '{name}', which is missing")
    if not path.is_file():
        what = "a broken link" if path.is_symlink() and not path.exists() else "not a regular file"
        raise InputError(f"{where}: shard '{name}' is {what}")
    return path


@dataclass
class LayerPlan:
    """One quantized linear (or one stacked set of experts) and what will become of it.

    ``in_features`` (K) and ``out_features`` (N) are per expert; ``num_experts`` is 0 for a 2-D layer.
    ``convertible`` is False with ``reason`` set when the layer stays in GPTQ form (or stops the run).
    """

    prefix: str
    in_features: int
    out_features: int
    bits: int
    group_size: int  # as the config says (-1 = channelwise)
    num_groups: int
    scale_dtype: str  # safetensors dtype name of the scales
    num_experts: int = 0
    act_order: bool = False
    zero_format: str | None = None  # "v1"/"v2" as decided from the stored values
    has_g_idx: bool = False
    convertible: bool = True
    reason: str | None = None

    def tensor(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    @property
    def effective_group_size(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def source_names(self) -> dict[str, str]:
        names = {"qweight": self.tensor("qweight"), "scales": self.tensor("scales"), "qzeros": self.tensor("qzeros")}
        if self.has_g_idx:
            names["g_idx"] = self.tensor("g_idx")
        return names

    @property
    def workspace_ints(self) -> int:
        return layout.workspace_ints(self.out_features)

    def refuse(self, reason: str) -> None:
        self.convertible = False
        self.reason = reason


def find_quantized_prefixes(checkpoint: Checkpoint) -> list[str]:
    """Prefixes ``P`` of every ``P.qweight`` in the checkpoint, in file order."""
    return [name[: -len(".qweight")] for name in checkpoint.location if name.endswith(".qweight")]


def _expect(checkpoint: Checkpoint, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None) -> TensorInfo:
    if name not in checkpoint.location:
        raise InputError(f"tensor '{name}' is missing (a GPTQ linear needs qweight, qzeros and scales)")
    info = checkpoint.info(name)
    where = checkpoint.location[name].path.name
    if info.dtype not in dtypes:
        wanted = " or ".join(DTYPE_NAMES.get(d, d) for d in dtypes)
        raise InputError(f"{where}: tensor '{name}' has dtype {DTYPE_NAMES.get(info.dtype, info.dtype)}, expected {wanted}")
    if shape is not None and info.shape != shape:
        raise InputError(f"{where}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}")
    return info


def _check_siblings(checkpoint: Checkpoint, prefix: str, suffix: str, num_experts: int, k: int, num_groups: int,
                    group_size: int) -> None:
    """Clearer messages than a bare shape mismatch for the two mistakes seen with experts: a stacked tensor
    whose expert count differs from qweight's, and scales/qzeros whose row count implies another group size."""
    name = f"{prefix}.{suffix}"
    if name not in checkpoint.location:
        return
    shape = checkpoint.info(name).shape
    where = checkpoint.location[name].path.name
    if num_experts and (len(shape) != 3 - (suffix == "g_idx") or shape[0] != num_experts):
        raise InputError(f"{where}: tensor '{name}' has shape {list(shape)}: {shape[0] if shape else 0} experts, "
                         f"but {prefix}.qweight has {num_experts}")
    if suffix in ("scales", "qzeros") and len(shape) >= 2 and shape[-2] != num_groups and shape[-2] > 0 \
            and k % shape[-2] == 0:
        raise InputError(f"{where}: tensor '{name}' has {shape[-2]} rows: that is group size {k // shape[-2]} "
                         f"for K = {k}, but the config says {group_size} ({num_groups} rows)")


def plan_layer(checkpoint: Checkpoint, prefix: str) -> LayerPlan:
    """Check one quantized linear against its config and siblings; decide zero format and act-order.

    Raises :class:`InputError` for a malformed layer (inconsistent shapes, wrong dtypes, bad g_idx). Returns a
    plan with ``convertible=False`` and a reason for a well-formed layer that has no Marlin form.
    """
    config = checkpoint.config
    qweight = _expect(checkpoint, f"{prefix}.qweight", ("I32",), None)
    where = checkpoint.location[qweight.name].path.name
    if len(qweight.shape) not in (2, 3):
        raise InputError(f"{where}: tensor '{qweight.name}' has shape {list(qweight.shape)}, expected 2-D or 3-D")
    stacked = len(qweight.shape) == 3
    lead = qweight.shape[:1] if stacked else ()
    num_experts = qweight.shape[0] if stacked else 0
    if config.bits not in (2, 3, 4, 8):
        raise InputError(f"{checkpoint.path}: quantization config says bits = {config.bits}; GPTQ has 2, 3, 4 or 8")
    pack = 32 // config.bits if config.bits != 3 else None
    rows, n = qweight.shape[-2:]
    k = rows * pack if pack else rows * 32 // 3
    group = k if config.group_size == -1 else config.group_size
    if group <= 0 or k % group:
        raise InputError(f"layer '{prefix}': group size {config.group_size} does not divide K = {k}")
    num_groups = k // group
    for suffix in ("scales", "qzeros", "g_idx"):
        _check_siblings(checkpoint, prefix, suffix, num_experts, k, num_groups, config.group_size)
    scales = _expect(checkpoint, f"{prefix}.scales", SCALE_DTYPES, (*lead, num_groups, n))
    zero_cols = -(-n // pack) if pack else n * 3 // 32
    _expect(checkpoint, f"{prefix}.qzeros", ("I32",), (*lead, num_groups, zero_cols))
    has_g_idx = f"{prefix}.g_idx" in checkpoint.location
    if has_g_idx:
        _expect(checkpoint, f"{prefix}.g_idx", ("I32",), (*lead, k))
    plan = LayerPlan(
        prefix=prefix,
        in_features=k,
        out_features=n,
        bits=config.bits,
        group_size=config.group_size,
        num_groups=num_groups,
        scale_dtype=scales.dtype,
        num_experts=num_experts,
        has_g_idx=has_g_idx,
    )

    if config.bits != 4:
        plan.refuse(f"{config.bits}-bit weights: only 4-bit has a Marlin form here (8-bit is planned)")
        return plan
    if has_g_idx:
        plan.act_order = _check_g_idx(checkpoint, plan)
    if config.group_size not in SUPPORTED_GROUP_SIZES and group != k:
        plan.refuse(f"group size {config.group_size}: Marlin supports -1, 32, 64, 128 or group size == K")
        return plan
    if k % layout.TILE or n % layout.MIN_N_MULTIPLE:
        plan.refuse(
            f"shape K = {k}, N = {n}: Marlin needs K % {layout.TILE} == 0 and N % {layout.MIN_N_MULTIPLE} == 0"
        )
        return plan
    plan.zero_format = _decide_zero_format(checkpoint, plan)
    if plan.zero_format is None:
        plan.refuse("asymmetric zero points (qzeros hold more than one value): not supported yet")
    return plan


def _check_g_idx(checkpoint: Checkpoint, plan: LayerPlan) -> bool:
    """Read g_idx; raise on values out of range or groups of the wrong size; return True when non-trivial."""
    name = plan.tensor("g_idx")
    g_idx = checkpoint.read(name)
    per_expert = g_idx.reshape(-1, plan.in_features)
    group = plan.effective_group_size
    if per_expert.min() < 0 or per_expert.max() >= plan.num_groups:
        raise InputError(
            f"tensor '{name}': g_idx values must lie in 0..{plan.num_groups - 1}, "
            f"found {int(per_expert.min())}..{int(per_expert.max())}"
        )
    trivial = layout.trivial_g_idx(plan.in_features, group)
    non_trivial = False
    for expert, row in enumerate(per_expert):
        counts = np.bincount(row, minlength=plan.num_groups)
        if (counts != group).any():
            bad = int(np.flatnonzero(counts != group)[0])
            where = f" (expert {expert})" if plan.num_experts else ""
            raise InputError(
                f"tensor '{name}'{where}: g_idx is unbalanced: group {bad} has {int(counts[bad])} rows, "
                f"every group must have {group}"
            )
        non_trivial |= not np.array_equal(row, trivial)
    return non_trivial


def _decide_zero_format(checkpoint: Checkpoint, plan: LayerPlan) -> str | None:
    """Symmetric 4-bit layers store one value everywhere in qzeros: 7 (v1) or 8 (v2). Decide from the values."""
    zeros = layout.unpack_gptq_qzeros(checkpoint.read(plan.tensor("qzeros")).reshape(-1, plan.out_features // 8),
                                      plan.out_features)
    values = np.unique(zeros)
    if values.size != 1:
        return None
    for fmt, value in SYMMETRIC_ZERO.items():
        if values[0] == value:
            return fmt
    return None


def plan_layers(checkpoint: Checkpoint) -> list[LayerPlan]:
    """A :class:`LayerPlan` for every quantized linear, in file order. Raises on the first malformed layer."""
    prefixes = find_quantized_prefixes(checkpoint)
    if not prefixes:
        raise InputError(f"{checkpoint.path}: not a GPTQ checkpoint: no tensor named '*.qweight'")
    return [plan_layer(checkpoint, p) for p in prefixes]
