"""Experts of one MoE layer that the config treats differently: GPTQModel ``dynamic`` rules (and compressed-tensors'
``ignore``) that leave one expert unquantized or give it other settings.

Without ``--stack-experts`` every per-expert linear is converted by its own resolved settings and an expert left
unquantized passes through bit for bit; ``expert_groups`` summarises only sets whose experts are all converted.
``--stack-experts`` needs one layout for the whole set: such a set is refused, naming the expert and why. A stacked
3-D source tensor has one set of settings: rules that give one of its experts others are refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from ct_checkpoint import Linear, config_group, quantization_config, scheme, write_compressed_tensors
from make_gptq_checkpoint import TensorSpec, qwen3_moe, write_checkpoint

from marlin_convert import layout
from marlin_convert.cli.app import main
from marlin_convert.convert import build_plan
from marlin_convert.errors import InputError, UnsupportedLayerError
from marlin_convert.manifest import MANIFEST_FILE, load_manifest
from marlin_convert.safetensors_io import read_header, read_tensor

BASE = "model.layers.0.mlp.experts"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _rule_for(expert: int, sign: str = "+") -> str:
    return rf"{sign}:.*mlp\.experts\.{expert}\..*"


def _moe(tmp_path, dynamic: dict, unquantized=(), own: dict | None = None, missing=(), name: str = "in",
         num_experts: int = 4):
    """One Qwen3-MoE layer of ``num_experts`` experts (group size 32) with ``dynamic`` in the config; the experts in
    ``unquantized`` stored as plain float16 ``.weight`` [N, K], those in ``missing`` not stored at all, and
    ``own[e]`` the LinearSpec fields (bits, group_size) expert ``e`` is quantized with."""
    spec = qwen3_moe(num_layers=1, num_experts=num_experts, hidden=128, expert_intermediate=64, group_size=32,
                     vocab=256, dynamic=dynamic)
    linears = []
    for lin in spec.linears:
        expert = int(lin.name.split(".")[-2]) if ".experts." in lin.name else None
        if expert in missing:
            continue
        if expert in unquantized:
            spec.extras.append(TensorSpec(f"{lin.name}.weight", (lin.out_features, lin.in_features), "float16"))
            continue
        for key, value in (own or {}).get(expert, {}).items():
            setattr(lin, key, value)
        linears.append(lin)
    spec.linears = linears
    return write_checkpoint(tmp_path / name, spec)


def _tensors(directory) -> dict[str, tuple[str, np.ndarray]]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        header = read_header(path)
        out.update({name: (info.dtype, read_tensor(header, name)) for name, info in header.tensors.items()})
    return out


def _verify_exit_codes(out, src) -> list[int]:
    return [main(["verify", str(out), "--skip-kernel", "-q", *extra]) for extra in ([], ["--source", str(src)])]


# ------------------------------------------------------------------------------ without --stack-experts


@pytest.mark.parametrize("excluded", [1, 3])  # 3: the last expert, which leaves no gap in 0..2 to see
def test_an_expert_a_rule_leaves_unquantized_passes_through_and_the_others_convert_by_their_rules(tmp_path, excluded):
    """It was refused, "expert(s) 1 of 0..3 missing" (3: "config.json says num_experts = 4"), though nothing is
    missing: the '-:' rule says expert 1 is stored unquantized. Expert 2 has a group size of its own."""
    other = 2
    src = _moe(tmp_path, {_rule_for(excluded, "-"): {}, _rule_for(other): {"group_size": 64}},
               unquantized={excluded}, own={other: {"group_size": 64}})
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    source, converted = _tensors(src), _tensors(out)
    for projection in PROJECTIONS:
        plain = f"{BASE}.{excluded}.{projection}.weight"
        assert converted[plain][0] == source[plain][0] == "F16"
        assert converted[plain][1].tobytes() == source[plain][1].tobytes()
        assert not any(name.startswith(f"{BASE}.{excluded}.{projection}.") and name != plain for name in converted)
        for expert in set(range(4)) - {excluded}:
            p = f"{BASE}.{expert}.{projection}"
            assert np.array_equal(converted[f"{p}.B"][1], layout.gptq_to_marlin_weight(source[f"{p}.qweight"][1]))
            assert np.array_equal(converted[f"{p}.s"][1], layout.permute_scales(source[f"{p}.scales"][1]))
    manifest = load_manifest(out)
    entries = {entry["name"]: entry for entry in manifest["layers"]}
    assert not any(f".experts.{excluded}." in name for name in entries)
    down = {e: entries.get(f"{BASE}.{e}.down_proj") for e in range(4)}
    assert (down[other]["group_size"], down[other]["num_groups"]) == (64, 1)
    assert (down[0]["group_size"], down[0]["num_groups"]) == (32, 2)
    assert f"{BASE}.{excluded}.down_proj.weight" in {entry["name"] for entry in manifest["passthrough"]}
    # the set is not complete in Marlin form: not summarised as a group (its converted experts are entries of their own)
    assert [group for group in manifest["expert_groups"] if group["base"] == BASE] == []
    assert _verify_exit_codes(out, src) == [0, 0]


def test_inspect_and_convert_count_the_experts_a_rule_leaves_unquantized(tmp_path, capsys):
    """The experts column of a set with expert 1 excluded said 3, as if the model had three experts; it now says
    '3 + 1 plain' (the plain one passes through)."""
    src = _moe(tmp_path, {_rule_for(1, "-"): {}}, unquantized={1})
    for args in (["inspect", str(src)], [str(src), str(tmp_path / "out")]):
        assert main(args) == 0
        text = capsys.readouterr().out
        rows = [line for line in text.splitlines() if f"{BASE}.*." in line]
        assert len(rows) == len(PROJECTIONS) and all("│ 3 + 1 plain" in row for row in rows), text
    every = _moe(tmp_path, {}, name="every")
    assert main(["inspect", str(every)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if f"{BASE}.*." in line]
    assert rows and all("plain" not in row and "│ 4 " in row for row in rows)


def test_experts_that_differ_only_in_group_size_are_still_one_group(tmp_path):
    src = _moe(tmp_path, {_rule_for(2): {"group_size": 64}}, own={2: {"group_size": 64}})
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    manifest = load_manifest(out)
    down = next(g for g in manifest["expert_groups"] if g["projection"] == "down_proj")
    assert down["num_experts"] == 4 and down["layers"] == [f"{BASE}.{e}.down_proj" for e in range(4)]
    sizes = {entry["name"]: entry["group_size"] for entry in manifest["layers"]}
    assert [sizes[f"{BASE}.{e}.down_proj"] for e in range(4)] == [32, 32, 64, 32]
    assert _verify_exit_codes(out, src) == [0, 0]


@pytest.fixture
def mixed_output(tmp_path):
    """Expert 1 left unquantized, expert 2 at group size 64, converted: (source, output)."""
    src = _moe(tmp_path, {_rule_for(1, "-"): {}, _rule_for(2): {"group_size": 64}}, unquantized={1},
               own={2: {"group_size": 64}})
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    return src, out


def _flip_byte_of(out, tensor: str) -> None:
    for path in out.glob("*.safetensors"):
        info = read_header(path).tensors.get(tensor)
        if info is not None:
            data = bytearray(path.read_bytes())
            data[info.begin + 3] ^= 0x01
            path.write_bytes(bytes(data))
            return
    raise AssertionError(tensor)


def _edit_manifest(out, change) -> None:
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    change(manifest)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))


def _forge_incomplete_group(manifest) -> None:
    """What the manifest would say if it summarised experts 0, 2 and 3 as a set of three."""
    layers = [f"{BASE}.{e}.down_proj" for e in (0, 2, 3)]
    first = next(entry for entry in manifest["layers"] if entry["name"] == layers[0])
    manifest["expert_groups"].append({"base": BASE, "projection": "down_proj", "num_experts": 3,
                                      "in_features": first["in_features"], "out_features": first["out_features"],
                                      "workspace_ints_per_expert": first["workspace"]["ints"], "layers": layers})


@pytest.mark.parametrize("tamper, found", [
    (lambda out: _flip_byte_of(out, f"{BASE}.1.up_proj.weight"), f"{BASE}.1.up_proj.weight"),
    (lambda out: _flip_byte_of(out, f"{BASE}.2.up_proj.s"), f"{BASE}.2.up_proj"),
    (lambda out: _edit_manifest(out, _forge_incomplete_group), "manifest expert_groups has 1 group(s), the layers "
                                                               "make 0"),
])
@pytest.mark.parametrize("with_source", [False, True])
def test_verify_still_catches_tampering_with_such_an_output(mixed_output, capsys, tamper, found, with_source):
    src, out = mixed_output
    tamper(out)
    extra = ["--source", str(src)] if with_source else []
    assert main(["verify", str(out), "--skip-kernel", "-q", *extra]) == 1
    captured = capsys.readouterr()
    assert found in captured.out + captured.err


def test_a_group_of_experts_some_kept_in_gptq_form_is_not_summarised(tmp_path):
    """--skip-incompatible keeps a 2-bit expert in GPTQ form: the set's other experts convert, and expert_groups no
    longer lists the set as three experts with a gap at 2 (it did)."""
    src = _moe(tmp_path, {_rule_for(2): {"bits": 2}}, own={2: {"bits": 2}})
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--skip-incompatible"]) == 0
    manifest = load_manifest(out)
    assert sorted(entry["name"] for entry in manifest["kept"]) == sorted(f"{BASE}.2.{p}" for p in PROJECTIONS)
    assert [group for group in manifest["expert_groups"] if group["base"] == BASE] == []
    assert _verify_exit_codes(out, src) == [0, 0]


def test_a_compressed_tensors_expert_in_ignore_passes_through(tmp_path):
    src, out = _ct_moe(tmp_path), tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    source, converted = _tensors(src), _tensors(out)
    plain = f"{BASE}.1.down_proj.weight"
    assert converted[plain][1].tobytes() == source[plain][1].tobytes()
    assert {f"{BASE}.{e}.down_proj.B" for e in (0, 2)} <= set(converted)
    assert load_manifest(out)["expert_groups"] == []
    assert _verify_exit_codes(out, src) == [0, 0]


def _ct_moe(tmp_path):
    """compressed-tensors, experts 0..2 of down_proj; ``ignore`` keeps expert 1 unquantized (a plain .weight)."""
    rng = np.random.default_rng(3)
    config = quantization_config({"group_0": config_group(["Linear"], scheme())},
                                 ignore=["lm_head", f"{BASE}.1.down_proj"])
    extras = {f"{BASE}.1.down_proj.weight": ("F16", rng.normal(size=(128, 128)).astype(np.float16)),
              "lm_head.weight": ("F16", rng.normal(size=(64, 128)).astype(np.float16))}
    linears = [Linear(f"{BASE}.{e}.down_proj", 128, 128) for e in (0, 2)]
    return write_compressed_tensors(tmp_path / "ct", linears, config, extras=extras)


# ------------------------------------------------------------------------------- with --stack-experts


STACK_REFUSALS = {
    "an expert left unquantized": (
        dict(dynamic={_rule_for(1, "-"): {}}, unquantized={1}),
        f"layer '{BASE}': expert 1 of 'down_proj' is not quantized (dynamic rule "
        + json.dumps(_rule_for(1, "-"))),
    "the last expert left unquantized": (
        dict(dynamic={_rule_for(3, "-"): {}}, unquantized={3}),
        f"layer '{BASE}': expert 3 of 'down_proj' is not quantized (dynamic rule "),
    "another group size": (
        dict(dynamic={_rule_for(2): {"group_size": 64}}, own={2: {"group_size": 64}}),
        f"layer '{BASE}': expert 2 of 'down_proj' has group size 64 (dynamic rule " + json.dumps(_rule_for(2))
        + " in {src}/quantize_config.json), expert 0 has group size 32 (the config)"),
    "other bits": (
        dict(dynamic={_rule_for(2): {"bits": 8}}, own={2: {"bits": 8}}),
        f"layer '{BASE}': expert 2 of 'down_proj' has 8 bits (dynamic rule " + json.dumps(_rule_for(2))),
}


@pytest.mark.parametrize("case", list(STACK_REFUSALS))
def test_stack_experts_refuses_a_set_it_cannot_stack_saying_why(tmp_path, capsys, case):
    kwargs, message = STACK_REFUSALS[case]
    src = _moe(tmp_path, **kwargs)
    message = message.replace("{src}", str(src))
    for extra in ([], ["--dry-run"]):
        assert main([str(src), str(tmp_path / "out"), "-q", "--stack-experts", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("Error:") == 1 and message in err, err
        assert "cannot be stacked" in err and "Hint: convert without --stack-experts" in err, err
        assert "missing" not in err
        assert not (tmp_path / "out").exists()
    with pytest.raises(UnsupportedLayerError, match="cannot be stacked"):
        build_plan(src, stack_experts=True)


def test_stack_experts_names_the_plain_tensor_of_the_expert_left_unquantized(tmp_path):
    src = _moe(tmp_path, {_rule_for(1, "-"): {}}, unquantized={1})
    with pytest.raises(UnsupportedLayerError) as caught:
        build_plan(src, stack_experts=True)
    assert f"'{BASE}.1.down_proj.weight' is stored unquantized" in caught.value.message
    assert str(src / "quantize_config.json") in caught.value.message


def test_stack_experts_refuses_a_set_with_an_expert_kept_in_gptq_form(tmp_path, capsys):
    """It wrote the set per expert with a note; --stack-experts now stacks every set or says why it cannot."""
    src = _moe(tmp_path, {_rule_for(2): {"bits": 2}}, own={2: {"bits": 2}})
    assert main([str(src), str(tmp_path / "out"), "-q", "--stack-experts", "--skip-incompatible"]) == 2
    err = capsys.readouterr().err
    assert (f"layer '{BASE}': expert 2 of 'down_proj' has no Marlin form (2-bit weights: Marlin has 4- and 8-bit "
            "forms only) and stays in its source form") in err, err


def test_stack_experts_keeps_a_set_none_of_whose_experts_has_a_marlin_form(tmp_path):
    """Every expert 2-bit, with --skip-incompatible: nothing of the sets can be stacked, and each expert is kept as
    --skip-incompatible keeps a layer, while the attention converts (a false-positive hunt found the whole run
    refused)."""
    src = _moe(tmp_path, {r"+:.*mlp\.experts\..*": {"bits": 2}}, own={e: {"bits": 2} for e in range(4)})
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--stack-experts", "--skip-incompatible"]) == 0
    manifest = load_manifest(out)
    assert sorted(entry["name"] for entry in manifest["kept"]) == sorted(
        f"{BASE}.{e}.{projection}" for e in range(4) for projection in ("gate_proj", "up_proj", "down_proj"))
    assert manifest["layers"] and not any(entry["num_experts"] for entry in manifest["layers"])
    assert _verify_exit_codes(out, src) == [0, 0]


def test_stack_experts_refuses_a_compressed_tensors_expert_in_ignore(tmp_path, capsys):
    src = _ct_moe(tmp_path)
    assert main([str(src), str(tmp_path / "out"), "-q", "--stack-experts"]) == 2
    err = capsys.readouterr().err
    assert (f"layer '{BASE}': expert 1 of 'down_proj' is not quantized (ignore entry \"{BASE}.1.down_proj\" in "
            in err), err
    assert "cannot be stacked" in err


def test_stack_experts_stacks_experts_whose_rule_changes_nothing_of_the_layout(tmp_path):
    """desc_act true for expert 2, whose g_idx is trivial all the same: one layout, stacked."""
    src = _moe(tmp_path, {_rule_for(2): {"desc_act": True}})
    plan = build_plan(src, stack_experts=True)
    assert any(output.prefix == f"{BASE}.down_proj" for output in plan.outputs)


# ----------------------------------------------------------------------------------- real gaps stay errors


@pytest.mark.parametrize("stack", [False, True])
def test_an_expert_stored_nowhere_is_still_missing(tmp_path, capsys, stack):
    src = _moe(tmp_path, {}, missing={1})
    assert main([str(src), str(tmp_path / "out"), "-q", *(["--stack-experts"] if stack else [])]) == 2
    err = capsys.readouterr().err
    assert (f"layer '{BASE}': expert(s) 1 of 0..3 missing for 'down_proj' (no {BASE}.<e>.down_proj.qweight)"
            in err), err


def test_an_expert_a_rule_leaves_unquantized_but_stored_nowhere_is_missing_naming_its_weight(tmp_path):
    src = _moe(tmp_path, {_rule_for(1, "-"): {}}, missing={1})
    with pytest.raises(InputError, match=rf"expert\(s\) 1 of 0..3 missing for 'down_proj' \(no "
                                         rf"{BASE}.1.down_proj.weight, which dynamic rule .* leaves unquantized\)"):
        build_plan(src)


@pytest.mark.parametrize("stack", [False, True])
def test_an_expert_stored_unquantized_that_the_config_quantizes_is_refused(tmp_path, capsys, stack):
    """No rule says expert 1 is not quantized, yet it is stored as a plain weight: the config contradicts the
    checkpoint (a loader would look for its quantized tensors), as a '-:' rule on a stored qweight does."""
    src = _moe(tmp_path, {}, unquantized={1})
    assert main([str(src), str(tmp_path / "out"), "-q", *(["--stack-experts"] if stack else [])]) == 2
    err = capsys.readouterr().err
    assert (f"layer '{BASE}': expert 1 of 'down_proj' is stored unquantized ('{BASE}.1.down_proj.weight'), but "
            "the config quantizes it") in err, err


# ------------------------------------------------------------------------------ stacked 3-D source experts


def _stacked(tmp_path, dynamic):
    return write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64,
                                                       group_size=32, vocab=256, stacked=True, dynamic=dynamic))


@pytest.mark.parametrize("rule, body, says", [
    (_rule_for(1, "-"), {}, "is not quantized"),
    (_rule_for(2), {"group_size": 64}, "group size 64"),
    (_rule_for(3), {"bits": 8}, "bits 8"),
])
def test_a_rule_for_one_expert_of_a_stacked_tensor_is_refused(tmp_path, capsys, rule, body, says):
    """One 3-D tensor holds every expert with one set of settings: a rule naming one expert by its per-expert name
    cannot apply to it (it was ignored, and the stacked tensor converted with the defaults)."""
    src = _stacked(tmp_path, {rule: body})
    expert = rule.split("experts")[1][2]
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert (f"layer '{BASE}.down_proj' holds 4 experts stacked in one tensor, but dynamic rule {json.dumps(rule)}"
            in err and f"expert {expert} ('{BASE}.{expert}.down_proj') {says}" in err), err
    assert "Hint:" in err and not (tmp_path / "out").exists()


def test_a_rule_that_gives_every_expert_of_a_stacked_tensor_its_settings_converts(tmp_path):
    """A rule naming every expert with the stacked tensor's own settings, and one that changes only desc_act (the
    stored g_idx decides act-order, per expert), leave one layout: converted."""
    src = _stacked(tmp_path, {_rule_for(1): {"desc_act": True}, r"+:.*mlp\.experts\..*": {"group_size": 32}})
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert _verify_exit_codes(out, src) == [0, 0]


@pytest.mark.parametrize("field, value, flags", [("group_size", 64, []), ("bits", 8, []),
                                                 ("bits", 2, ["--skip-incompatible"])])
def test_a_rule_on_the_stacked_tensors_own_name_applies_to_it(tmp_path, field, value, flags):
    """A rule written for the stacked module's own name (``+:.*experts\\.down_proj``, as the refusal's hint says)
    matches no per-expert name: those take the stacked layer's settings, not the defaults, and nothing is refused (an
    attack helper found this refused, and a kept stacked 2-bit layer failing plain verify)."""
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64, group_size=32, vocab=256,
                     stacked=True, dynamic={r"+:.*experts\.down_proj": {field: value}})
    setattr(next(linear for linear in spec.linears if linear.name.endswith("experts.down_proj")), field, value)
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", *flags]) == 0
    assert _verify_exit_codes(out, src) == [0, 0]


def test_a_broad_rule_after_the_stacked_names_own_rule_does_not_single_out_experts(tmp_path):
    """``+:.*experts\\.down_proj`` (8-bit, the stacked name's own rule) then ``+:.*``: the per-expert names fall through
    to the broad rule, which matches the stacked name too and so says nothing of experts; this converted before the
    per-expert check, which a review found refusing it."""
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64, group_size=32, vocab=256,
                     stacked=True, dynamic={r"+:.*experts\.down_proj": {"bits": 8}, "+:.*": {"desc_act": False}})
    next(linear for linear in spec.linears if linear.name.endswith("experts.down_proj")).bits = 8
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert _verify_exit_codes(out, src) == [0, 0]


def test_what_a_stacked_set_must_share_covers_every_field_of_the_spec():
    """_unstackable compares the experts field by field (STACKED_FIELDS); the comparison it replaced went over the
    whole QuantSpec but act_order and zero_format, so a field added to QuantSpec later would have split a set. A review
    asked that a new field not stack silently: each field is either compared or named here as free per expert."""
    import dataclasses

    from marlin_convert.convert import STACKED_FIELDS
    from marlin_convert.spec import QuantSpec

    free_per_expert = {"act_order", "zero_format", "num_experts"}  # (perm / g_idx and zp are per expert; num_experts:
    # a stacked source is refused before the comparison)
    compared = {name for name, _ in STACKED_FIELDS}
    assert compared | free_per_expert == {field.name for field in dataclasses.fields(QuantSpec)}
    assert not compared & free_per_expert
