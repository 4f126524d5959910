"""``dynamic`` rules and AutoRound ``extra_config`` entries that match no module the checkpoint stores: a typo there
(``gate_prj`` for ``gate_proj``) was silently unused and surfaced, if at all, as a bare shape error. Now a shape error
of a layer whose tensors contradict its resolved settings names them in its hint, and a plan that goes through says
so in a note (the report, ``inspect``, ``--dry-run`` and the manifest). "Matches" is decided against the source's own
module names, per-expert or stacked, and any stored module counts, plain ones too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from edit_checkpoint import set_quant_config
from make_gptq_checkpoint import TensorSpec, qwen3_moe, tiny_llama, write_checkpoint

from marlin_convert.cli.app import main
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError, SettingsMismatchError
from marlin_convert.manifest import load_manifest

TYPO = r"+:model\.layers\.\d+\.mlp\.gate_prj"
TYPO_NOTE = (f"dynamic rule '{TYPO}' matches no module in the checkpoint: no module takes its settings from it (a "
             "typo in a module name?)")
BASE = "model.layers.0.mlp.experts"
GPTQMODEL_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gptqmodel"


def _unused_notes(notes: list[str]) -> list[str]:
    return [note for note in notes if "no module in the checkpoint" in note]


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


# ------------------------------------------------------------------------------------------------ the note


def test_a_conversion_notes_the_rules_that_match_no_module(tmp_path, capsys):
    src = _tiny(tmp_path / "in")
    # used: a rule for stored quantized layers, one excluding the plain lm_head, one excluding the plain embedding
    set_quant_config(src, dynamic={TYPO: {"bits": 8}, r"+:.*\.down_proj": {"sym": True}, "-:lm_head": {},
                                   r"-:model\.embed_tokens": {}})
    assert _unused_notes(build_plan(src).notes) == [TYPO_NOTE]
    for args in (["inspect", str(src)], [str(src), str(tmp_path / "dry"), "--dry-run"]):
        assert main(args) == 0
        assert f"note: {TYPO_NOTE}" in capsys.readouterr().out.splitlines()
    out = tmp_path / "out"
    assert _unused_notes(convert(src, out, workers=1).notes) == [TYPO_NOTE]
    assert _unused_notes(load_manifest(out)["notes"]) == [TYPO_NOTE]


def test_an_extra_config_entry_that_names_no_module_is_noted(tmp_path):
    src = _tiny(tmp_path / "in")
    set_quant_config(src, extra_config={"model.layers.0.self_attn.k_proj": {"bits": 4},
                                        "model.layers.2.self_attn.k_proj": {"bits": 4}})  # (there is no layer 2)
    assert _unused_notes(build_plan(src).notes) == [
        "extra_config entry 'model.layers.2.self_attn.k_proj' matches no module in the checkpoint: no module takes "
        "its settings from it (a typo in a module name?)"]


@pytest.mark.parametrize("tied", [True, False])
def test_the_lm_head_rule_gptqmodel_adds_is_not_noted_where_no_lm_head_is_stored(tmp_path, tied):
    """GPTQModel writes ``"lm_head": {...}`` itself; with the lm_head tied to the embeddings (not stored) the rule
    names nothing by design. Where one is stored under a longer name (``model.lm_head``), the rule, matched from the
    name's start, applies to nothing: noted."""
    spec = tiny_llama(num_layers=1)
    head = next(tensor for tensor in spec.extras if tensor.name == "lm_head.weight")
    if tied:
        spec.extras.remove(head)
    else:
        head.name = "model.lm_head.weight"
    spec.dynamic = {"lm_head": {"bits": 8, "group_size": 32}}
    notes = _unused_notes(build_plan(write_checkpoint(tmp_path / "in", spec)).notes)
    assert notes == ([] if tied else ["dynamic rule 'lm_head' matches no module in the checkpoint: no module takes "
                                      "its settings from it (a typo in a module name?)"])


