"""Reading a compressed-tensors checkpoint (llm-compressor's ``pack-quantized``) as GPTQ in another container.

FORMAT.md section 9. For 4 and 8 bits every stored tensor of a pack-quantized linear ``P`` is a GPTQ v2 tensor
transposed: ``P.weight_packed`` int32 [N, K/p] is ``qweight.T`` (codes stored unsigned, the +8 / +128 of a
symmetric layer included), ``P.weight_scale`` [N, G] is ``scales.T``, ``P.weight_zero_point`` int32
[ceil(N/p), G] (asymmetric only) is ``qzeros.T`` holding the true zero points, and ``P.weight_g_idx`` int32 [K]
(actorder "group") is ``g_idx``; ``P.weight_shape`` int64 [2] = [N, K] is bookkeeping. So each layer becomes
the :class:`~marlin_convert.gptq.LayerPlan` a GPTQ v2 layer would be (its spec says ``source_format``
"compressed-tensors", zero format "v2"): :meth:`CompressedTensorsLayer.as_gptq` transposes a tensor when a
worker reads it, and :func:`stored_from_gptq` transposes back for ``verify``.

A layer's scheme comes from the config: ``ignore`` (module names, or ``re:`` regexes matched at the start of
the name) and the ``config_groups`` whose ``targets`` match it, the most specific kind of target first: the
exact module name, then a ``re:`` regex, then a class name such as ``Linear``. A checkpoint does not record
module classes, so a class-name target is taken to match every stored quantized linear; two groups with
different schemes that match a layer equally specifically are an error. Whatever the format expresses that
Marlin cannot (activation quantization, other bit widths, float weights, other scale strategies, layers stored
in another compressed-tensors form) refuses the layer with its reason, as the GPTQ reader refuses 3-bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np

from . import strict_json
from .config_regex import compile_config_regex, config_regex_match
from .errors import InputError
from .fileio import outside_link, read_inside
from .gptq import (CONFIG_FILE, MARLIN_BITS, QUANTIZE_CONFIG_FILE, SCALE_DTYPES, SUPPORTED_GROUP_SIZES, Checkpoint,
                   LayerPlan, ModuleSettings, check_g_idx, check_model_dtype, expect_tensor, num_groups, open_shards,
                   read_json, stored_zeros, typed)
from .safetensors_io import DTYPE_NAMES
from .spec import SCALE_DTYPE_NAMES, QuantSpec

QUANT_METHOD = "compressed-tensors"
PACKED = "pack-quantized"
#: the checkpoint-level format when config groups use different formats (each group then names its own)
MIXED = "mixed-precision"
#: the stored tensor of each role (the GPTQ tensor it is; "shape": weight_shape, which GPTQ has no tensor for)
STORED_KIND = {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_zero_point",
               "g_idx": "weight_g_idx", "shape": "weight_shape"}
ROLE_OF = {kind: role for role, kind in STORED_KIND.items()}
#: roles whose stored tensor is the GPTQ tensor transposed
TRANSPOSED = ("qweight", "scales", "qzeros")
#: a layer's own tensors: kept together when it stays in compressed-tensors form (``weight``: another form's)
LAYER_KINDS = ("weight", *STORED_KIND.values())
ACTORDERS = ("static", "weight", "group")
NEEDS = "a pack-quantized linear needs weight_packed, weight_scale and weight_shape"


# ----------------------------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class WeightScheme:
    """A config group's ``weights``, the keys this reader uses, type-checked. ``strategy`` is "tensor" where the
    config says null; ``actorder`` is None, "static", "weight" or "group" (older configs' true means "group")."""

    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    actorder: str | None

    def describe(self) -> str:
        scales = f"group {self.group_size}" if self.strategy == "group" else self.strategy
        return (f"{self.num_bits}-bit {self.type} {'sym' if self.symmetric else 'asym'} {scales}"
                + (f" actorder {self.actorder}" if self.actorder else ""))


@dataclass(frozen=True)
class ConfigGroup:
    """One entry of ``config_groups``. ``activations`` describes its activation quantization (None when
    ``input_activations`` and ``output_activations`` are null); ``format`` is the group's own, else the
    checkpoint's."""

    name: str
    targets: tuple[str, ...]
    weights: WeightScheme | None
    activations: str | None
    format: str

    def refusal(self) -> str | None:
        """Why the layers of this group have no Marlin form here, or None."""
        weights = self.weights
        if self.format != PACKED:
            return f"compressed-tensors format {json.dumps(self.format)}: only {PACKED} layers are read"
        if self.activations:
            return f"activation quantization ({self.activations}): Marlin takes W4A16 / W8A16, 16-bit activations"
        if weights.type != "int":
            return f"{weights.type} weights ({weights.num_bits}-bit {weights.type}): Marlin takes integer weights"
        if weights.num_bits not in MARLIN_BITS:
            return f"{weights.num_bits}-bit weights: Marlin has 4- and 8-bit forms only"
        if weights.strategy not in ("group", "channel"):
            return f"strategy {json.dumps(weights.strategy)}: Marlin takes one scale per group or per output channel"
        return None


def _target_rank(target: str, module: str, modules: set[str]) -> int | None:
    """How specifically ``target`` matches ``module``: 0 its exact name, 1 a ``re:`` regex, 2 the class name of a
    linear (a capitalised word ending in ``Linear``, as PyTorch's classes are named: ``Linear``; not a module of the
    checkpoint), taken to match every quantized linear; None when it does not match. Another class name
    (``LlamaAttention``: an attention or KV-cache scheme's target) matches no linear; a lowercase word is a module
    name (``lm_head``), even one the checkpoint does not store (a tied lm_head): it matches that module only."""
    if target.startswith("re:"):
        return 1 if config_regex_match(target[3:], module) else None
    if target == module:
        return 0
    linear_class = "." not in target and target[:1].isupper() and target.endswith("Linear")
    return 2 if linear_class and target not in modules else None


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """The ``quantization_config`` of a compressed-tensors checkpoint, type-checked where this reader uses it.
    ``as_read`` keeps it exactly as written (the converted checkpoint's config records it)."""

    format: str
    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...]
    where: str  # the file and section, for messages
    sources: list[str]
    as_read: dict
    source_format: ClassVar[str] = QUANT_METHOD

    def ignored_by(self, module: str) -> str | None:
        """The ``ignore`` entry that names ``module`` (its name, or a ``re:`` regex matching it), or None."""
        for entry in self.ignore:
            if (config_regex_match(entry[3:], module) if entry.startswith("re:") else entry == module):
                return entry
        return None

    def group_for(self, module: str, modules: set[str]) -> ConfigGroup | None:
        """The config group whose targets match ``module`` most specifically (see the module docstring), or None.
        ``modules`` holds every module name of the checkpoint (to tell a name from a class name)."""
        ranked = []
        for group in self.groups:
            ranks = [rank for target in group.targets
                     if (rank := _target_rank(target, module, modules)) is not None]
            if ranks:
                ranked.append((min(ranks), group))
        if not ranked:
            return None
        best = min(rank for rank, _ in ranked)
        chosen = [group for rank, group in ranked if rank == best]
        if len({(group.weights, group.activations, group.format) for group in chosen}) > 1:
            names = ", ".join(f"'{group.name}'" for group in chosen)
            raise InputError(f"{self.where}: config groups {names} all target module '{module}' with different "
                             "schemes; cannot tell which applies",
                             hint="a class-name target such as Linear is taken to match every quantized linear")
        return chosen[0]

    def defaults(self) -> dict:
        """The global settings as written: the format, the config groups and the ignore list."""
        return {key: self.as_read.get(key) for key in ("format", "config_groups", "ignore")}

    def resolved_defaults(self) -> dict:
        """The global settings as ``inspect``'s plan shows them: as written (each layer's scheme is resolved from
        its config group, not from a global default)."""
        return self.defaults()

    def describe(self) -> str:
        """One line for people: the format, each config group's scheme and targets, the ignore list."""
        groups = "; ".join(f"{group.name} ({group.weights.describe() if group.weights else 'no weights'}"
                           f"{', activations ' + group.activations if group.activations else ''}) -> "
                           f"{', '.join(group.targets)}" for group in self.groups)
        ignore = f"; ignore {', '.join(self.ignore)}" if self.ignore else ""
        return f"config: compressed-tensors {self.format}: {groups}{ignore}"


