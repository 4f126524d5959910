"""Mixture-of-experts naming: recognise per-expert keys and group them.

Per-expert 2-D layers are named ``<base>.experts.<e>.<projection>`` (Qwen2/Qwen3-MoE, DeepSeek:
``mlp.experts.{e}.gate_proj``; Mixtral: ``block_sparse_moe.experts.{e}.w1``). Shared experts
(``shared_expert``, ``shared_experts``) and routers (``mlp.gate``) do not match and stay ordinary layers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError

#: the index is a plain ASCII decimal without leading zeros, at most 18 digits (``experts.00``, a non-ASCII digit or
#: a 5000-digit number is not an expert index: such a layer stays an ordinary layer, so two spellings of one index
#: cannot collide, and ``int()`` never meets a number beyond its digit limit)
EXPERT_KEY = re.compile(r"^(?P<base>.+\.experts)\.(?P<index>0|[1-9][0-9]{0,17})\.(?P<projection>[^.]+)$")


@dataclass
class ExpertGroup:
    """All per-expert layers under one ``<base>.experts``: ``members[projection][expert] = prefix`` for the quantized
    ones; ``unquantized[projection][expert]`` says what in the config leaves that expert of a projection with
    quantized members unquantized (stored as a plain ``.weight``; filled in by the converter, which reads the config)."""

    base: str
    members: dict[str, dict[int, str]] = field(default_factory=dict)
    unquantized: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def expert_indices(self) -> list[int]:
        """Every expert index stored, quantized or left unquantized, of any projection."""
        return sorted({e for stored in (self.members, self.unquantized) for per in stored.values() for e in per})

    def missing(self, limit: int = 9) -> dict[str, list[int]]:
        """Per projection with a hole in 0..max (such as expert 17 of 0..63) that neither a quantized expert nor one
        the config leaves unquantized fills, its first ``limit`` absent indices. The search stops there, so it costs
        at most len(members) + limit steps, whatever the largest index."""
        top = max(self.expert_indices) + 1
        out = {}
        for projection, per in self.members.items():
            plain = self.unquantized.get(projection, {})
            if len(per) + len(plain) == top:
                continue
            gaps = []
            for e in range(top):
                if e not in per and e not in plain:
                    gaps.append(e)
                    if len(gaps) == limit:
                        break
            out[projection] = gaps
        return out


def split_expert_key(prefix: str) -> tuple[str, int, str] | None:
    """``(base, expert_index, projection)`` for a per-expert layer prefix, else None."""
    match = EXPERT_KEY.match(prefix)
    if not match:
        return None
    return match["base"], int(match["index"]), match["projection"]


def group_experts(prefixes: list[str]) -> tuple[list[ExpertGroup], list[str]]:
    """Split layer prefixes into expert groups (in order of first appearance) and the remaining plain layers."""
    groups: dict[str, ExpertGroup] = {}
    plain = []
    for prefix in prefixes:
        parts = split_expert_key(prefix)
        if parts is None:
            plain.append(prefix)
            continue
        base, index, projection = parts
        group = groups.setdefault(base, ExpertGroup(base))
        group.members.setdefault(projection, {})[index] = prefix
    return list(groups.values()), plain


def plain_experts(groups: list[ExpertGroup], plain_modules: list[str]) -> dict[str, tuple[ExpertGroup, int, str]]:
    """The modules of ``plain_modules`` (stored as a plain 2-D ``.weight``) that are experts of a projection with
    quantized members in ``groups`` and not themselves among them: module -> (group, expert, projection). A
    projection with no quantized member is an ordinary plain linear, as in a dense model, and is left out."""
    by_base = {group.base: group for group in groups}
    found = {}
    for module in plain_modules:
        parts = split_expert_key(module)
        if parts is None or parts[0] not in by_base:
            continue
        group, expert, projection = by_base[parts[0]], parts[1], parts[2]
        if projection in group.members and expert not in group.members[projection]:
            found[module] = (group, expert, projection)
    return found


#: config.json keys that state a MoE model's number of routed experts (Qwen-MoE, Mixtral, DeepSeek)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def stated_expert_count(config_json: dict | None, where: Path | str) -> tuple[str, int] | None:
    """(key, count) of the routed experts config.json (``config_json``, read from ``where``) states (top level, or a
    multimodal model's text_config); null and 0 (a dense model's) state none. A list of counts, one per layer
    (transformers' HunYuan: "int or List"), states its count where every layer has the same, and none where they
    differ. Raises :class:`InputError` for a count that is not a JSON integer >= 0 ("5", 5.0, true, -1), or a list
    that is not of such integers."""
    for name, section in (("", config_json or {}), ("text_config.", (config_json or {}).get("text_config"))):
        if isinstance(section, dict):
            for key in EXPERT_COUNT_KEYS:
                value = section.get(key)
                if value is None:
                    continue
                per_layer = isinstance(value, list) and all(_is_count(v) for v in value)
                if not (_is_count(value) or per_layer):
                    raise InputError(f"{where}: '{name}{key}' must be a JSON integer >= 0 (the number of "
                                     f"experts) or a list of them (one per layer), got {json.dumps(value)[:80]}")
                if per_layer:
                    value = value[0] if value and len(set(value)) == 1 else 0  # (differing counts: none stated)
                if value > 0:
                    return f"{name}{key}", value
    return None


def stacked_count_problems(stacked: dict[str, int], stated: tuple[str, int] | None, where: Path | str) -> list[str]:
    """Each stacked layer (prefix -> its number of experts) that holds another number of experts than config.json
    (``where``) states (``stated``: :func:`stated_expert_count`)."""
    if stated is None:
        return []
    key, count = stated
    return [f"layer '{prefix}': {experts} stacked experts, {where} says {key} = {count}"
            for prefix, experts in stacked.items() if experts != count]


@dataclass(frozen=True)
class SetGap:
    """A hole in one projection of an expert set: ``experts`` (the first few) of 0..``top - 1`` are stored in no
    form. :meth:`describe` says so; the caller adds what it looked for."""

    group: ExpertGroup
    projection: str
    experts: list[int]
    top: int

    def describe(self, looked_for: str) -> str:
        shown = ", ".join(str(e) for e in self.experts[:8]) + (" ..." if len(self.experts) > 8 else "")
        return (f"layer '{self.group.base}': expert(s) {shown} of 0..{self.top - 1} missing for '{self.projection}' "
                f"({looked_for})")


def set_problems(group: ExpertGroup, stated: tuple[str, int] | None, where: Path | str) -> list[SetGap | str]:
    """What keeps ``group`` (its ``unquantized`` filled in) from being complete sets, in order: a :class:`SetGap` per
    projection with a hole in 0..top-1 (neither a quantized expert nor one left unquantized), then a message where
    the experts stored end at another count than config.json (``where``) states (``stated``: the last experts
    missing altogether leave no gap to see). The rule ``convert`` holds a source to and ``verify`` an output."""
    top = max(group.expert_indices) + 1
    found: list[SetGap | str] = [SetGap(group, projection, gaps, top) for projection, gaps in group.missing().items()]
    if stated is not None and top != stated[1]:
        missing = f" (expert(s) {top}..{stated[1] - 1} missing)" if top < stated[1] else ""
        found.append(f"layer '{group.base}': experts 0..{top - 1} stored, {where} says {stated[0]} = "
                     f"{stated[1]}{missing}")
    return found


def expert_group_summary(layers: list[dict], kept: list[dict], passthrough: list[dict]) -> list[dict]:
    """The manifest's ``expert_groups``, from its ``layers``, ``kept`` and ``passthrough`` entries: one summary per
    group of per-expert layers written per expert (entries with ``num_experts`` 0 whose names are expert keys) and
    projection, in order of first appearance: ``base``, ``projection``, ``num_experts``, ``in_features``,
    ``out_features`` and ``workspace_ints_per_expert`` (of the lowest expert index) and the ``layers`` in expert
    order. Only a complete set is summarised: experts 0..E-1 all converted, and no expert of that projection kept in
    its source form or passed through unquantized (a plain ``.weight``, which a ``dynamic`` rule or ``ignore`` left
    so); the converted experts of any other set are entries of their own, found by name, so that no reader takes
    ``layers[e]`` for expert ``e`` where it is not. Stacked entries describe themselves and are not summarised. The
    converter writes it and ``verify`` recomputes it."""
    per_expert = {entry["name"]: entry for entry in layers if not entry["num_experts"]}
    groups, _ = group_experts(list(per_expert))
    unconverted = [entry["name"] for entry in kept]
    unconverted += [entry["name"].removesuffix(".weight") for entry in passthrough if entry["name"].endswith(".weight")]
    incomplete = {(parts[0], parts[2]) for parts in map(split_expert_key, unconverted) if parts is not None}
    summary = []
    for group in groups:
        for projection, members in group.members.items():
            if (group.base, projection) in incomplete or sorted(members) != list(range(len(members))):
                continue
            first = per_expert[members[0]]
            summary.append({
                "base": group.base,
                "projection": projection,
                "num_experts": len(members),
                "in_features": first["in_features"],
                "out_features": first["out_features"],
                "workspace_ints_per_expert": first["workspace"]["ints"],
                "layers": [members[e] for e in sorted(members)],
            })
    return summary