# ------------------------------------------------------------------------------------ every rule matches
# Each case also runs with a mistyped rule (or entry) added last: the note then names that one alone, so every other
# rule was counted as used.


def _with_typo(rules: dict, typo: bool, key: str = TYPO) -> dict:
    return {**rules, key: {}} if typo else rules


def _expected(typo: bool, kind: str = "dynamic rule", key: str = TYPO) -> list[str]:
    return [f"{kind} '{key}' matches no module in the checkpoint: no module takes its settings from it (a typo in a "
            "module name?)"] if typo else []


PER_EXPERT_RULES = {r"+:.*mlp\.experts\.\d+\.down_proj": {"group_size": 32}, r"-:.*mlp\.gate$": {}}


@pytest.mark.parametrize("typo", [False, True])
@pytest.mark.parametrize("stack", [False, True])
def test_rules_for_per_expert_names_are_used_with_or_without_stacking_them(tmp_path, stack, typo):
    """With --stack-experts the output's entry is ``<base>.down_proj``, which the rule does not match: what counts is
    the source's per-expert names. The router's exclusion matches its plain weight."""
    src = _moe(tmp_path / "in", _with_typo(PER_EXPERT_RULES, typo))
    plan = build_plan(src, stack_experts=stack)
    assert (f"{BASE}.down_proj" in {output.prefix for output in plan.outputs}) == stack
    assert _unused_notes(plan.notes) == _expected(typo)


@pytest.mark.parametrize("typo", [False, True])
def test_rules_for_a_stacked_tensor_and_for_its_experts_names_are_used(tmp_path, typo):
    """A stacked 3-D source: a rule for its own name, and one for an expert's per-expert name with its settings (the
    converter resolves the experts' names too, and would refuse such a rule giving other settings)."""
    rules = {r"+:.*mlp\.experts\.1\..*": {"group_size": 32}, r"+:.*experts\.down_proj": {"group_size": 32}}
    plan = build_plan(_moe(tmp_path / "in", _with_typo(rules, typo), stacked=True), stack_experts=True)
    assert [layer.spec.num_experts for layer in plan.layers if ".experts." in layer.prefix] == [4, 4]
    assert _unused_notes(plan.notes) == _expected(typo)


@pytest.mark.parametrize("typo", [False, True])
def test_autoround_entries_that_each_match_a_module_are_not_noted(tmp_path, typo):
    """As AutoRound writes them: one module 8-bit by its name, one left unquantized (bits 16, its plain weight
    stored), the lm_head stated unquantized, a regex for another's group size."""
    spec = tiny_llama(num_layers=2, group_size=64)
    for linear in list(spec.linears):
        if linear.name == "model.layers.0.self_attn.k_proj":
            linear.bits = 8
        elif linear.name == "model.layers.1.self_attn.o_proj":
            spec.linears.remove(linear)
            spec.extras.append(TensorSpec(f"{linear.name}.weight", (linear.out_features, linear.in_features),
                                          "float16"))
        elif linear.name == "model.layers.1.mlp.up_proj":
            linear.group_size = 32
    entries = {"model.layers.0.self_attn.k_proj": {"bits": 8}, "model.layers.1.self_attn.o_proj": {"bits": 16},
               "lm_head": {"bits": 16, "data_type": "float"}, r".*layers\.1\.mlp\.up_proj.*": {"group_size": 32}}
    typo_key = r".*layers\.1\.mlp\.up_prj.*"
    spec.quantization_extra = {"provider": "auto-round", "data_type": "int",
                               "extra_config": _with_typo(entries, typo, typo_key)}
    plan = build_plan(write_checkpoint(tmp_path / "in", spec))
    assert {layer.prefix: layer.spec.bits for layer in plan.layers}["model.layers.0.self_attn.k_proj"] == 8
    assert _unused_notes(plan.notes) == _expected(typo, "extra_config entry", typo_key)