def _present(value: dict, key: str, kind: type, where: str, default=None, *, null: bool = False):
    """``value[key]`` type-checked (``default`` when absent; null allowed only with ``null``)."""
    if key not in value:
        return default
    if value[key] is None and null:
        return None
    return typed(value[key], kind, key, where)


def _weights(value, where: str) -> WeightScheme | None:
    if value is None:
        return None
    typed(value, dict, "weights", where)
    where = f"{where} weights"
    if "num_bits" not in value:
        raise InputError(f"{where}: no 'num_bits'")
    bits = typed(value["num_bits"], int, "num_bits", where)
    if not 1 <= bits <= 16:
        raise InputError(f"{where}: 'num_bits' is {bits}; expected 1 to 16")
    strategy = _present(value, "strategy", str, where, "tensor", null=True) or "tensor"
    group_size = _present(value, "group_size", int, where, null=True)
    if strategy == "group" and (group_size is None or group_size <= 0):
        raise InputError(f"{where}: strategy \"group\" needs a positive 'group_size', found {json.dumps(group_size)}")
    actorder = value.get("actorder")
    if isinstance(actorder, bool):  # older compressed-tensors: true meant what "group" means now
        actorder = "group" if actorder else None
    elif actorder is not None and typed(actorder, str, "actorder", where) not in ACTORDERS:
        raise InputError(f"{where}: 'actorder' is {json.dumps(actorder)}; expected null, "
                         + ", ".join(json.dumps(a) for a in ACTORDERS))
    return WeightScheme(bits, _present(value, "type", str, where, "int"),
                        _present(value, "symmetric", bool, where, True), strategy, group_size, actorder)


