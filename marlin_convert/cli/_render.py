"""Tables shared by ``inspect`` and ``convert``: one row per layer, per-expert layers folded into one row.

Every column comes from the layer's resolved :class:`~marlin_convert.spec.QuantSpec` (its own bits, group size,
zero points, act-order and shapes), never from the config's defaults.
"""

from __future__ import annotations

from ..convert import ConversionPlan
from ..experts import group_experts, plain_experts
from ..gptq import DynamicRule, LayerPlan
from ..sources import FORM_NAMES
from ._output import Output

#: above this many rows, per-expert layers are shown grouped (they always are) and plain layers summarised
MAX_LAYER_ROWS = 60


def _group_label(group_size: int) -> str:
    return "channel" if group_size == -1 else str(group_size)


def _zeros_label(layer: LayerPlan) -> str:
    return f"{'sym' if layer.spec.sym else 'asym'} {layer.spec.zero_format}"


def _padded_shape(layer: LayerPlan) -> tuple[int, int] | None:
    """The Marlin shape (K_pad, N_pad) of a layer that converts, else None."""
    return layer.spec.padded_shape if layer.convertible else None


def _padded_label(layer: LayerPlan) -> str:
    padded = _padded_shape(layer)
    if padded is None:
        return "-"
    return "no" if not layer.spec.padded else f"{padded[0]} x {padded[1]}"


def _joined(values) -> str:
    return ", ".join(dict.fromkeys(values))