@pytest.mark.parametrize("typo", [False, True])
@pytest.mark.parametrize("case", ["dynamic_lm_head", "qwen3_moe"])
def test_gptqmodels_own_rules_are_not_noted(tmp_path, case, typo):
    """GPTQModel's output (dynamic_lm_head: an exclusion of the plain o_proj, two overrides and its own lm_head
    rule)."""
    src = tmp_path / case
    shutil.copytree(GPTQMODEL_FIXTURES / case, src)
    rules = json.loads((src / "quantize_config.json").read_text()).get("dynamic") or {}
    assert len(rules) == (4 if case == "dynamic_lm_head" else 0)
    set_quant_config(src, dynamic=_with_typo(rules, typo))
    assert _unused_notes(build_plan(src).notes) == _expected(typo)


# ------------------------------------------------------------------------- exclusions written by design

EXCLUDES_NOTHING = ("nothing here (usual for parts of the model family this checkpoint does not store: a vision tower, "
                    "MTP layers, a MoE router; a typo only if a module meant to stay unquantized is converted)")


@pytest.mark.parametrize("key", ["dynamic", "extra_config"])
def test_exclusions_for_parts_a_checkpoint_does_not_store_are_not_called_typos(tmp_path, key):
    """Real configs exclude parts of the model family that a given checkpoint does not store: a text-only
    checkpoint's ``-:.*visual.*`` and ``-:.*mtp.*`` (GPTQModel scripts for Qwen3.5-style models), a router's
    ``-:.*\\.mlp\\.gate$`` on a dense model; AutoRound's bits-16 entries for a vision tower or MTP layer. They change
    nothing: the note says so, and keeps 'a typo in a module name?' for an override that matches nothing."""
    src = _tiny(tmp_path / "in")
    if key == "dynamic":
        rules = {r"-:.*visual.*": {}, r"-:.*mtp.*": {}, r"-:.*\.mlp\.gate$": {}, TYPO: {"bits": 4}}
        excluded = r"3 rules of the config match no module in the checkpoint: dynamic rule '-:.*visual.*', " \
                   r"dynamic rule '-:.*mtp.*', dynamic rule '-:.*\.mlp\.gate$': they exclude "
        set_quant_config(src, dynamic=rules)
        expected = [TYPO_NOTE, excluded + EXCLUDES_NOTHING]
    else:
        set_quant_config(src, provider="auto-round", extra_config={"model.visual.blocks.0.attn.qkv": {"bits": 16}})
        expected = ["extra_config entry 'model.visual.blocks.0.attn.qkv' matches no module in the checkpoint: it "
                    f"excludes {EXCLUDES_NOTHING}"]
    assert _unused_notes(build_plan(src).notes) == expected


def test_extra_config_entries_naming_no_stored_module_are_found_without_a_scan_each(tmp_path, monkeypatch):
    """An AutoRound config of per-module entries none of whose names is stored (another prefix: a 48-layer MoE's
    500 such entries each matched against 18,771 names took 8 s): an entry with no regex character is a module
    name whose pieces between the dots are literal, so one whose piece is in no stored name is unused without being
    matched name by name. Entries that match a stored name as a regular expression (re.search) still count as used."""
    import marlin_convert.gptq as gptq

    src = _tiny(tmp_path / "in")
    missing = {f"model.language_model.layers.{i}.self_attn.{p}_proj": {"bits": 4} for i in range(2) for p in "qkvo"}
    used = {"layers.0.mlp.down_proj": {"bits": 4}, "model.layers.1.self_attn.q": {"bits": 4}}  # (a suffix, a prefix)
    set_quant_config(src, extra_config={**missing, **used})
    checkpoint = gptq.open_checkpoint(src)
    calls, matched = [], gptq.config_regex_match

    def counted(pattern, module):
        calls.append(module)
        return matched(pattern, module)

    monkeypatch.setattr(gptq, "config_regex_match", counted)
    assert [rule.key for rule in gptq.unused_rules(checkpoint)] == list(missing)
    assert len(calls) <= 2 * len(gptq.stored_module_names(checkpoint)), len(calls)  # (the two used ones' scans)