def _activations(group: dict, where: str) -> str | None:
    found = []
    for key in ("input_activations", "output_activations"):
        value = group.get(key)
        if value is None:
            continue
        typed(value, dict, key, where)
        strategy = value.get("strategy")
        found.append(f"{key} {value.get('num_bits')}-bit {value.get('type', 'int')}"
                     + (f" {strategy}" if strategy else "") + (" dynamic" if value.get("dynamic") else ""))
    return ", ".join(found) or None


def _regexes(entries: list, key: str, where: str) -> tuple[str, ...]:
    for entry in entries:
        typed(entry, str, f"{key}[]", where)
        if entry.startswith("re:"):
            compile_config_regex(entry[3:], f"{where}: {key} entry {json.dumps(entry)}")
    return tuple(entries)


def detect(in_dir: Path) -> dict | None:
    """``in_dir/config.json`` parsed, when it says ``quant_method: "compressed-tensors"`` (pass it on to
    :func:`open_checkpoint`, which then does not read it again); else None. Anything else (no such file, a file
    that does not parse) is left to the GPTQ reader, whose errors name the problem."""
    path = Path(in_dir) / CONFIG_FILE
    if outside_link(path, Path(in_dir)) is not None:
        return None
    try:
        data = strict_json.loads(read_inside(path)) if path.is_file() else None
    except (OSError, ValueError):
        return None
    section = data.get("quantization_config") if isinstance(data, dict) else None
    method = section.get("quant_method") if isinstance(section, dict) else None
    return data if isinstance(method, str) and method.lower() == QUANT_METHOD else None


