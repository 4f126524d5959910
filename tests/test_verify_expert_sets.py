"""Plain ``verify OUT_DIR`` holds an MoE output's expert sets as ``convert`` holds a source's (an attack helper found
each of these forged outputs, re-signed, passing it):

- an expert passed through as a plain ``.weight`` beside converted siblings must resolve as not quantized under each
  output config (a loader would otherwise look for its Marlin tensors), whatever ``quantization_defaults`` says and
  whether or not a compressed-tensors source's output states ``dynamic``;
- every projection of a set has experts 0..E-1 (converted, kept, or passed through as a plain ``.weight``), E the
  number of experts the output's config.json states; a stacked layer holds that many.

Legitimate outputs (mixed, uniform, stacked, kept experts, dense) still verify.
"""

from __future__ import annotations

import json

import pytest
from make_gptq_checkpoint import tiny_llama, write_checkpoint
from test_moe_dynamic import BASE, PROJECTIONS, _ct_moe, _moe, _rule_for
from test_verify_source import edit_manifest, problems_of, resign, rewrite_shard

from marlin_convert.cli.app import main
from marlin_convert.experts import expert_group_summary
from marlin_convert.verify import verify


def _check(out, source=None):
    report = verify(out, gpus=None, workers=1, source_dir=source)
    return report.ok, problems_of(report)


def _assert_fails(out, *expected, source=None) -> list[str]:
    ok, found = _check(out, source)
    assert not ok, "passed"
    for text in expected:
        assert any(text in problem for problem in found), (text, found)
    return found


def _convert(src, out, *flags):
    assert main([str(src), str(out), "-q", *flags]) == 0
    return out


def _set_dynamic(out, dynamic, files=("config.json", "quantize_config.json")) -> None:
    """Each output config of ``files`` with ``dynamic`` (None: the key deleted)."""
    for name in files:
        path = out / name
        data = json.loads(path.read_text())
        section = data["quantization_config"] if name == "config.json" else data
        if dynamic is None:
            section.pop("dynamic", None)
        else:
            section["dynamic"] = dynamic
        path.write_text(json.dumps(data, indent=2))


def _regroup(manifest) -> None:
    manifest["expert_groups"] = expert_group_summary(manifest["layers"], manifest["kept"], manifest["passthrough"])


@pytest.fixture
def mixed(tmp_path):
    """Expert 1 left unquantized by a '-:' rule (a plain .weight), its siblings converted: (source, output)."""
    src = _moe(tmp_path, {_rule_for(1, "-"): {}}, unquantized={1})
    return src, _convert(src, tmp_path / "out")


# ------------------------------------------------------- a plain expert the output configs quantize (fn1, fn4)


@pytest.mark.parametrize("files", [("config.json", "quantize_config.json"), ("quantize_config.json",),
                                   ("config.json",)])
def test_a_plain_expert_that_the_output_configs_quantize_fails_even_with_quantization_defaults_edited(mixed, files):
    """The '-:' rule removed from the config(s) and from the manifest's quantization_defaults, re-signed: nothing was
    left to say expert 1 is excluded, and plain verify passed. convert refuses this state in a source."""
    _, out = mixed
    _set_dynamic(out, {}, files)
    edit_manifest(out, lambda m: m["quantization_defaults"].update(dynamic={}))
    resign(out)
    found = _assert_fails(out, *(f"{name}: says expert module '{BASE}.1.down_proj' is quantized (the config: no "
                                 "rule)" for name in files))
    assert any(f"'{BASE}.1.down_proj.weight' is passed through unquantized beside converted 'down_proj' experts" in p
               for p in found), found


def test_a_plus_rule_that_quantizes_a_plain_expert_is_named(mixed):
    _, out = mixed
    rule = _rule_for(1)
    _set_dynamic(out, {rule: {"bits": 4}})
    edit_manifest(out, lambda m: m["quantization_defaults"].update(dynamic={rule: {"bits": 4}}))
    resign(out)
    _assert_fails(out, f"quantize_config.json: says expert module '{BASE}.1.gate_proj' is quantized (dynamic rule "
                       f"{json.dumps(rule)} in quantize_config.json)")


@pytest.mark.parametrize("with_source", [False, True])
def test_a_compressed_tensors_output_without_dynamic_fails_where_a_plain_expert_sits_beside_converted_ones(
        tmp_path, with_source):
    """Its 'dynamic' holds the converter's '-:' rule for the ignored expert; deleted, the output passed as one of a
    release before 2026-11-26, which refused every such source."""
    src = _ct_moe(tmp_path)
    out = _convert(src, tmp_path / "out")
    _set_dynamic(out, None)
    resign(out)
    _assert_fails(out, f"config.json: says expert module '{BASE}.1.down_proj' is quantized (the config: no rule)",
                  f"quantize_config.json: says expert module '{BASE}.1.down_proj' is quantized",
                  source=src if with_source else None)


