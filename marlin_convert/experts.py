"""Mixture-of-experts naming: recognise per-expert keys and group them.

Per-expert 2-D layers are named ``<base>.experts.<e>.<projection>`` (Qwen2/Qwen3-MoE, DeepSeek:
``mlp.experts.{e}.gate_proj``; Mixtral: ``block_sparse_moe.experts.{e}.w1``). Shared experts
(``shared_expert``, ``shared_experts``) and routers (``mlp.gate``) do not match and stay ordinary layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: the index is a plain ASCII decimal without leading zeros, at most 18 digits (``experts.00``, a non-ASCII digit or
#: a 5000-digit number is not an expert index: such a layer stays an ordinary layer, so two spellings of one index
#: cannot collide, and ``int()`` never meets a number beyond its digit limit)
EXPERT_KEY = re.compile(r"^(?P<base>.+\.experts)\.(?P<index>0|[1-9][0-9]{0,17})\.(?P<projection>[^.]+)$")


@dataclass
class ExpertGroup:
    """All per-expert layers under one ``<base>.experts``: ``members[projection][expert] = prefix``."""

    base: str
    members: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def expert_indices(self) -> list[int]:
        return sorted({e for per in self.members.values() for e in per})

    def missing(self, limit: int = 9) -> dict[str, list[int]]:
        """Per projection with a hole in 0..max (such as expert 17 of 0..63), its first ``limit`` absent indices.
        The search stops there, so it costs at most len(members) + limit steps, whatever the largest index."""
        top = max(self.expert_indices) + 1
        out = {}
        for projection, per in self.members.items():
            if len(per) == top:
                continue
            gaps = []
            for e in range(top):
                if e not in per:
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


def expert_group_summary(layers: list[dict]) -> list[dict]:
    """The manifest's ``expert_groups``, from its ``layers`` entries: one summary per group of per-expert layers
    written per expert (entries with ``num_experts`` 0 whose names are expert keys) and projection, in order of
    first appearance: ``base``, ``projection``, ``num_experts``, ``in_features``, ``out_features`` and
    ``workspace_ints_per_expert`` (of the lowest expert index) and the ``layers`` in expert order. Stacked entries
    describe themselves and are not summarised. The converter writes it and ``verify`` recomputes it."""
    per_expert = {entry["name"]: entry for entry in layers if not entry["num_experts"]}
    groups, _ = group_experts(list(per_expert))
    summary = []
    for group in groups:
        for projection, members in group.members.items():
            first = per_expert[members[min(members)]]
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
