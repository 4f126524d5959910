"""Mixture-of-experts naming: recognise per-expert keys and group them.

Per-expert 2-D layers are named ``<base>.experts.<e>.<projection>`` (Qwen2/Qwen3-MoE, DeepSeek:
``mlp.experts.{e}.gate_proj``; Mixtral: ``block_sparse_moe.experts.{e}.w1``). Shared experts
(``shared_expert``, ``shared_experts``) and routers (``mlp.gate``) do not match and stay ordinary layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

EXPERT_KEY = re.compile(r"^(?P<base>.+\.experts)\.(?P<index>\d+)\.(?P<projection>[^.]+)$")


@dataclass
class ExpertGroup:
    """All per-expert layers under one ``<base>.experts``: ``members[projection][expert] = prefix``."""

    base: str
    members: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def expert_indices(self) -> list[int]:
        return sorted({e for per in self.members.values() for e in per})

    def missing(self) -> dict[str, list[int]]:
        """Per projection, the expert indices absent from 0..max (a hole such as expert 17 of 0..63)."""
        top = max(self.expert_indices) + 1
        out = {}
        for projection, per in self.members.items():
            gaps = [e for e in range(top) if e not in per]
            if gaps:
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