def load_config(in_dir: Path, config_json: dict | None = None) -> tuple[CompressedTensorsConfig, dict]:
    """Read and type-check ``config.json``'s compressed-tensors ``quantization_config`` (``config_json``: the file
    already parsed, as :func:`detect` returns it). Returns ``(config, config_json)``. Raises :class:`InputError`
    naming the file and key, or what the checkpoint holds that this reader does not read (another checkpoint-level
    format, sparsity, transforms, uncompressed weights)."""
    path = Path(in_dir) / CONFIG_FILE
    if config_json is None:
        config_json = read_json(path)
    check_model_dtype(config_json, path)
    where = f"{path} (quantization_config)"
    section = typed(config_json["quantization_config"], dict, "quantization_config", str(path))
    quantize_path = Path(in_dir) / QUANTIZE_CONFIG_FILE
    if os.path.lexists(quantize_path):  # a broken link is an error (read_json says so), not an absent file
        other = read_json(quantize_path).get("quant_method", "gptq")
        if not isinstance(other, str) or other.lower() != str(section["quant_method"]).lower():
            raise InputError(f"{path} says quant_method {json.dumps(section['quant_method'])}, {quantize_path} says "
                             f"{json.dumps(other)}: which format is this checkpoint?")
    fmt = _present(section, "format", str, where)
    if fmt not in (PACKED, MIXED):
        raise InputError(f"{where}: compressed-tensors format {json.dumps(fmt)}: marlin-convert reads {PACKED} "
                         "(W4A16 / W8A16) checkpoints only")
    status = _present(section, "quantization_status", str, where, "compressed")
    if status != "compressed":
        raise InputError(f"{where}: quantization_status is {json.dumps(status)}: the weights are not compressed")
    sparsity = _present(section, "sparsity_config", dict, where, {}, null=True) or {}
    if sparsity.get("format", "dense") != "dense":
        raise InputError(f"{where}: sparsity_config format {json.dumps(sparsity.get('format'))}: sparse "
                         "checkpoints are not read")
    if _present(section, "transform_config", dict, where, {}, null=True):
        raise InputError(f"{where}: transform_config is set: transformed (rotated) weights need their transforms at "
                         "run time, which a Marlin checkpoint cannot carry")
    groups, ignore = _groups_and_ignore(section, where, fmt)
    config = CompressedTensorsConfig(fmt, groups, ignore, where, [f"{CONFIG_FILE}:quantization_config"],
                                     section)
    return config, config_json


def config_from_defaults(defaults: dict, where: str) -> CompressedTensorsConfig:
    """The config groups and ignore list of a compressed-tensors config as a converted checkpoint's manifest records
    them (``quantization_defaults``: ``format``, ``config_groups``, ``ignore``), checked as :func:`load_config` checks
    them. Raises :class:`InputError`."""
    fmt = _present(defaults, "format", str, where)
    groups, ignore = _groups_and_ignore(defaults, where, fmt)
    return CompressedTensorsConfig(fmt, groups, ignore, where, [where], defaults)


def _groups_and_ignore(section: dict, where: str, fmt: str) -> tuple[tuple[ConfigGroup, ...], tuple[str, ...]]:
    groups_json = _present(section, "config_groups", dict, where, {})
    if not groups_json:
        raise InputError(f"{where}: no 'config_groups'")
    groups = []
    for name, group in groups_json.items():
        group_where = f"{where}: config group {json.dumps(name)}"
        typed(group, dict, "value", group_where)
        targets = _regexes(_present(group, "targets", list, group_where, []), "targets", group_where)
        if not targets:
            raise InputError(f"{group_where}: no 'targets'")
        groups.append(ConfigGroup(name, targets, _weights(group.get("weights"), group_where),
                                  _activations(group, group_where), _present(group, "format", str, group_where, fmt,
                                                                             null=True) or fmt))
    ignore = _regexes(_present(section, "ignore", list, where, [], null=True) or [], "ignore", where)
    return tuple(groups), ignore


def open_checkpoint(in_dir: Path, config_json: dict | None = None) -> Checkpoint:
    """Open the compressed-tensors checkpoint ``in_dir``: its config (``config_json``: config.json already parsed,
    as :func:`detect` returns it) and every shard's header."""
    config, config_json = load_config(in_dir, config_json)
    return open_shards(Path(in_dir), config, config_json, None)


# ----------------------------------------------------------------------------------------------- the layers


@dataclass(frozen=True)
class GroupSettings(ModuleSettings):
    """What the config says about one module: its config group's scheme (``group`` names it, ``where`` the file)."""

    group: str = ""
    where: str = ""

    @property
    def origin(self) -> str:
        return f"config group '{self.group}' in {self.where}"


@dataclass
class CompressedTensorsLayer(LayerPlan):
    """A pack-quantized linear read as its GPTQ v2 equivalent. ``stored`` maps each of the layer's own tensors
    that exists (:data:`LAYER_KINDS`) to its name."""

    stored: dict[str, str] = field(default_factory=dict)

    @property
    def source_names(self) -> dict[str, str]:
        return {kind: self.stored[kind] for kind in ROLE_OF if kind in self.stored}

    @property
    def roles(self) -> dict[str, str]:
        return {ROLE_OF[kind]: name for kind, name in self.source_names.items()}

    @property
    def kept_names(self) -> dict[str, str]:
        return dict(self.stored)

    def as_gptq(self, role: str, stored: np.ndarray) -> np.ndarray:
        return np.swapaxes(stored, -1, -2) if role in TRANSPOSED else stored  # a view: the repack copies anyway

    def source_extras(self) -> dict:
        return {"weight_shape": [self.spec.out_features, self.spec.in_features]}


