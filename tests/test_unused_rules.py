"""``dynamic`` rules and AutoRound ``extra_config`` entries that match no module the checkpoint stores: a typo there
(``gate_prj`` for ``gate_proj``) was silently unused and surfaced, if at all, as a bare shape error. Now a shape error
of a layer whose tensors contradict its resolved settings names them in its hint."""

from __future__ import annotations

from pathlib import Path

import pytest
from edit_checkpoint import set_quant_config
from make_gptq_checkpoint import TensorSpec, qwen3_moe, tiny_llama, write_checkpoint

from marlin_convert.cli.app import main
from marlin_convert.convert import build_plan
from marlin_convert.errors import InputError, SettingsMismatchError

TYPO = r"+:model\.layers\.\d+\.mlp\.gate_prj"
BASE = "model.layers.0.mlp.experts"


def _tiny(path: Path, **spec) -> Path:
    return write_checkpoint(path, tiny_llama(num_layers=2, **spec))


# ------------------------------------------------------------------------------------------------ the hint


@pytest.mark.parametrize("stored, said, message", [
    # the README's example: 8-bit tensors, the config 4-bit with an 8-bit rule for a misspelt module
    (dict(bits=8), dict(bits=4), r"g_idx' has shape \[256\], expected \[512\]: .*\(the config says bits = 4\)"),
    # no g_idx, channelwise: the zero points' packed columns are what 8 bits give
    (dict(bits=8, group_size=-1, include_g_idx=False), dict(bits=4, group_size=-1),
     r"qzeros' has shape \[1, 32\], expected \[1, 16\] \(N = 128 zero points of 4 bits .* says bits = 4\)"),
    # group size 64 stored, 128 said: the scales' rows
    (dict(group_size=64), dict(group_size=128), r"scales' has 4 rows: that is group size 64 for K = 256"),
], ids=["bits, g_idx", "bits, qzeros", "group size"])
@pytest.mark.parametrize("key", ["dynamic", "extra_config"])
def test_a_layer_whose_tensors_contradict_its_settings_names_the_rules_that_match_nothing(tmp_path, stored, said,
                                                                                          message, key):
    src = _tiny(tmp_path / "in", **stored)
    rule = TYPO if key == "dynamic" else "model.layers.0.mlp.gate_prj"
    set_quant_config(src, **said, **{key: {rule: {name: stored[name] for name in said}}})
    with pytest.raises(SettingsMismatchError, match=message) as raised:
        build_plan(src)
    kind = "dynamic rule" if key == "dynamic" else "extra_config entry"
    assert raised.value.hint == (f"{kind} '{rule}' matches no module in the checkpoint (a typo? the modules it was "
                                 "meant for take other settings)")


def test_the_cli_prints_the_unused_rule_as_the_errors_hint(tmp_path, capsys):
    src = _tiny(tmp_path / "in", bits=8)
    set_quant_config(src, bits=4, dynamic={TYPO: {"bits": 8}})
    assert main([str(src), str(tmp_path / "out")]) == 2
    error, hint = capsys.readouterr().err.splitlines()
    assert error.startswith("Error: ") and "expected [512]" in error and "gate_prj" not in error
    assert hint.startswith(f"Hint: dynamic rule '{TYPO}' matches no module in the checkpoint")


def test_several_unused_rules_are_counted_and_the_first_three_named(tmp_path):
    src = _tiny(tmp_path / "in", bits=8)
    typos = {rf"+:.*\.{name}": {"bits": 8} for name in ("q_prj", "k_prj", "v_prj", "o_prj", "up_prj")}
    set_quant_config(src, bits=4, dynamic={r"+:.*\.mlp\.down_proj": {"bits": 8}, **typos})  # (down_proj: used)
    with pytest.raises(SettingsMismatchError) as raised:
        build_plan(src)
    shown = ", ".join(f"dynamic rule '{rule}'" for rule in list(typos)[:3])
    assert raised.value.hint.startswith(f"5 rules of the config match no module in the checkpoint: {shown} (and 2 "
                                        "more) (a typo? the modules they were meant for")


def test_a_shape_error_where_every_rule_matches_has_no_such_hint(tmp_path):
    src = _tiny(tmp_path / "in", bits=8)
    set_quant_config(src, bits=4, dynamic={r"+:.*\.mlp\.gate_proj": {"bits": 8}})
    with pytest.raises(SettingsMismatchError) as raised:
        build_plan(src)
    assert raised.value.hint is None


def _moe(path: Path, dynamic: dict, stacked: bool = False, plain_expert: int | None = None, **spec) -> Path:
    """One Qwen3-MoE layer of 4 experts (group size 32), expert ``plain_expert`` stored as plain float16 weights."""
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64, group_size=32, vocab=256,
                     stacked=stacked, dynamic=dynamic, **spec)
    for linear in [linear for linear in spec.linears if f".experts.{plain_expert}." in linear.name]:
        spec.linears.remove(linear)
        spec.extras.append(TensorSpec(f"{linear.name}.weight", (linear.out_features, linear.in_features), "float16"))
    return write_checkpoint(path, spec)


def test_an_expert_stored_plain_beside_a_mistyped_exclusion_names_it_after_the_errors_own_hint(tmp_path):
    rule = r"-:.*mlp\.expert\.1\..*"  # (expert, not experts)
    src = _moe(tmp_path / "in", {rule: {}}, plain_expert=1)
    with pytest.raises(InputError, match=r"expert 1 of '\w+' is stored unquantized .* but the config quantizes it") \
            as raised:
        build_plan(src)
    assert raised.value.hint.startswith("say in the config that it is not quantized")
    assert raised.value.hint.endswith(f"; dynamic rule '{rule}' matches no module in the checkpoint (a typo? the "
                                      "modules it was meant for take other settings)")
