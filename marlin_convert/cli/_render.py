"""Tables shared by ``inspect`` and ``convert``: one row per layer, per-expert layers folded into one row."""

from __future__ import annotations

from ..experts import group_experts
from ..gptq import LayerPlan
from ._output import Output

#: above this many rows, per-expert layers are shown grouped (they always are) and plain layers summarised
MAX_LAYER_ROWS = 60


def _group_label(group_size: int) -> str:
    return "channel" if group_size == -1 else str(group_size)


def add_layer_rows(output: Output, layers: list[LayerPlan]) -> None:
    """Fill ``output`` with columns layer / experts / K x N / group / act-order / action."""
    output.columns = ["layer", "experts", "K x N", "group", "act-order", "action"]
    by_prefix = {layer.prefix: layer for layer in layers}
    groups, plain = group_experts([layer.prefix for layer in layers])
    rows: list[tuple[list[str], str | None]] = []
    for prefix in plain:
        layer = by_prefix[prefix]
        experts = str(layer.num_experts) + " (stacked)" if layer.num_experts else "-"
        action = "convert" if layer.convertible else f"keep GPTQ: {layer.reason}"
        rows.append(([prefix, experts, f"{layer.in_features} x {layer.out_features}",
                      _group_label(layer.group_size), "yes" if layer.act_order else "no", action],
                     None if layer.convertible else "yellow"))
    for group in groups:
        for projection, members in group.members.items():
            member_layers = [by_prefix[p] for p in members.values()]
            first = member_layers[0]
            shapes = sorted({(m.in_features, m.out_features) for m in member_layers})
            refused = [m for m in member_layers if not m.convertible]
            action = "convert" if not refused else f"keep GPTQ ({len(refused)}): {refused[0].reason}"
            rows.append(([f"{group.base}.*.{projection}", str(len(members)),
                          ", ".join(f"{k} x {n}" for k, n in shapes), _group_label(first.group_size),
                          "yes" if any(m.act_order for m in member_layers) else "no", action],
                         None if not refused else "yellow"))
    if len(rows) > MAX_LAYER_ROWS:
        head, tail = rows[: MAX_LAYER_ROWS // 2], rows[-MAX_LAYER_ROWS // 4:]
        hidden = len(rows) - len(head) - len(tail)
        gap = [f"... {hidden} rows not shown (--json FILE has every layer) ...", "", "", "", "", ""]
        rows = [*head, (gap, "dim"), *tail]
    for cells, style in rows:
        output.add_row(*cells, style=style)


def layer_dict(layer: LayerPlan) -> dict:
    return {
        "name": layer.prefix,
        "in_features": layer.in_features,
        "out_features": layer.out_features,
        "num_experts": layer.num_experts,
        "bits": layer.bits,
        "group_size": layer.group_size,
        "act_order": layer.act_order,
        "zero_format": layer.zero_format,
        "convert": layer.convertible,
        "reason": layer.reason,
        "workspace_ints": layer.workspace_ints,
    }
