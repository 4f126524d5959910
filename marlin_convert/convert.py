"""The conversion pipeline: GPTQ (or compressed-tensors) directory in, Marlin directory out, one tensor at a time.

1. :func:`build_plan` opens the checkpoint, plans and checks every layer (:mod:`marlin_convert.sources`: GPTQ or
   compressed-tensors, both read as GPTQ) and declares every output tensor of every output shard (name, dtype,
   shape, and the job that produces it).
   ``inspect`` / ``--dry-run`` stop here; nothing has been written.
2. :func:`convert` checks OUT_DIR and the other files to copy (:mod:`marlin_convert.outfiles`) and writes into
   a locked temporary sibling of OUT_DIR (:mod:`marlin_convert.outdir`): each shard's header first, then the
   tensors, produced by worker processes (:mod:`marlin_convert.workers`), each job holding one tensor (or one
   expert slice) at a time. Tensors that pass through are copied file-to-file and hashed on the way.
3. Then the configs, the index, the other files (copied and every file hashed, in the workers) and the
   manifest; only when all of that succeeded is the temporary directory moved to OUT_DIR. On any failure or
   interrupt it is removed: no OUT_DIR that looks finished.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import resource
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import __version__, layout
from .compressed_tensors import QUANT_METHOD, block_of, module_names, not_quantized
from .errors import InputError, OutputError, UnsupportedLayerError
from .fileio import name_text
from .gptq import (AUTOROUND_SOURCE_KEYS, CONFIG_FILE, INDEX_FILE, QUANTIZE_CONFIG_FILE, Checkpoint, LayerPlan,
                   QuantConfig, count_layers, is_lm_head, unused_rule_notes, unused_rules, with_unused_rules)
from .experts import (ExpertGroup, expert_group_summary, group_experts, plain_experts, set_problems,
                      stacked_count_problems, stated_expert_count)
from .manifest import (MANIFEST_FILE, MANIFEST_VERSION, MARLIN_KINDS, layer_outputs_names, manifest_digest,
                       write_manifest)
from .outdir import PartialDir, check_free_space, check_out_dir, clear_stale_partials
from .outfiles import output_file_digests, select_extra_files
from .safetensors_io import (DTYPE_NAMES, SHARD_METADATA, PlannedTensor, ShardWriter, TensorInfo,
                             changed_since_read)
from .sources import (KEPT_MODULES_KEYS, SOURCE_CONFIG_KEY, SOURCE_FORMAT_KEY, check_in_dir, open_checkpoint,
                      plan_layers, plan_notes, quantized_by_config)
from .spec import QuantSpec
from .workers import check_workers, run_parallel, usable_cpus

ProgressCallback = Callable[[int], None]
#: worker processes by default: one per core, at most 8 (each holds a few copies of the largest tensor)
DEFAULT_WORKERS = min(8, usable_cpus())
#: safetensors dtype code and bytes per element of each scale dtype a spec names
SCALE_DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}
SCALE_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass
class OutputLayer:
    """One Marlin matrix, or one stacked set of expert matrices, in the output.

    ``plan`` (its spec) gives the per-expert shape and settings. ``members`` lists the per-expert source layers
    when ``--stack-experts`` fuses keys ``<base>.<e>.<projection>`` into one stacked ``<base>.<projection>``.
    """

    prefix: str
    plan: LayerPlan
    members: list[LayerPlan] | None = None

    @property
    def spec(self) -> QuantSpec:
        return self.plan.spec

    @property
    def num_experts(self) -> int:
        return len(self.members) if self.members else self.plan.spec.num_experts

    @property
    def act_order(self) -> bool:
        return any(m.spec.act_order for m in self.sources)

    @property
    def sources(self) -> list[LayerPlan]:
        """The source layers whose tensors this output consumes (the members, or the plan itself)."""
        return self.members or [self.plan]

    def source_bytes(self, kind: str) -> int:
        """Bytes of source tensor ``kind`` ("qweight", "scales" or "qzeros") over all experts of this output."""
        spec = self.spec
        k, n, groups = spec.in_features, spec.out_features, spec.num_groups
        per_expert = {"qweight": k * n * spec.bits // 8, "qzeros": groups * -(-n // spec.pack_factor) * 4,
                      "scales": groups * n * SCALE_ITEMSIZE[spec.scale_dtype]}[kind]
        return per_expert * max(self.num_experts, 1)

    def slices(self) -> list[tuple[LayerPlan, int | None]]:
        """(source layer, leading index) per expert slice in output order; ``[(plan, None)]`` for a 2-D layer."""
        if self.members:
            return [(member, None) for member in self.members]
        if self.plan.spec.num_experts:
            return [(self.plan, e) for e in range(self.plan.spec.num_experts)]
        return [(self.plan, None)]


@dataclass(frozen=True)
class Job:
    """How one output tensor is produced: ``kind`` is "copy", "B", "s", "zp", "perm" or "g_idx"."""

    kind: str
    output: PlannedTensor
    source: TensorInfo | None = None  # for "copy"
    source_path: Path | None = None
    layer: OutputLayer | None = None
    source_identity: tuple | None = None  # for "copy": the source shard as its header was read

    @property
    def input_bytes(self) -> int:
        if self.kind == "copy":
            return self.source.nbytes
        source = {"B": "qweight", "s": "scales", "zp": "qzeros"}.get(self.kind)
        return self.layer.source_bytes(source) if source else 0


@dataclass
class ShardPlan:
    file_name: str
    jobs: list[Job]

    @property
    def outputs(self) -> list[PlannedTensor]:
        return [job.output for job in self.jobs]


@dataclass
class ConversionPlan:
    """Everything :func:`convert` will do, computed from headers and small tensors only."""

    checkpoint: Checkpoint
    layers: list[LayerPlan]
    outputs: list[OutputLayer]
    shards: list[ShardPlan]
    notes: list[str] = field(default_factory=list)

    @property
    def converted(self) -> list[LayerPlan]:
        return [layer for layer in self.layers if layer.convertible]

    @property
    def refused(self) -> list[LayerPlan]:
        return [layer for layer in self.layers if not layer.convertible]

    @property
    def bytes_in(self) -> int:
        return self.checkpoint.total_bytes

    @property
    def tensor_bytes_out(self) -> int:
        return sum(t.nbytes for shard in self.shards for t in shard.outputs)

    @property
    def work_bytes(self) -> int:
        """Bytes the progress bar counts: every source tensor that a job reads or copies."""
        return sum(job.input_bytes for shard in self.shards for job in shard.jobs)

    @functools.cached_property
    def kept_tensor_names(self) -> set[str]:
        """The tensors of the layers kept in their source form (copied unchanged, listed in the manifest's ``kept``)."""
        return {name for layer in self.refused for name in layer.kept_names.values()}

    @property
    def passthrough_tensors(self) -> int:
        """Tensors copied unchanged that belong to no quantized layer: the manifest's ``passthrough``."""
        kept = self.kept_tensor_names
        return sum(job.kind == "copy" and job.output.name not in kept for shard in self.shards for job in shard.jobs)

    @property
    def kept_tensors(self) -> int:
        """Tensors of the layers kept in their source form, copied unchanged (the manifest's ``kept``)."""
        return len(self.kept_tensor_names)

    @property
    def converted_layers(self) -> int:
        """Layers converted, each expert counted as one (as ``verify`` counts them); :attr:`outputs` are fewer
        where experts are stacked."""
        return count_layers(self.converted)

    @property
    def checkpoint_format(self) -> str:
        """"marlin" when every quantized layer is converted, "marlin-partial" when some stay in their source form."""
        return "marlin-partial" if self.refused else "marlin"


def marlin_outputs(layer: OutputLayer) -> dict[str, PlannedTensor]:
    """Declare the Marlin tensors of one output layer (CONTRACT C): name, dtype, padded shape, and a leading E for
    stacked experts. ``B`` int32 [K_pad/16, N_pad*b/2], ``s`` [G, N_pad], ``zp`` int32 [G, N_pad/p] (asymmetric),
    ``perm`` / ``g_idx`` int32 [K_pad] (act-order)."""
    spec = layer.spec
    lead = (layer.num_experts,) if layer.num_experts else ()
    k_pad, n_pad = spec.padded_shape
    names = layer_outputs_names(layer.prefix, layer.act_order, zero_points=not spec.sym)
    out = {
        "B": PlannedTensor(names["B"], "I32", (*lead, k_pad // layout.TILE, n_pad * spec.bits // 2)),
        "s": PlannedTensor(names["s"], SCALE_DTYPE_CODES[spec.scale_dtype], (*lead, spec.num_groups, n_pad)),
    }
    if not spec.sym:
        out["zp"] = PlannedTensor(names["zp"], "I32", (*lead, spec.num_groups, n_pad // spec.pack_factor))
    if layer.act_order:
        out["perm"] = PlannedTensor(names["perm"], "I32", (*lead, k_pad))
        out["g_idx"] = PlannedTensor(names["g_idx"], "I32", (*lead, k_pad))
    return out


def _find_unquantized_experts(groups: list[ExpertGroup], checkpoint: Checkpoint) -> None:
    """Fill in each group's ``unquantized``: the experts of a projection with quantized members that are stored as a
    plain 2-D ``.weight`` instead (:func:`marlin_convert.experts.plain_experts`), with what in the config leaves them
    so. Raises :class:`InputError` for such an expert that the config quantizes (no ``-:`` rule or ``ignore`` entry
    for it): the config contradicts the stored tensors, as a ``-:`` rule on a stored ``qweight`` does."""
    plain = plain_experts(groups, checkpoint.plain_linear_modules())
    for module, (quantized, origin) in (quantized_by_config(checkpoint, list(plain)) if plain else {}).items():
        group, expert, projection = plain[module]
        if quantized:  # (a '-:' rule with a typo leaves it so: the hint names the rules that match nothing)
            raise with_unused_rules(checkpoint, InputError(
                f"layer '{group.base}': expert {expert} of '{projection}' is stored unquantized ('{module}.weight'), "
                f"but {origin} quantizes it",
                hint="say in the config that it is not quantized (GPTQModel: a '-:' dynamic rule; compressed-tensors: "
                     "an ignore entry), or store it quantized"))
        group.unquantized.setdefault(projection, {})[expert] = origin


def _check_expert_sets(groups: list[ExpertGroup], by_prefix: dict[str, LayerPlan], checkpoint: Checkpoint) -> None:
    """Per-expert keys must form complete sets: every projection of a group has experts 0..E-1, each quantized or
    left unquantized by the config (:func:`_find_unquantized_experts`), and E is the number of experts config.json
    states (where it states one: the last experts missing altogether leave no gap to see); stacked 3-D layers hold
    that many too (:func:`marlin_convert.experts.set_problems`, which ``verify`` holds an output to). The experts of a
    set may be quantized differently (``dynamic`` rules): each is converted by its own settings (only
    ``--stack-experts`` needs them alike: :func:`_stack_groups`)."""
    config_path = checkpoint.path / CONFIG_FILE
    stated = stated_expert_count(checkpoint.config_json, config_path)
    stacked = {layer.prefix: layer.spec.num_experts for layer in by_prefix.values() if layer.spec.num_experts}
    problems = stacked_count_problems(stacked, stated, config_path)
    if problems:
        raise InputError(problems[0])
    _find_unquantized_experts(groups, checkpoint)
    for group in groups:
        for problem in set_problems(group, stated, config_path):
            if isinstance(problem, str):
                raise InputError(problem)
            module = f"{group.base}.{problem.experts[0]}.{problem.projection}"
            quantized, origin = quantized_by_config(checkpoint, [module])[module]
            if quantized:
                present = by_prefix[next(iter(next(iter(group.members.values())).values()))]
                # qweight, compressed-tensors' weight_packed, or the stored weight of a layer kept in another form
                stored = present.roles.get("qweight") or present.kept_names.get("weight") or f"{present.prefix}.weight"
                expected = f"no {group.base}.<e>.{problem.projection}.{stored.rsplit('.', 1)[-1]}"
            else:
                expected = f"no {module}.weight, which {origin} leaves unquantized"
            raise InputError(problem.describe(expected))


#: what one stacked tensor needs its experts to share, each with how a message says an expert's value
STACKED_FIELDS = (("bits", lambda spec: f"{spec.bits} bits"),
                  ("group_size", lambda spec: f"group size {spec.group_size}"),
                  ("sym", lambda spec: "symmetric zero points" if spec.sym else "asymmetric zero points"),
                  ("in_features", lambda spec: f"K = {spec.in_features}"),
                  ("out_features", lambda spec: f"N = {spec.out_features}"),
                  ("scale_dtype", lambda spec: f"{spec.scale_dtype} scales"),
                  ("source_format", lambda spec: f"source format {spec.source_format}"))


def _unstackable(group: ExpertGroup, projection: str, members: dict[int, LayerPlan]) -> str | None:
    """Why the experts of ``projection`` in ``group`` cannot share one stacked tensor, or None: every expert must be
    quantized and converted, with one layout (act-order and the stored zero format may differ per expert: perm,
    g_idx and zp are per expert)."""
    where = f"layer '{group.base}': expert"
    unquantized = group.unquantized.get(projection, {})
    if unquantized:
        expert = min(unquantized)
        return (f"{where} {expert} of '{projection}' is not quantized ({unquantized[expert]}; "
                f"'{group.base}.{expert}.{projection}.weight' is stored unquantized)")
    if len(members) < 2:  # one expert: nothing to stack
        return None
    for expert, member in members.items():
        if not member.convertible:
            return (f"{where} {expert} of '{projection}' has no Marlin form ({member.reason}) and stays in its "
                    "source form")
        if member.spec.num_experts:
            return f"{where} {expert} of '{projection}' ('{member.prefix}') is itself stacked, 3-D"
    (first_expert, first), *others = members.items()
    for expert, member in others:
        for name, say in STACKED_FIELDS:
            if getattr(member.spec, name) != getattr(first.spec, name):
                return (f"{where} {expert} of '{projection}' has {say(member.spec)} ({member.settings.origin}), "
                        f"expert {first_expert} has {say(first.spec)} ({first.settings.origin})")
    return None


def _stack_groups(groups: list[ExpertGroup], by_prefix: dict[str, LayerPlan]) -> tuple[list[OutputLayer], set[str]]:
    """``--stack-experts``: one OutputLayer per (expert group, projection), its experts in one stacked tensor. A
    projection of one expert, or one none of whose experts has a Marlin form (all kept in their source form by
    ``--skip-incompatible``), has nothing to stack and stays as it is. Raises :class:`UnsupportedLayerError` naming
    the expert and the reason where a set cannot share one tensor (:func:`_unstackable`)."""
    stacked, taken = [], set()
    for group in groups:
        for projection, per_expert in group.members.items():
            members = {e: by_prefix[per_expert[e]] for e in sorted(per_expert)}
            if not any(member.convertible for member in members.values()):
                continue
            reason = _unstackable(group, projection, members)
            if reason is not None:
                raise UnsupportedLayerError(
                    f"{reason}, so the experts of '{projection}' cannot be stacked",
                    hint="convert without --stack-experts: each expert is then converted by its own settings, one "
                         "left unquantized passed through")
            if len(members) < 2:  # one expert: nothing to stack (its entry keeps the expert's own name)
                continue
            sources = list(members.values())
            stacked.append(OutputLayer(f"{group.base}.{projection}", sources[0], sources))
            taken.update(m.prefix for m in sources)
    return stacked, taken


def _listed(refused: list[LayerPlan]) -> str:
    """The first three refused layers with their reasons, and how many more."""
    listed = "; ".join(f"{layer.prefix}: {layer.reason}" for layer in refused[:3])
    return listed + (f" (and {len(refused) - 3} more)" if len(refused) > 3 else "")


def refusal_error(refused: list[LayerPlan], total: int) -> UnsupportedLayerError:
    """The error that stops a conversion at layers with no Marlin form: some of the ``total`` (without
    ``--skip-incompatible``, which its hint names), or all of them, which stops the run with that option too (the
    output would be the source checkpoint, relabelled), so its hint says the option does not help."""
    if len(refused) == total:
        return UnsupportedLayerError(
            f"none of the {total} quantized layers can be converted: {_listed(refused)}",
            hint="no layer here has a Marlin form, so --skip-incompatible does not help: it keeps some layers in their "
                 "source form while others convert",
        )
    return UnsupportedLayerError(
        f"{len(refused)} of {total} quantized layers cannot be converted: {_listed(refused)}",
        hint="--skip-incompatible keeps such layers in their source form and lists them in the manifest",
    )


def plan_refusal(plan: "ConversionPlan", skip_incompatible: bool) -> UnsupportedLayerError | None:
    """Why the conversion of ``plan`` must stop at its refused layers, or None: any refused layer without
    ``skip_incompatible``; with it, only when every quantized layer is refused (:func:`refusal_error`)."""
    if not plan.refused or (skip_incompatible and len(plan.refused) < len(plan.layers)):
        return None
    return refusal_error(plan.refused, len(plan.layers))


def legacy_loader_notes(layers: list[LayerPlan], stacked: set[str] = frozenset()) -> list[str]:
    """A note when converted layers fall outside what the legacy Marlin loaders know (symmetric 4-bit, fp16 scales,
    group size 128 or -1, no act-order, K a multiple of 128, N of 256 (IST-DASLab's, AutoGPTQ's and TGI's Marlin
    layer; vLLM's took 64), no padding, one 2-D matrix per linear; README, "Who loads
    the output"): the configs say ``checkpoint_format: "marlin"`` all the same (it names the layout), so the note says
    which layers need a reader of the manifest, and why. ``stacked``: prefixes of per-expert layers that
    ``--stack-experts`` writes into stacked 3-D tensors (a stacked source layer is one already)."""
    converted = [layer for layer in layers if layer.convertible]
    outside: list[LayerPlan] = []
    reasons: dict[str, list[LayerPlan]] = {}
    for layer in converted:
        spec = layer.spec
        found = [reason for reason, holds in ((f"{spec.bits}-bit", spec.bits != 4), ("asymmetric", not spec.sym),
                                              (f"{spec.scale_dtype} scales", spec.scale_dtype != "float16"),
                                              (f"group size {spec.group_size}", spec.group_size not in (128, -1)),
                                              ("act-order", spec.act_order),
                                              ("stacked experts", spec.num_experts > 0 or layer.prefix in stacked),
                                              ("K not a multiple of 128", not spec.padded and spec.in_features % 128),
                                              ("N not a multiple of 256", not spec.padded and spec.out_features % 256),
                                              ("padded", spec.padded)) if holds]
        for reason in found:
            reasons.setdefault(reason, []).append(layer)
        if found:
            outside.append(layer)
    if not outside:
        return []
    why = ", ".join(f"{count_layers(members)} {reason}" for reason, members in sorted(reasons.items()))
    return [f"{count_layers(outside)} of {count_layers(converted)} converted layer(s) are outside what "
            "the legacy Marlin loaders take (symmetric 4-bit, fp16 scales, group size 128 or -1, no act-order, K a "
            f"multiple of 128, N of 256, no padding, 2-D): {why}; load them with a reader of the manifest (README: "
            "Who loads the output)"]


def build_plan(in_dir: Path, skip_incompatible: bool = False, stack_experts: bool = False,
               checkpoint: Checkpoint | None = None) -> ConversionPlan:
    """Open and check ``in_dir`` and declare every output tensor. Writes nothing.

    Raises :class:`InputError` for a malformed checkpoint and, unless ``skip_incompatible``,
    :class:`UnsupportedLayerError` naming every layer that has no Marlin form and why. With ``stack_experts``,
    per-expert keys ``<base>.<e>.<projection>`` become one stacked ``<base>.<projection>`` per projection.
    ``checkpoint``: ``in_dir`` opened already (:func:`marlin_convert.sources.open_checkpoint`).
    """
    if checkpoint is None:
        checkpoint = open_checkpoint(Path(in_dir))
    layers = plan_layers(checkpoint)
    by_prefix = {layer.prefix: layer for layer in layers}
    groups, _ = group_experts(list(by_prefix))
    _check_expert_sets(groups, by_prefix, checkpoint)
    refused = [layer for layer in layers if not layer.convertible]
    if refused and not skip_incompatible:
        raise refusal_error(refused, len(layers))
    notes = plan_notes(checkpoint, layers)
    notes += unused_rule_notes(unused_rules(checkpoint))
    outputs, taken = _stack_groups(groups, by_prefix) if stack_experts else ([], set())
    notes += legacy_loader_notes(layers, taken)
    if stack_experts and not groups:
        stacked_already = any(layer.spec.num_experts for layer in layers)
        notes.append("--stack-experts: no per-expert layers here, nothing to stack"
                     + (" (the source's experts are stacked already)" if stacked_already else ""))
    outputs += [OutputLayer(layer.prefix, layer) for layer in layers if layer.convertible and layer.prefix not in taken]

    # Each source tensor of a converted layer is consumed by one output layer (none is copied). The Marlin
    # tensors go to the shards holding the first source's qweight (B, and perm/g_idx when it has no g_idx),
    # scales (s), qzeros (zp) and g_idx: the stored tensors of those roles (LayerPlan.roles).
    role: dict[str, tuple[str, OutputLayer, bool]] = {}
    for output in outputs:
        for position, member in enumerate(output.sources):
            for kind, name in member.roles.items():
                role[name] = (kind, output, position == 0)

    shards = []
    for shard in checkpoint.shards:
        jobs = []
        for name, info in shard.tensors.items():
            if name not in role:
                jobs.append(Job("copy", PlannedTensor(name, info.dtype, info.shape), info, shard.path,
                                source_identity=shard.identity))
                continue
            kind, output, anchor = role[name]
            if not anchor:
                continue  # another expert's tensor: the anchor's jobs read it
            declared = marlin_outputs(output)
            if kind == "qweight":
                jobs.append(Job("B", declared["B"], layer=output))
            if output.act_order and (kind == "g_idx" or (kind == "qweight" and not output.plan.has_g_idx)):
                jobs.append(Job("perm", declared["perm"], layer=output))
                jobs.append(Job("g_idx", declared["g_idx"], layer=output))
            if kind == "scales":
                jobs.append(Job("s", declared["s"], layer=output))
            if kind == "qzeros" and "zp" in declared:
                jobs.append(Job("zp", declared["zp"], layer=output))
            # symmetric qzeros, a trivial g_idx and compressed-tensors' weight_shape carry nothing Marlin needs: the
            # manifest says how to rebuild them
        shards.append(ShardPlan(shard.path.name, jobs))
    _check_outputs(shards)
    return ConversionPlan(checkpoint, layers, outputs, shards, notes)


def _check_outputs(shards: list[ShardPlan]) -> None:
    """Every output tensor name once: a source tensor named like a Marlin output (``P.B`` beside ``P.qweight``)
    would otherwise be written twice under one name; no copied source tensor named like a Marlin tensor of a
    converted layer, even one the layer does not write (``P.zp`` of a symmetric layer, ``P.perm`` without
    act-order): beside ``P.B`` and ``P.s`` a loader would take it for the layer's own; and a converted layer's
    copied ``P.bias`` a float ``[N]`` (``[E, N]`` stacked). Raises :class:`InputError`."""
    made_by: dict[str, Job] = {}
    for shard in shards:
        for job in shard.jobs:
            other = made_by.setdefault(job.output.name, job)
            if other is not job:
                what = [f"the source tensor in {j.source_path}" if j.kind == "copy"
                        else f"the Marlin '{j.kind}' of layer '{j.layer.prefix}'" for j in (other, job)]
                raise InputError(f"output tensor '{job.output.name}' would be written twice: as {what[0]} and as "
                                 f"{what[1]}", hint="rename or remove the colliding tensor in IN_DIR")
    converted = {job.layer.prefix: job.layer for job in made_by.values() if job.kind != "copy"}
    for name, job in made_by.items():
        prefix, _, suffix = name.rpartition(".")
        if job.kind == "copy" and suffix == "bias" and prefix in converted:  # kept as it is, so it must be [N]
            layer = converted[prefix]
            expected = (layer.num_experts, layer.spec.out_features) if layer.num_experts else (layer.spec.out_features,)
            if tuple(job.source.shape) != expected:
                raise InputError(f"{job.source_path}: tensor '{name}' has shape {list(job.source.shape)}, but layer "
                                 f"'{prefix}' has N = {layer.spec.out_features} outputs: its bias must be "
                                 f"{list(expected)}")
            if job.source.dtype not in ("F16", "BF16", "F32"):
                raise InputError(f"{job.source_path}: tensor '{name}' is {job.source.dtype}: the bias of layer "
                                 f"'{prefix}' must be float16, bfloat16 or float32")
        if job.kind == "copy" and suffix in MARLIN_KINDS and prefix in converted:
            raise InputError(f"{job.source_path}: tensor '{name}' is named like a Marlin tensor of layer '{prefix}', "
                             "which is converted: beside its Marlin outputs it would be read as one of them",
                             hint="rename or remove that tensor in IN_DIR")


# --------------------------------------------------------------------------------------------------- jobs


@dataclass
class JobResult:
    """What one job did, sent back from a worker process: source bytes consumed (for progress), bytes written
    per output tensor (for the writer's completeness check), digests of the source tensors it read, and the
    worker's peak RSS so far."""

    consumed: int = 0
    written: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    pid: int = 0
    peak_rss: int = 0


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _padded_g_idx(checkpoint: Checkpoint, layer: LayerPlan, index: int | None) -> np.ndarray:
    """int32 [K_pad]: the stored (or trivial) g_idx of one layer or expert slice, padded rows in the last group."""
    spec = layer.spec
    if layer.has_g_idx:
        g_idx = layer.read_gptq(checkpoint, "g_idx", index)
    else:
        g_idx = layout.trivial_g_idx(spec.in_features, spec.effective_group_size)
    return layout.pad_g_idx(g_idx, spec.padded_in_features, spec.num_groups)


def _true_zeros(qzeros: np.ndarray | None, spec: QuantSpec) -> np.ndarray:
    """uint8 [G, N] zero points of one layer or expert slice: 2^(b-1) when symmetric (``qzeros`` unused), else
    from its stored qzeros int32 [G, ceil(N/p)]: v1 stored + 1, v2 as stored."""
    if spec.sym:
        return np.full((spec.num_groups, spec.out_features), spec.bias, dtype=np.uint8)
    stored = layout.unpack_gptq_qzeros(qzeros, spec.out_features, spec.bits)
    return stored + np.uint8(spec.zero_format == "v1")


def _marlin_weight(checkpoint: Checkpoint, layer: OutputLayer, qweight: np.ndarray, member: LayerPlan,
                   index: int | None) -> np.ndarray:
    """GPTQ qweight int32 [K/p, N] of one slice -> Marlin B int32 [K_pad/16, N_pad*b/2]: zero-padded to the tile
    (padded rows hold the last group's zero point, padded columns 2^(b-1)), rows in act-order when the layer
    has it."""
    spec = member.spec
    if spec.padded:
        k_pad, n_pad = spec.padded_shape
        qzeros = None if spec.sym else member.read_gptq(checkpoint, "qzeros", index)
        last_group_zeros = _true_zeros(qzeros, spec)[-1]
        codes = layout.pad_codes(layout.unpack_gptq_qweight(qweight, spec.bits), k_pad, n_pad, last_group_zeros,
                                 spec.bias)
        qweight = layout.pack_gptq_qweight(codes, spec.bits)
    perm = layout.act_order_perm(_padded_g_idx(checkpoint, member, index))[0] if layer.act_order else None
    return layout.gptq_to_marlin_weight(qweight, perm, bits=spec.bits)


def _marlin_scales(scales: np.ndarray, member: LayerPlan, index: int | None) -> np.ndarray:
    """GPTQ scales [G, N] -> Marlin s [G, N_pad]: padded columns scale 0, then the Marlin scale order. Raises
    :class:`InputError` for a NaN or infinite scale (every weight of its group would be one: a broken checkpoint,
    which a lossless repack would carry on unnoticed)."""
    spec = member.spec
    if spec.scale_dtype == "bfloat16":  # (held as its uint16 bits: exponent all ones is infinity or NaN)
        bad = (scales.view(np.uint16) & 0x7F80) == 0x7F80
    else:
        bad = ~np.isfinite(scales)
    if bad.any():
        group, column = (int(i) for i in np.argwhere(bad)[0])
        expert = f" (expert {index})" if index is not None else ""
        raise InputError(f"layer '{member.prefix}'{expert}: {int(bad.sum())} scale(s) are NaN or infinite, the first "
                         f"at group {group}, column {column}: the checkpoint is broken",
                         hint="re-quantize or re-download it; a conversion would carry the broken scales on")
    return layout.permute_scales(layout.pad_matrix(scales, spec.num_groups, spec.padded_out_features, 0))


def _marlin_zero_points(qzeros: np.ndarray, member: LayerPlan, index: int | None) -> np.ndarray:
    """GPTQ qzeros int32 [G, ceil(N/p)] of an asymmetric slice -> Marlin zp int32 [G, N_pad/p] (padded columns
    2^(b-1))."""
    spec = member.spec
    zeros = layout.pad_matrix(_true_zeros(qzeros, spec), spec.num_groups, spec.padded_out_features, spec.bias)
    return layout.marlin_zero_points(zeros, spec.bits)


def _write(result: JobResult, writer: ShardWriter, name: str, array: np.ndarray, at: int) -> int:
    written = writer.write_array(name, array, at=at)
    result.written[name] = result.written.get(name, 0) + written
    return written


def _stream_slices(job: Job, checkpoint: Checkpoint, writer: ShardWriter, result: JobResult, kind: str,
                   transform: Callable[[np.ndarray, LayerPlan, int | None], np.ndarray]) -> None:
    """Read the source tensor of role ``kind`` slice by slice (expert by expert), hash it as stored, transform it
    (in GPTQ's orientation), write it in place.

    A source tensor is hashed whole: a stacked 3-D tensor across its slices, a per-expert key on its own.
    """
    offset = 0
    digest, digest_name = None, None
    for member, index in job.layer.slices():
        name = member.roles[kind]
        if name != digest_name:
            if digest is not None:
                result.digests[digest_name] = "sha256:" + digest.hexdigest()
            digest, digest_name = hashlib.sha256(), name
        data = checkpoint.read(name, index)
        digest.update(_bytes(data))
        result.consumed += data.nbytes
        offset += _write(result, writer, job.output.name, transform(member.as_gptq(kind, data), member, index),
                         offset)
    result.digests[digest_name] = "sha256:" + digest.hexdigest()


def run_job(job: Job, checkpoint: Checkpoint, writer: ShardWriter) -> JobResult:
    """Produce one output tensor into ``writer`` (in this process). Holds one tensor or expert slice at a time."""
    result = JobResult(pid=os.getpid())
    if job.kind == "copy":  # hashed while copied: the digests of passthrough tensors and of kept layers' tensors
        name = job.output.name
        result.written[name], result.digests[name] = writer.copy_range(name, job.source_path, job.source.begin,
                                                                       job.source.nbytes, job.source_identity,
                                                                       checkpoint.held)
        result.consumed = job.source.nbytes
        return result
    layer = job.layer
    if job.kind == "B":
        _stream_slices(job, checkpoint, writer, result, "qweight",
                       lambda qweight, member, index: _marlin_weight(checkpoint, layer, qweight, member, index))
    elif job.kind == "s":
        # the small tensors Marlin drops (g_idx, symmetric qzeros, weight_shape) are hashed here, so verify can
        # prove them rebuilt; an asymmetric layer's qzeros are hashed by its zp job
        for member in layer.sources:
            for kind, name in member.roles.items():
                if kind in ("g_idx", "shape") or (kind == "qzeros" and member.spec.sym):
                    result.digests[name] = "sha256:" + hashlib.sha256(_bytes(checkpoint.read(name))).hexdigest()
        _stream_slices(job, checkpoint, writer, result, "scales", _marlin_scales)
    elif job.kind == "zp":
        _stream_slices(job, checkpoint, writer, result, "qzeros", _marlin_zero_points)
    else:  # "perm" / "g_idx": the act-order tables, one per expert slice
        offset = 0
        for member, index in layer.slices():
            perm, sorted_g_idx = layout.act_order_perm(_padded_g_idx(checkpoint, member, index))
            offset += _write(result, writer, job.output.name, perm if job.kind == "perm" else sorted_g_idx, offset)
    return result


# State a forked worker process inherits: (checkpoint, [(job, writer), ...]). Set just before the pool forks.
_WORKER_TASKS: tuple[Checkpoint, list[tuple[Job, ShardWriter]]] | None = None


#: a worker takes tasks in batches of about this many source bytes (or this many tasks), so that MoE checkpoints
#: with thousands of sub-megabyte experts do not pay one inter-process round trip per tensor
BATCH_BYTES = 32 << 20
BATCH_TASKS = 256


def _run_batch(positions: list[int]) -> list[JobResult]:
    """Run the tasks at ``positions``, each shard they read opened once for them all, in this process: the
    descriptors are opened here, after the fork, and closed before the batch's results go back."""
    checkpoint, tasks = _WORKER_TASKS
    with checkpoint.shards_held_open():
        results = [run_job(tasks[p][0], checkpoint, tasks[p][1]) for p in positions]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for result in results:
        result.peak_rss = peak
    return results


def _batches(tasks: list[tuple[Job, ShardWriter]]) -> list[list[int]]:
    batches, current, size = [], [], 0
    for position, (job, _) in enumerate(tasks):
        current.append(position)
        size += job.input_bytes
        if size >= BATCH_BYTES or len(current) >= BATCH_TASKS:
            batches.append(current)
            current, size = [], 0
    return batches + ([current] if current else [])


def _run_tasks(checkpoint: Checkpoint, tasks: list[tuple[Job, ShardWriter]], workers: int):
    """Yield a :class:`JobResult` per task as batches finish, in ``workers`` processes
    (:func:`marlin_convert.workers.run_parallel`: forked, so they inherit the checkpoint and the open output
    files). Close the generator to abandon the run: the workers are killed rather than waited for.

    Processes, not threads: on the machines we measured, two threads doing numpy byte shuffles and SHA-256
    ran no faster than one, while two processes ran twice as fast.
    """
    global _WORKER_TASKS
    _WORKER_TASKS = (checkpoint, tasks)
    try:
        with closing(run_parallel(_run_batch, _batches(tasks), workers)) as batches:
            for results in batches:
                yield from results
    finally:
        _WORKER_TASKS = None


# --------------------------------------------------------------------------------------------------- output


@dataclass
class ConversionReport:
    """What :func:`convert` did; the CLI renders it as a table or JSON."""

    in_dir: str
    out_dir: str
    layers: list[dict]  # one per manifest entry: a layer, or a stack of experts
    converted_layers: int  # layers converted, each expert counted as one (verify's unit)
    marlin_entries: int  # the manifest's entries: one per layer, or per stack of experts (as the plan's JSON names it)
    skipped: list[dict]
    passthrough_tensors: int  # copied unchanged, part of no quantized layer: the manifest's passthrough
    kept_tensors: int  # tensors of the skipped layers, copied unchanged: the manifest's kept
    shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    notes: list[str]
    manifest: str
    manifest_sha256: str  # "sha256:..." of the manifest as written: what verify prints and --manifest-sha256 takes
    checkpoint_format: str  # "marlin", or "marlin-partial" when layers were kept in their source form
    source_format: str  # "gptq" or "compressed-tensors"
    workers: int
    peak_rss_bytes: int  # sum over this process and its workers of each one's peak RSS (an upper bound)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


#: the layout settings each output config states when either source config did (a loader may read only one file)
FILLED_KEYS = ("bits", "group_size", "sym", "desc_act", "dynamic", "lm_head", "extra_config")


def _marlin_quant_config(original: dict, plan: ConversionPlan) -> dict:
    """A quantization config as read, the layout settings (:data:`FILLED_KEYS`) the other source config had filled
    in where this one lacked them, and every format key saying the same thing: "marlin" (and
    ``is_marlin_format: true``) when every quantized layer was converted; "marlin-partial" (and
    ``is_marlin_format: false``, so no legacy loader takes it for Marlin) plus the list of modules still in
    their source form when some were kept. GPTQModel's ``format`` key is rewritten where the source has one."""
    label = plan.checkpoint_format
    updated = dict(original)
    if plan.checkpoint.source_format != QUANT_METHOD:  # a layout setting one file lacks: the other's (as read)
        merged = plan.checkpoint.config.as_read
        updated.update({key: merged[key] for key in FILLED_KEYS if key in merged and key not in original})
    updated.update(quant_method="gptq", checkpoint_format=label, is_marlin_format=label == "marlin")
    if "format" in original:
        updated["format"] = label
    config = plan.checkpoint.config
    if _autoround_source(plan):  # AutoRound's native format: its own keys say Marlin too, the source's
        for key in ("quant_method", config.packing_key):  # values live on under source_<key>
            if key and key in config.as_read:
                updated[AUTOROUND_SOURCE_KEYS[key]] = config.as_read[key]
        if config.packing_key:
            updated[config.packing_key] = label
    if plan.refused:
        updated[KEPT_MODULES_KEYS[plan.checkpoint.source_format]] = [layer.prefix for layer in plan.refused]
    return updated


def _gptq_settings(plan: ConversionPlan) -> dict:
    """The GPTQ-style settings of a checkpoint converted from compressed-tensors, which has none of its own:
    ``bits``, ``group_size`` (-1 = channelwise), ``sym`` and ``desc_act`` shared by most converted layers, a
    GPTQModel-style ``dynamic`` rule (``+:^<name>$``; each expert of a stacked set by its own name) for each module
    that differs and a ``-:^<name>$`` rule for each module but ``lm_head`` that the ``ignore`` list keeps
    unquantized, or that no config group targets where it lies in a numbered block with a converted module (a stored
    2-D ``.weight``: a loader that reads these settings would otherwise expect its ``B`` and ``s``; an embedding lies
    in no block), ``lm_head`` (quantized or not), then ``source_format`` "compressed-tensors" and
    ``source_quantization_config``, the config as read."""
    # per source module (each expert of a stacked output too): the names a loader resolves settings for
    settings = {source.prefix: {"bits": output.spec.bits, "group_size": output.spec.group_size,
                                "sym": output.spec.sym, "desc_act": output.act_order}
                for output in plan.outputs for source in output.sources}
    counts = Counter(tuple(values.items()) for values in settings.values())
    common = dict(counts.most_common(1)[0][0]) if counts else {}
    dynamic = {f"+:^{re.escape(prefix)}$": {key: value for key, value in values.items() if value != common[key]}
               for prefix, values in settings.items() if values != common}
    checkpoint = plan.checkpoint
    modules = module_names(checkpoint.location)
    blocks = {block_of(prefix) for prefix in settings}
    dynamic.update({f"-:^{re.escape(module)}$": {}  # (an unquantized lm_head: "lm_head": false)
                    for module in checkpoint.plain_linear_modules()
                    if module not in settings and not is_lm_head(module)
                    and not_quantized(checkpoint.config, module, modules, blocks)})
    config = {"quant_method": "gptq", **common,
              "lm_head": any(is_lm_head(prefix) for prefix in settings)}
    if dynamic:
        config["dynamic"] = dynamic
    config[SOURCE_FORMAT_KEY] = plan.checkpoint.source_format
    config[SOURCE_CONFIG_KEY] = plan.checkpoint.config.as_read
    return config


def output_configs(plan: ConversionPlan) -> dict[str, dict]:
    """What the output's configs hold, by file name: config.json (``quantization_config``; only where the source has
    a config.json) and quantize_config.json, each with the values it was read with (the other file's where it had
    none), and the format keys of :func:`_marlin_quant_config`. A checkpoint converted from compressed-tensors gets
    the GPTQ-style settings of :func:`_gptq_settings` in both. ``verify --source`` compares the output with it."""
    checkpoint = plan.checkpoint
    section = (checkpoint.config_json or {}).get("quantization_config")
    own = section if section is not None else checkpoint.quantize_json
    if checkpoint.source_format == QUANT_METHOD:
        own = _gptq_settings(plan)
    configs = {}
    if checkpoint.config_json is not None:
        configs[CONFIG_FILE] = {**checkpoint.config_json, "quantization_config": _marlin_quant_config(own, plan)}
    configs[QUANTIZE_CONFIG_FILE] = _marlin_quant_config(
        checkpoint.quantize_json if checkpoint.quantize_json is not None else own, plan)
    return configs


def _write_configs(plan: ConversionPlan, tmp: Path) -> None:
    for name, config in output_configs(plan).items():
        (tmp / name).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def produced_names(plan: ConversionPlan) -> set[str]:
    """File names the converter writes itself into OUT_DIR (never copied from IN_DIR)."""
    names = {shard.file_name for shard in plan.shards} | {INDEX_FILE, CONFIG_FILE, QUANTIZE_CONFIG_FILE, MANIFEST_FILE}
    if plan.checkpoint.index_name:  # (AutoGPTQ's own index name: the output's index above replaces it)
        names.add(plan.checkpoint.index_name)
    if autoround_config_copy(plan):  # (not copied: it would describe the source's GPTQ tensors)
        names.add(AUTOROUND_CONFIG_FILE)
    return names


#: the copy of its quantization config AutoRound writes beside config.json (vLLM's AutoRound reader looks for it)
AUTOROUND_CONFIG_FILE = "quantization_config.json"


def autoround_config_copy(plan: ConversionPlan) -> bool:
    """Whether IN_DIR holds AutoRound's ``quantization_config.json`` for an AutoRound source: it is not copied (it
    says quant_method "auto-round" and a GPTQ packing), and a note says so."""
    return _autoround_source(plan) and os.path.lexists(plan.checkpoint.path / AUTOROUND_CONFIG_FILE)


def _autoround_source(plan: ConversionPlan) -> bool:
    """Whether the source is AutoRound's native format (a GPTQ config whose quant_method is AutoRound's; a
    compressed-tensors source never is)."""
    config = plan.checkpoint.config
    return isinstance(config, QuantConfig) and config.autoround


def _passthrough_entries(plan: ConversionPlan, digests: dict[str, str], out_shard: dict[str, str]) -> list[dict]:
    """The manifest's ``passthrough``: every tensor copied unchanged that is not part of a layer kept in its source
    form (those are in ``kept``), where it is, and the digest of its bytes."""
    kept = plan.kept_tensor_names
    return [{"name": job.output.name, "shard": out_shard[job.output.name], "dtype": job.output.dtype,
             "shape": list(job.output.shape), "sha256": digests[job.output.name]}
            for shard in plan.shards for job in shard.jobs if job.kind == "copy" and job.output.name not in kept]


def _source_entry(member: LayerPlan, first: int | None, stop: int | None, digests: dict[str, str] | None) -> dict:
    """One ``sources`` item of a layer entry; without ``digests`` (not known before the tensors are read), no
    ``digests`` key."""
    entry = {
        "name": member.prefix,
        "tensors": member.source_names,
        "slices": None if first is None else [first, stop],
        "g_idx": "act_order" if member.spec.act_order else ("trivial" if member.has_g_idx else "absent"),
        "zero_format": member.spec.zero_format,
        "zero_stored": member.zero_stored,
    }
    if digests is not None:
        entry["digests"] = {kind: digests[name] for kind, name in member.source_names.items()}
    return {**entry, **member.source_extras()}


def layer_entry(layer: OutputLayer, digests: dict[str, str] | None = None,
                out_shard: dict[str, str] | None = None) -> dict:
    """The manifest's record of one output layer (CONTRACT C; README, "The manifest"). Without ``digests`` and
    ``out_shard`` (known once the tensors are read and placed), the record leaves out the sources' ``digests`` and
    the layer's ``shards``: what the plan alone decides (``verify --source`` compares it with the manifest's)."""
    outputs = marlin_outputs(layer)
    plan, spec = layer.plan, layer.spec
    k_pad, n_pad = spec.padded_shape
    if layer.members:
        sources = [_source_entry(m, e, e + 1, digests) for e, m in enumerate(layer.members)]
    else:
        sources = [_source_entry(plan, 0 if spec.num_experts else None, spec.num_experts or None, digests)]
    entry = {
        "name": layer.prefix,
        "outputs": {kind: t.name for kind, t in outputs.items()},
        **({} if out_shard is None else {"shards": {kind: out_shard[t.name] for kind, t in outputs.items()}}),
        "shapes": {kind: list(t.shape) for kind, t in outputs.items()},
        "bits": spec.bits,
        "group_size": spec.group_size,
        "num_groups": spec.num_groups,
        "sym": spec.sym,
        "zero_format": spec.zero_format,
        "act_order": layer.act_order,
        "in_features": spec.in_features,
        "out_features": spec.out_features,
        "padded_in_features": k_pad,
        "padded_out_features": n_pad,
        "scale_dtype": spec.scale_dtype,
        "num_experts": layer.num_experts,
        "workspace": {"rule": layout.WORKSPACE_RULE, "ints": plan.workspace_ints},
        "source_format": spec.source_format,
        "sources": sources,
    }
    if layer.num_experts:
        entry["expert_stride_int32"] = k_pad * n_pad * spec.bits // 32
        entry["workspace"]["per_expert"] = True
    return entry


def _kept_entry(layer: LayerPlan, digests: dict[str, str], out_shard: dict[str, str]) -> dict:
    """The manifest's record of a layer left in its source form: its tensors, where they are, and their digests."""
    names = layer.kept_names
    return {
        "name": layer.prefix,
        "reason": layer.reason,
        "tensors": names,
        "shards": {kind: out_shard[name] for kind, name in names.items()},
        "digests": {kind: digests[name] for kind, name in names.items()},
    }


def _quantization_defaults(plan: ConversionPlan) -> dict:
    """The config's global settings exactly as read (null where absent): defaults, not any layer's truth."""
    return plan.checkpoint.config.defaults()


def _input_file_of(exc: OSError, in_dir: Path) -> str | None:
    """The file of ``in_dir`` an OSError is about (its ``filename``, resolved, inside ``in_dir``), or None: a file that
    vanished or became unreadable during the conversion is named as the input's, not blamed on OUT_DIR. Inside as named
    or once links are followed (a Hugging Face cache snapshot's files are links into its blob store)."""
    name = exc.filename
    if not isinstance(name, (str, bytes)):
        return None
    name = os.fsdecode(name)
    for path, root in ((os.path.abspath(name), os.path.abspath(in_dir)),
                       (os.path.realpath(name), os.path.realpath(in_dir))):
        if os.path.commonpath([path, root]) == root:
            return path
    return None


def convert(
    in_dir: Path,
    out_dir: Path,
    *,
    overwrite: bool = False,
    skip_incompatible: bool = False,
    stack_experts: bool = False,
    workers: int = DEFAULT_WORKERS,
    progress: ProgressCallback | None = None,
    plan: ConversionPlan | None = None,
    before_publish: Callable[[], None] | None = None,
) -> ConversionReport:
    """Convert the GPTQ checkpoint ``in_dir`` into a Marlin checkpoint at ``out_dir``.

    ``workers`` processes repack, hash and copy in parallel (1: all in this process). ``progress`` is called in
    this process with the number of source bytes each finished job processed (the total is
    ``plan.work_bytes``). Raises :class:`MarlinConvertError` subclasses; on any failure nothing is left at
    ``out_dir`` that was not there before.
    """
    start = time.perf_counter()
    check_workers(workers)
    in_dir, out_dir = Path(in_dir), Path(os.path.abspath(out_dir))  # "." and ".." get a name and a parent
    check_in_dir(in_dir)
    check_out_dir(in_dir, out_dir, overwrite)
    if plan is None:
        plan = build_plan(in_dir, skip_incompatible, stack_experts)
    refusal = plan_refusal(plan, skip_incompatible)  # (a plan passed in was built with skip_incompatible)
    if refusal is not None:
        raise refusal
    checkpoint = plan.checkpoint
    bytes_in = plan.bytes_in  # (read once, now: nothing after the output is moved into place may fail)
    extra = select_extra_files(in_dir, produced_names(plan))
    notes = list(plan.notes) + [f"not copied from IN_DIR: {line}" for line in extra.skipped]
    if autoround_config_copy(plan):
        notes.append(f"not copied from IN_DIR: {AUTOROUND_CONFIG_FILE}: AutoRound's copy of the source's quantization "
                     "config (quant_method auto-round, GPTQ packing); config.json and quantize_config.json say what "
                     "the output is")
    if out_dir.parent.is_dir():
        notes += clear_stale_partials(out_dir)

    check_free_space(out_dir, plan.tensor_bytes_out)
    partial = PartialDir(out_dir)
    tmp = partial.path

    writers: list[ShardWriter] = []
    try:
        out_shard: dict[str, str] = {}
        tasks = []
        for shard in plan.shards:
            writer = ShardWriter(tmp / shard.file_name, shard.outputs, SHARD_METADATA)
            writers.append(writer)
            for job in shard.jobs:
                out_shard[job.output.name] = shard.file_name
                tasks.append((job, writer))
        tasks.sort(key=lambda task: -task[0].input_bytes)  # biggest first keeps every worker busy to the end
        digests: dict[str, str] = {}
        peak_rss = {os.getpid(): 0}
        writer_of = {job.output.name: writer for job, writer in tasks}
        with closing(_run_tasks(checkpoint, tasks, workers)) as results:
            for result in results:
                for name, nbytes in result.written.items():
                    writer_of[name].record(name, nbytes)
                digests.update(result.digests)
                peak_rss[result.pid] = max(peak_rss.get(result.pid, 0), result.peak_rss)
                if progress is not None and result.consumed:
                    progress(result.consumed)
        peak_rss[os.getpid()] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for writer in writers:
            writer.close()
        writers = []

        if checkpoint.index_json is not None:
            index = {
                "metadata": {**checkpoint.index_json.get("metadata", {}), "total_size": plan.tensor_bytes_out},
                "weight_map": dict(sorted(out_shard.items())),
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        _write_configs(plan, tmp)
        files = output_file_digests(tmp, extra.copy, workers)

        layers = [layer_entry(layer, digests, out_shard) for layer in plan.outputs]
        kept = [_kept_entry(layer, digests, out_shard) for layer in plan.refused]
        passthrough = _passthrough_entries(plan, digests, out_shard)
        bytes_out = sum(record["bytes"] for record in files.values())
        manifest = {
            "format": "marlin-convert-manifest",
            "version": MANIFEST_VERSION,
            "tool": f"marlin-convert {__version__}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": {"path": name_text(str(in_dir.resolve())), "bytes": bytes_in, "format": checkpoint.source_format,
                       "quantization_config": checkpoint.config.sources},
            "checkpoint_format": plan.checkpoint_format,
            "model_dtype": checkpoint.model_dtype,
            "quantization_defaults": _quantization_defaults(plan),
            "notes": plan.notes,
            "shards": [shard.file_name for shard in plan.shards],
            "layers": layers,
            "kept": kept,
            "expert_groups": expert_group_summary(layers, kept, passthrough),
            "passthrough": passthrough,
        }
        manifest["files"] = files
        write_manifest(tmp, manifest)
        digest = manifest_digest(tmp)
        for shard in checkpoint.shards:  # the checks (planning) and the conversion must have seen the same bytes
            changed = changed_since_read(shard)
            if changed is not None:
                raise InputError(f"{shard.path}: changed while it was being converted: {changed}; the output is "
                                 "discarded", hint="convert again once nothing writes to IN_DIR")
        if before_publish is not None:
            before_publish()  # the output is complete: the caller stops interrupts from here on (the CLI does)
        notes += partial.finalize(overwrite)
    except BaseException as exc:
        for writer in writers:
            writer.abort()
        partial.discard()
        if isinstance(exc, OSError):
            source = _input_file_of(exc, in_dir)
            if source is not None:  # (a file of IN_DIR gone or unreadable meanwhile: not OUT_DIR's fault)
                raise InputError(f"{source}: cannot read: {exc.strerror or exc}; the output is discarded",
                                 hint="convert again once nothing changes IN_DIR") from exc
            if exc.errno == 28:
                raise OutputError(f"{out_dir}: no space left on device", hint="free disk space") from exc
            raise OutputError(f"{out_dir}: cannot write: {exc.strerror or exc}") from exc
        raise

    return ConversionReport(
        in_dir=str(in_dir),
        out_dir=str(out_dir),
        layers=[{key: entry[key] for key in ("name", "bits", "in_features", "out_features", "group_size", "sym",
                                             "act_order", "num_experts")} for entry in layers],
        converted_layers=plan.converted_layers,
        marlin_entries=len(layers),
        skipped=[{"name": k["name"], "reason": k["reason"]} for k in kept],
        passthrough_tensors=plan.passthrough_tensors,
        kept_tensors=plan.kept_tensors,
        shards=len(plan.shards),
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        seconds=time.perf_counter() - start,
        notes=notes,
        manifest=str(out_dir / MANIFEST_FILE),
        manifest_sha256=digest,
        checkpoint_format=plan.checkpoint_format,
        source_format=checkpoint.source_format,
        workers=workers,
        peak_rss_bytes=sum(peak_rss.values()),
    )


__all__ = ["ConversionPlan", "ConversionReport", "OutputLayer", "build_plan", "convert", "layer_entry",
           "marlin_outputs",
           "output_configs", "run_job"]