# -------------------------------------------------------------------------------- an expert deleted (fn6)


def _drop(out, tensors: set[str], change) -> None:
    rewrite_shard(out / "model.safetensors", drop=tensors)
    edit_manifest(out, lambda m: (change(m), _regroup(m)))
    resign(out)


def test_a_plain_expert_deleted_leaves_a_gap(mixed):
    _, out = mixed
    gone = f"{BASE}.1.down_proj.weight"
    _drop(out, {gone}, lambda m: m.__setitem__("passthrough", [p for p in m["passthrough"] if p["name"] != gone]))
    _assert_fails(out, f"layer '{BASE}': expert(s) 1 of 0..3 missing for 'down_proj' (neither converted, kept in "
                       "its source form nor passed through as a plain .weight)")


def test_a_converted_expert_deleted_leaves_a_gap(tmp_path):
    out = _convert(_moe(tmp_path, {}), tmp_path / "out")
    name = f"{BASE}.2.down_proj"
    _drop(out, {f"{name}.B", f"{name}.s"},
          lambda m: m.__setitem__("layers", [entry for entry in m["layers"] if entry["name"] != name]))
    _assert_fails(out, f"layer '{BASE}': expert(s) 2 of 0..3 missing for 'down_proj'")


def test_the_last_expert_deleted_fails_against_config_jsons_count(tmp_path):
    """No gap to see in 0..2: config.json's num_experts = 4 says expert 3 is missing."""
    out = _convert(_moe(tmp_path, {}), tmp_path / "out")
    names = {f"{BASE}.3.{projection}" for projection in PROJECTIONS}
    _drop(out, {f"{name}.{kind}" for name in names for kind in ("B", "s")},
          lambda m: m.__setitem__("layers", [entry for entry in m["layers"] if entry["name"] not in names]))
    _assert_fails(out, f"layer '{BASE}': experts 0..2 stored, config.json says num_experts = 4 (expert(s) 3..3 "
                       "missing)")


def test_a_stacked_layer_with_another_count_than_config_json_fails(tmp_path):
    out = _convert(_moe(tmp_path, {}), tmp_path / "out", "--stack-experts")
    config = json.loads((out / "config.json").read_text())
    config["num_experts"] = 5
    (out / "config.json").write_text(json.dumps(config, indent=2))
    resign(out)
    _assert_fails(out, f"layer '{BASE}.down_proj': 4 stacked experts, config.json says num_experts = 5")


def test_a_malformed_expert_count_in_config_json_is_named(tmp_path):
    out = _convert(_moe(tmp_path, {}), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    config["num_experts"] = "4"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    resign(out)
    _assert_fails(out, "config.json: 'num_experts' must be a JSON integer >= 0 (the number of experts) or a list of them (one per "
                       "layer), got \"4\"")


# ------------------------------------------------------------------------------ legitimate outputs still pass


@pytest.mark.parametrize("case, flags", [
    ("uniform", []), ("uniform", ["--stack-experts"]), ("mixed", []), ("last expert plain", []),
    ("kept expert", ["--skip-incompatible"]), ("group size per expert", []),
])
def test_legitimate_moe_outputs_verify(tmp_path, case, flags):
    kwargs = {"uniform": dict(dynamic={}),
              "mixed": dict(dynamic={_rule_for(1, "-"): {}}, unquantized={1}),
              "last expert plain": dict(dynamic={_rule_for(3, "-"): {}}, unquantized={3}),
              "kept expert": dict(dynamic={_rule_for(2): {"bits": 2}}, own={2: {"bits": 2}}),
              "group size per expert": dict(dynamic={_rule_for(2): {"group_size": 64}}, own={2: {"group_size": 64}}),
              }[case]
    src = _moe(tmp_path, **kwargs)
    out = _convert(src, tmp_path / "out", *flags)
    for source in (None, src):
        ok, found = _check(out, source)
        assert ok, found


def test_a_compressed_tensors_mixed_output_verifies(tmp_path):
    src = _ct_moe(tmp_path)
    out = _convert(src, tmp_path / "out")
    for source in (None, src):
        ok, found = _check(out, source)
        assert ok, found


def test_a_dense_output_verifies(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, group_size=64))
    out = _convert(src, tmp_path / "out")
    ok, found = _check(out)
    assert ok, found