def stored_from_gptq(kind: str, gptq: Callable[[str], np.ndarray], spec: QuantSpec) -> np.ndarray:
    """The stored tensor ``kind`` of a pack-quantized layer from its GPTQ v2 tensors (``gptq(role)`` gives each):
    a transposed view for weight_packed, weight_scale and weight_zero_point, g_idx itself for weight_g_idx, and
    weight_shape int64 [N, K] from the spec."""
    role = ROLE_OF[kind]
    if role == "shape":
        return np.array([spec.out_features, spec.in_features], dtype="<i8")
    return gptq(role).T if role in TRANSPOSED else gptq(role)


def _logical_shape(checkpoint: Checkpoint, prefix: str, stored: dict[str, str]) -> tuple[int, int]:
    """(N, K) from ``weight_shape``, or, for a layer stored in another form without it, from ``weight`` [N, K]."""
    if "weight_shape" not in stored and "weight" in stored and "weight_packed" not in stored:
        shape = checkpoint.info(stored["weight"]).shape
        if len(shape) == 2 and min(shape) > 0:
            return shape
        raise InputError(f"{checkpoint.location[stored['weight']].path}: tensor '{stored['weight']}' has shape "
                         f"{list(shape)}, expected [N, K]")
    name = stored.get("weight_shape", f"{prefix}.weight_shape")
    expect_tensor(checkpoint, name, ("I64",), (2,), NEEDS)
    n, k = (int(v) for v in checkpoint.read(name))
    if n <= 0 or k <= 0:
        raise InputError(f"{checkpoint.location[name].path}: tensor '{name}' holds [{n}, {k}], expected "
                         "positive [N, K]")
    return n, k