def add_layer_rows(output: Output, layers: list[LayerPlan], refusing: bool = False,
                   plain_counts: dict[str, int] | None = None) -> None:
    """Fill ``output`` with columns layer / experts / bits / group / zeros / act-order / K x N / padded / action.
    A layer with no Marlin form is kept in its source form (``--skip-incompatible``), or where the run would stop at
    it (``refusing``: a dry run without that option, or any plan where no layer converts) refused. ``plain_counts``:
    for a row ``<base>.*.<projection>``, how many experts of that set are stored unquantized (a ``dynamic`` rule or
    ``ignore`` leaves them so; they pass through), shown beside the quantized ones (:func:`plain_expert_counts`)."""
    def refused_action(layer: LayerPlan, count: str = "") -> str:
        verb = "refuse" if refusing else f"keep {FORM_NAMES[layer.spec.source_format]}"
        return f"{verb}{count}: {layer.reason}"

    output.columns = ["layer", "experts", "bits", "group", "zeros", "act-order", "K x N", "padded to", "action"]
    by_prefix = {layer.prefix: layer for layer in layers}
    groups, plain = group_experts([layer.prefix for layer in layers])
    rows: list[tuple[list[str], str | None]] = []
    for prefix in plain:
        layer = by_prefix[prefix]
        spec = layer.spec
        experts = str(spec.num_experts) + " (stacked)" if spec.num_experts else "-"
        action = "convert" if layer.convertible else refused_action(layer)
        rows.append(([prefix, experts, str(spec.bits), _group_label(spec.group_size), _zeros_label(layer),
                      "yes" if spec.act_order else "no", f"{spec.in_features} x {spec.out_features}",
                      _padded_label(layer), action],
                     None if layer.convertible else "yellow"))
    for group in groups:
        for projection, members in group.members.items():
            member_layers = [by_prefix[p] for p in members.values()]
            refused = [m for m in member_layers if not m.convertible]
            action = "convert" if not refused else refused_action(refused[0], f" ({len(refused)})")
            row = f"{group.base}.*.{projection}"
            n_plain = (plain_counts or {}).get(row, 0)
            rows.append(([row, f"{len(members)} + {n_plain} plain" if n_plain else str(len(members)),
                          _joined(str(m.spec.bits) for m in member_layers),
                          _joined(_group_label(m.spec.group_size) for m in member_layers),
                          _joined(_zeros_label(m) for m in member_layers),
                          "yes" if any(m.spec.act_order for m in member_layers) else "no",
                          _joined(f"{m.spec.in_features} x {m.spec.out_features}" for m in member_layers),
                          _joined(_padded_label(m) for m in member_layers), action],
                         None if not refused else "yellow"))
    if len(rows) > MAX_LAYER_ROWS:
        head, tail = rows[: MAX_LAYER_ROWS // 2], rows[-MAX_LAYER_ROWS // 4:]
        hidden = len(rows) - len(head) - len(tail)
        gap = [f"... {hidden} rows not shown (--json FILE has every layer) ...", "", "", "", "", ""]
        rows = [*head, (gap, "dim"), *tail]
    for cells, style in rows:
        output.add_row(*cells, style=style)


def counts_line(layers: int, entries: int, kept: int, form: str, passthrough: int, kept_tensors: int, shards: int,
                done: bool, refusing: bool = False) -> str:
    """The summary line of ``convert`` (``done``) and ``inspect``, in the units ``verify`` and the manifest use.

    ``layers`` counts each expert as one layer (as verify does); ``entries`` are the manifest's ``layers`` (one per
    layer or stack of experts); ``passthrough`` the manifest's ``passthrough`` tensors; ``kept_tensors`` those of the
    ``kept`` layers, which are copied too but listed apart. ``refusing``: the ``kept`` layers stop the run (a dry run
    without ``--skip-incompatible``, or one where no layer converts, which stops with that option too)."""
    experts = " (each expert counts as one)" if layers != entries else ""
    entry_word = "entry" if entries == 1 else "entries"
    if not refusing:
        kept_words = f"{kept} kept in {form} form"
    elif layers:
        kept_words = (f"{kept} refused (no Marlin form: the conversion stops; --skip-incompatible keeps them in {form} "
                      "form)")
    else:  # (nothing would be converted: --skip-incompatible stops too)
        kept_words = (f"{kept} refused (no Marlin form, and none converted: the conversion stops, --skip-incompatible "
                      "or not)")
    line = (f"{layers} layer(s) {'converted' if done else 'to convert'}{experts} into {entries} Marlin manifest "
            f"{entry_word}, {kept_words}; {passthrough} tensor(s) {'passed' if done else 'to pass'} through")
    if kept_tensors and not refusing:
        line += f", {kept_tensors} tensor(s) of kept layers {'copied' if done else 'to copy'} unchanged"
    return line + f"; {shards} shard(s)"


def layer_dict(layer: LayerPlan) -> dict:
    """One layer of the plan for ``--json``: its resolved settings, logical and padded shape, and what happens."""
    spec = layer.spec
    padded = _padded_shape(layer)
    return {
        "name": layer.prefix,
        "in_features": spec.in_features,
        "out_features": spec.out_features,
        "padded_in_features": padded[0] if padded else None,
        "padded_out_features": padded[1] if padded else None,
        "num_experts": spec.num_experts,
        "bits": spec.bits,
        "group_size": spec.group_size,
        "num_groups": spec.num_groups,
        "sym": spec.sym,
        "zero_format": spec.zero_format,
        "zero_stored": layer.zero_stored,
        "act_order": spec.act_order,
        "scale_dtype": layer.stored_scale_dtype or spec.scale_dtype,
        "dynamic_rule": layer.settings.rule.key if isinstance(layer.settings.rule, DynamicRule) else None,
        "settings_from": layer.settings.origin,
        "source_format": spec.source_format,
        "convert": layer.convertible,
        "reason": layer.reason,
        "workspace_ints": layer.workspace_ints if padded else None,
    }


def plain_expert_counts(plan: ConversionPlan) -> dict[str, int]:
    """``<base>.*.<projection>`` -> how many of that set's experts the checkpoint stores unquantized beside its
    quantized ones (:func:`marlin_convert.experts.plain_experts`), for :func:`add_layer_rows`."""
    groups, _ = group_experts([layer.prefix for layer in plan.layers])
    counts: dict[str, int] = {}
    for group, _expert, projection in plain_experts(groups, plan.checkpoint.plain_linear_modules()).values():
        row = f"{group.base}.*.{projection}"
        counts[row] = counts.get(row, 0) + 1
    return counts