def _refused_shape(checkpoint: Checkpoint, prefix: str, stored: dict[str, str], bits: int) -> tuple[int, int]:
    """(N, K) of a layer whose config group has no Marlin form: from ``weight_shape`` or ``weight`` as for any layer,
    else from ``weight_packed`` [N, K*b/w] and its word size w (int32 words, or the bytes of nvfp4-pack-quantized)."""
    packed = stored.get("weight_packed")
    if packed is not None and "weight_shape" not in stored:
        info = checkpoint.info(packed)
        word_bits = {"I32": 32, "U8": 8, "I8": 8}.get(info.dtype)
        if word_bits and 0 < bits <= word_bits and word_bits % bits == 0 and min(info.shape) > 0:
            return info.shape[0], info.shape[1] * (word_bits // bits)
    return _logical_shape(checkpoint, prefix, stored)


def plan_layer(checkpoint: Checkpoint, prefix: str, stored: dict[str, str], modules: set[str]) -> LayerPlan:
    """Resolve one quantized linear's scheme from the config, check its tensors against it and each other, and
    decide whether Marlin takes it. Raises :class:`InputError` for a malformed layer; returns a refused plan
    (with the reason) for a well-formed layer that has no Marlin form here."""
    config = checkpoint.config
    anchor = stored.get("weight_packed") or stored["weight_scale"]
    ignored = config.ignored_by(prefix)
    if ignored is not None:
        raise InputError(f"layer '{prefix}': ignore entry {json.dumps(ignored)} in {config.where} says this module "
                         f"is not quantized, but '{anchor}' is stored")
    group = config.group_for(prefix, modules)
    if group is None:
        raise InputError(f"layer '{prefix}': '{anchor}' is stored, but no config group in {config.where} targets "
                         "this module")
    scheme = group.weights
    if scheme is None:
        raise InputError(f"layer '{prefix}': config group '{group.name}' quantizes no weights, but '{anchor}' is "
                         "stored")
    packed = "weight_packed" in stored
    if not packed and group.format == PACKED:
        raise InputError(f"layer '{prefix}': config group '{group.name}' is {PACKED}, but '{prefix}.weight_packed' "
                         f"is missing ({NEEDS})")
    if packed and len(checkpoint.info(stored["weight_packed"]).shape) != 2:
        shape = list(checkpoint.info(stored["weight_packed"]).shape)
        raise InputError(f"{checkpoint.location[anchor].path}: tensor '{anchor}' has shape {shape}, expected "
                         "[N, K*b/32] (compressed-tensors stores experts one 2-D tensor each)")
    reason = group.refusal()
    scale_name = stored.get("weight_scale", f"{prefix}.weight_scale")
    if reason is None:
        n, k = _logical_shape(checkpoint, prefix, stored)
        scale_dtype = DTYPE_NAMES[expect_tensor(checkpoint, scale_name, SCALE_DTYPES, None, NEEDS).dtype]
    else:  # kept as stored: only its shape is described, whatever the group's own form (nvfp4 has no weight_shape)
        n, k = _refused_shape(checkpoint, prefix, stored, scheme.num_bits)
        scale_dtype = DTYPE_NAMES.get(checkpoint.info(scale_name).dtype) if scale_name in checkpoint.location else None
    group_size = scheme.group_size if scheme.strategy == "group" else -1
    settings = GroupSettings(scheme.num_bits, group_size, scheme.symmetric, scheme.actorder == "group",
                             group=group.name, where=config.where)
    has_g_idx = "weight_g_idx" in stored

    def layer(act_order: bool = False) -> CompressedTensorsLayer:
        # (a kept layer's scales may be of a dtype no converted layer has, fp8 say: its plan says so in
        # stored_scale_dtype, and its spec, which only describes it, takes float32)
        known = scale_dtype in SCALE_DTYPE_NAMES
        spec = QuantSpec.create(bits=scheme.num_bits, group_size=group_size, sym=scheme.symmetric, zero_format="v2",
                                act_order=act_order, in_features=k, out_features=n,
                                scale_dtype=scale_dtype if known else "float32", source_format=QUANT_METHOD)
        return CompressedTensorsLayer(prefix, spec, settings, has_g_idx, stored=stored,
                                      stored_scale_dtype=None if known else scale_dtype)

    if reason is not None:
        plan = layer()
        plan.refuse(reason)
        return plan
    bits = scheme.num_bits
    p = 32 // bits
    groups = num_groups(k, group_size)
    where = f"[N, K*b/32] for [N, K] = [{n}, {k}] (weight_shape) and {bits} bits"
    expect_tensor(checkpoint, stored["weight_packed"], ("I32",), (n, -(-k // p)), NEEDS, where)
    expect_tensor(checkpoint, scale_name, SCALE_DTYPES, (n, groups), NEEDS,
                  f"[N, G] for K = {k} and {scheme.describe()} (config group '{group.name}')")
    zero_name = f"{prefix}.weight_zero_point"
    if scheme.symmetric and zero_name in checkpoint.location:
        raise InputError(f"layer '{prefix}': config group '{group.name}' is symmetric, but '{zero_name}' is stored")
    if not scheme.symmetric:
        expect_tensor(checkpoint, zero_name, ("I32",), (-(-n // p), groups),
                      f"config group '{group.name}' is asymmetric (symmetric: false), so each layer needs its zero "
                      "points, weight_zero_point",
                      f"[ceil(N/{p}), G]: asymmetric zero points packed along N")
    if has_g_idx:
        expect_tensor(checkpoint, stored["weight_g_idx"], ("I32",), (k,), NEEDS, "[K]")
    elif scheme.actorder == "group":
        raise InputError(f"layer '{prefix}': config group '{group.name}' says actorder \"group\", but "
                         f"'{prefix}.weight_g_idx' is missing")
    if k % p:
        plan = layer()
        plan.refuse(f"K = {k} is not a multiple of {p}: the last word of each row of weight_packed is part "
                    "padding, which GPTQ's packing cannot hold")
        return plan
    plan = layer(check_g_idx(checkpoint, stored["weight_g_idx"], k, group_size, 0) if has_g_idx else False)
    if scheme.symmetric:
        plan.zero_stored = plan.spec.bias  # v2: the true zero point 2^(b-1), the +8 / +128 of the codes
    elif stored_zeros(checkpoint, plan) is None:
        return plan
    if group_size not in SUPPORTED_GROUP_SIZES and not plan.spec.channelwise:
        plan.refuse(f"group size {group_size}: Marlin supports -1, 32, 64, 128 or a group size >= K")
    return plan


def plan_layers(checkpoint: Checkpoint) -> list[LayerPlan]:
    """A plan for every quantized linear (a module with ``weight_packed``, or with ``weight_scale`` in another
    compressed-tensors form), in file order. Raises on the first malformed layer."""
    stored: dict[str, dict[str, str]] = {}
    for name in checkpoint.location:
        prefix, _, kind = name.rpartition(".")
        if kind in LAYER_KINDS:
            stored.setdefault(prefix, {})[kind] = name
    quantized = [prefix for prefix, kinds in stored.items() if "weight_packed" in kinds or "weight_scale" in kinds]
    if not quantized:
        raise InputError(f"{checkpoint.path}: no quantized layer: no tensor named '*.weight_packed'")
    modules = module_names(checkpoint.location)
    return [plan_layer(checkpoint, prefix, stored[prefix], modules) for prefix in quantized]


def module_names(tensor_names) -> set[str]:
    """The modules of a checkpoint, from its tensor names (``P.weight`` -> ``P``): what :meth:`group_for` and
    :func:`not_quantized` tell a module name from a class-name target by."""
    return {name.rpartition(".")[0] for name in tensor_names}


def block_of(module: str) -> str | None:
    """The numbered block ``module`` lies in: its name up to its first all-digit part (``model.layers.0`` of
    ``model.layers.0.mlp.down_proj``), or None (``model.embed_tokens``, ``lm_head``)."""
    parts = module.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else ".".join(parts[:index + 1])


def quantization_of(config: CompressedTensorsConfig, module: str, modules: set[str]) -> tuple[bool, str]:
    """Whether ``config`` quantizes ``module``, and what says so: the ``ignore`` entry that names it (not), else the
    config group that targets it (groups that target it with different schemes, an error for a quantized layer,
    count as quantizing it), else no group (not). ``modules``: every module name of the checkpoint (to tell a module
    name from a class-name target)."""
    entry = config.ignored_by(module)
    if entry is not None:
        return False, f"ignore entry {json.dumps(entry)} in {config.where}"
    try:
        group = config.group_for(module, modules)
    except InputError:
        return True, f"more than one config group in {config.where}"
    if group is None:
        return False, f"no config group in {config.where} targets it"
    return True, f"config group '{group.name}' in {config.where}"


def not_quantized(config: CompressedTensorsConfig, module: str, modules: set[str], blocks: set[str]) -> bool:
    """Whether ``config`` leaves ``module`` (stored as a plain ``.weight``) unquantized as a linear an output config
    must exclude: its ``ignore`` list names it, or no config group targets it (:func:`quantization_of`) and it lies
    in a numbered block that holds a quantized module, one of ``blocks`` (:func:`block_of`; ``model.embed_tokens``
    lies in none)."""
    if config.ignored_by(module) is not None:
        return True
    return block_of(module) in blocks and not quantization_of(config, module, modules)[0]


def quantized_by_config(checkpoint: Checkpoint, modules: list[str]) -> dict[str, tuple[bool, str]]:
    """Per module of ``modules``: whether the config quantizes it, and what says so (:func:`quantization_of`)."""
    names = module_names(checkpoint.location)
    return {module: quantization_of(checkpoint.config, module, names) for module in modules}


def plan_notes(checkpoint: Checkpoint, layers: list[LayerPlan]) -> list[str]:
    """What the reading decided, for the report and the manifest."""
    config = checkpoint.config
    converted = sum(layer.convertible for layer in layers)
    notes = []
    if converted:  # (none: the plan's refusal says why; "0 layer(s) read as ..." would say nothing)
        notes.append(f"compressed-tensors {config.format}: {converted} layer(s) read as GPTQ v2 (weight_packed, "
                     "weight_scale and, where asymmetric, weight_zero_point are GPTQ's qweight, scales and qzeros "
                     "transposed); each weight_shape is recorded in the manifest, not copied")
    if config.ignore:
        notes.append(f"ignore lists {len(config.ignore)} module(s), stored unquantized: passed through")
    if config.as_read.get("kv_cache_scheme"):
        notes.append("kv_cache_scheme: its scales are passed through; the scheme itself is recorded only in the "
                     "output config's source_quantization_config")
    return notes
