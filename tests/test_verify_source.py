"""``verify --source``: an output that differs from its source anywhere fails, even when a careful forger edited the
shard headers, the index and the manifest to agree with each other and re-signed the manifest's file digests.

Each case is a tamper the audit alone cannot see (every digest is re-recorded), so only the comparison with the
source catches it; each also passes before the tamper.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from make_gptq_checkpoint import tiny_llama, write_checkpoint

from marlin_convert.convert import convert
from marlin_convert.manifest import MANIFEST_FILE
from marlin_convert.verify import verify

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-gptq"
INDEX = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------------------- helpers


def rewrite_shard(path: Path, *, drop=(), relabel=None) -> None:
    """Rewrite safetensors file ``path`` without the tensors named in ``drop`` (their bytes removed, the others'
    offsets recomputed) and with ``relabel`` ({name: {"dtype": ..., "shape": ...}}) applied to the header as is
    (the same bytes under another dtype or shape)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    body = data[8 + size:]
    new_header, new_body = {}, bytearray()
    for name, info in header.items():
        if name == "__metadata__":
            new_header[name] = info
            continue
        if name in drop:
            continue
        begin, end = info["data_offsets"]
        info = {**info, **(relabel or {}).get(name, {}), "data_offsets": [len(new_body), len(new_body) + end - begin]}
        new_header[name] = info
        new_body += body[begin:end]
    text = json.dumps(new_header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(new_body))


def edit_manifest(out: Path, change) -> None:
    path = out / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def resign(out: Path) -> None:
    """As a careful forger would: the index without the tensors no shard holds any more (total_size recomputed),
    then every file the manifest lists re-recorded with its size and SHA-256."""
    index_path = out / INDEX
    if index_path.exists():
        index = json.loads(index_path.read_text())
        held, total = set(), 0
        for shard in set(index["weight_map"].values()):
            data = (out / shard).read_bytes()
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            held |= set(header) - {"__metadata__"}
            total += max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in held}
        index["metadata"]["total_size"] = total
        index_path.write_text(json.dumps(index, indent=2))

    def sign(manifest):
        for name in list(manifest["files"]):
            data = (out / name).read_bytes()
            manifest["files"][name] = {"bytes": len(data), "sha256": "sha256:" + hashlib.sha256(data).hexdigest()}

    edit_manifest(out, sign)


def shard_of(out: Path, tensor: str) -> Path:
    index = json.loads((out / INDEX).read_text()) if (out / INDEX).exists() else None
    return out / (index["weight_map"][tensor] if index else "model.safetensors")


def check(out: Path, source: Path):
    return verify(out, gpus=None, workers=1, source_dir=source)


def problems_of(report) -> list[str]:
    found = list(report.problems)
    found += [f"{r.label}: {p}" for r in report.results for p in r.integrity_problems]
    found += [f"kept '{k.name}': {p}" for k in report.kept for p in k.problems]
    return found


def assert_fails(out: Path, source: Path, *expected: str) -> list[str]:
    report = check(out, source)
    found = problems_of(report)
    assert not report.ok, "passed"
    for text in expected:
        assert any(text in p for p in found), (text, found)
    return found


@pytest.fixture(scope="module")
def example_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("source") / "out"
    convert(EXAMPLE, out, workers=1)
    assert check(out, EXAMPLE).ok
    return out


@pytest.fixture
def out(tmp_path, example_out):
    copy = tmp_path / "out"
    shutil.copytree(example_out, copy)
    return copy


@pytest.fixture(scope="module")
def kept_case(tmp_path_factory):
    """(source, output) of a checkpoint whose down_proj is 2-bit (no Marlin form): kept with --skip-incompatible."""
    root = tmp_path_factory.mktemp("kept")
    spec = tiny_llama(num_layers=1)
    spec.linears = [lin for lin in spec.linears if lin.name.endswith(("up_proj", "down_proj"))]
    down = next(lin for lin in spec.linears if lin.name.endswith("down_proj"))
    down.bits = 2
    spec.dynamic = {"+:.*down_proj": {"bits": 2}}
    src = write_checkpoint(root / "in", spec)
    convert(src, root / "out", workers=1, skip_incompatible=True)
    assert check(root / "out", src).ok
    return src, root / "out"


# ---------------------------------------------------------------------------------------- dtype and shape


def test_a_scale_dtype_relabelled_in_the_header_fails(out):
    """F16 scales relabelled BF16 (same bytes; scale_dtype edited to match, files re-signed): the rebuilt scales
    equal the source's byte for byte, but they are another tensor (it passed: only bytes were compared)."""
    layer = "model.layers.0.mlp.down_proj"
    rewrite_shard(shard_of(out, f"{layer}.s"), relabel={f"{layer}.s": {"dtype": "BF16"}})
    edit_manifest(out, lambda m: next(e for e in m["layers"] if e["name"] == layer).update(scale_dtype="bfloat16"))
    resign(out)
    assert verify(out, gpus=None, workers=1).ok  # the output agrees with itself
    assert_fails(out, EXAMPLE, f"rebuilt scales is BF16 [4, 128], the source tensor '{layer}.scales' is F16 [4, 128]")


@pytest.mark.parametrize("relabel, said", [
    ({"dtype": "F32"}, "F32 [16, 128]"),
    ({"shape": [128, 16]}, "I32 [128, 16]"),
])
def test_a_kept_tensor_relabelled_in_the_header_fails(tmp_path, kept_case, relabel, said):
    """A kept layer's tensor with another dtype or shape in the header (same bytes, files re-signed): it passed,
    as only its bytes were compared with the source's. (Plain verify fails it too now, holding the kept tensors to
    the settings the configs give the layer: ``test_verify_kept.py``.)"""
    src, converted = kept_case
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    name = "model.layers.0.mlp.down_proj.qweight"
    info = json.loads((out / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (out / "model.safetensors").read_bytes()[:8], "little")])[name]
    assert (info["dtype"], info["shape"]) == ("I32", [16, 128])
    rewrite_shard(out / "model.safetensors", relabel={name: relabel})
    resign(out)
    assert not verify(out, gpus=None, workers=1).ok
    assert_fails(out, src, f"tensor '{name}': I32 [16, 128] in --source (model.safetensors), {said} in OUT_DIR")


# ------------------------------------------------------------------------------- the manifest against the source


def _run_cli(out: Path, source: Path, capsys) -> tuple[int, str]:
    from marlin_convert.cli.app import main

    code = main(["verify", str(out), "--skip-kernel", "-q", "--source", str(source)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_manifest_naming_a_source_tensor_the_source_lacks_fails_that_layer(out, capsys):
    """It was exit 2, "--source IN: no tensor 'foo.qweight'", blaming the source for what the manifest says."""
    edit_manifest(out, lambda m: m["layers"][0]["sources"][0]["tensors"].update(qweight="foo.qweight"))
    code, text = _run_cli(out, EXAMPLE, capsys)
    assert code == 1, text
    assert "the manifest names source tensor 'foo.qweight' (its qweight), which --source does not have" in text
    assert "Error: --source" not in text
    report = check(out, EXAMPLE)
    assert [r.name for r in report.failures] == ["model.layers.0.mlp.down_proj"]


def test_a_stacked_layer_with_another_number_of_experts_is_a_malformed_manifest(tmp_path, capsys):
    """num_experts edited against the entry's own stacked shapes: the manifest contradicts itself, so it is refused
    when it is read (exit 2, naming the field), with or without --source, before the source is opened (a source with
    another number of experts than the output: tests/test_moe.py)."""
    from make_gptq_checkpoint import qwen3_moe

    src = write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=1, num_experts=4, hidden=128,
                                                     expert_intermediate=128, vocab=64, stacked=True))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    assert check(out, src).ok

    def change(manifest):
        entry = next(e for e in manifest["layers"] if e["num_experts"] == 4)
        entry.update(num_experts=2)
        entry["sources"][0]["slices"] = [0, 2]

    edit_manifest(out, change)
    code, text = _run_cli(out, src, capsys)
    assert code == 2, text
    assert "num_experts': 2 experts, but shapes.B is [4, " in text and "Error: --source" not in text


# ------------------------------------------------------------------------------------------------ completeness


def _drop_layer(out: Path, layer: str) -> None:
    """Remove converted layer ``layer``: its tensors from its shard, the index and its manifest entry."""
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    entry = next(e for e in manifest["layers"] if e["name"] == layer)
    for shard in set(entry["shards"].values()):
        rewrite_shard(out / shard, drop=set(entry["outputs"].values()))
    edit_manifest(out, lambda m: m["layers"].remove(entry))


def _drop_passthrough(out: Path, name: str) -> None:
    rewrite_shard(shard_of(out, name), drop={name})
    edit_manifest(out, lambda m: m["passthrough"].remove(next(e for e in m["passthrough"] if e["name"] == name)))


def _drop_file(out: Path, name: str) -> None:
    (out / name).unlink()
    edit_manifest(out, lambda m: m["files"].pop(name))


def _drop_g_idx(out: Path) -> None:
    def change(manifest):
        source = manifest["layers"][0]["sources"][0]
        source.update(g_idx="absent")
        del source["tensors"]["g_idx"], source["digests"]["g_idx"]

    edit_manifest(out, change)


@pytest.mark.parametrize("tamper, found", [
    (lambda out: _drop_layer(out, "model.layers.0.self_attn.q_proj"),
     "converted layer 'model.layers.0.self_attn.q_proj' of --source: tensor(s) 'model.layers.0.self_attn.q_proj."),
    (lambda out: _drop_passthrough(out, "lm_head.weight"),
     "--source tensor 'lm_head.weight' (model-00002-of-00002.safetensors) accounted for nowhere in OUT_DIR"),
    (lambda out: _drop_file(out, "tokenizer.json"), "file tokenizer.json of --source is not in OUT_DIR"),
    (_drop_g_idx, "converted layer 'model.layers.0.mlp.down_proj' of --source: tensor(s) "
                  "'model.layers.0.mlp.down_proj.g_idx' accounted for nowhere in OUT_DIR"),
])
def test_an_output_missing_part_of_the_source_fails(out, capsys, tamper, found):
    """A layer, a passthrough tensor, a copied file or a source g_idx removed from the output (shards, index and
    manifest edited alike, files re-signed): the output agrees with itself, and all passed --source (exit 0)."""
    tamper(out)
    resign(out)
    assert verify(out, gpus=None, workers=1).ok
    assert_fails(out, EXAMPLE, found)
    code, text = _run_cli(out, EXAMPLE, capsys)
    assert code == 1 and found in text, text


def test_a_kept_layer_missing_from_the_output_fails(tmp_path, kept_case):
    src, converted = kept_case
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    rewrite_shard(out / "model.safetensors", drop=set(manifest["kept"][0]["tensors"].values()))

    def change(m):
        m["kept"] = []
        m["checkpoint_format"] = "marlin"

    edit_manifest(out, change)
    for name in ("config.json", "quantize_config.json"):
        config = json.loads((out / name).read_text())
        section = config.get("quantization_config", config)
        section.pop("modules_in_gptq_form")
        section.update(checkpoint_format="marlin", is_marlin_format=True)
        (out / name).write_text(json.dumps(config))
    resign(out)
    assert verify(out, gpus=None, workers=1).ok
    assert_fails(out, src, "layer 'model.layers.0.mlp.down_proj' of --source, kept in its source form: tensor(s) ")


def test_a_file_the_conversion_does_not_copy_fails(out, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(EXAMPLE, source)
    (source / ".hidden").write_text("x")
    (out / ".hidden").write_text("x")
    edit_manifest(out, lambda m: m["files"].update({".hidden": {}}))
    resign(out)
    assert verify(out, gpus=None, workers=1).ok
    assert_fails(out, source, "file .hidden is in OUT_DIR, but converting --source does not copy it")


# ------------------------------------------------------------------------------------------------------ configs


def _set_config(out: Path, name: str, change) -> None:
    config = json.loads((out / name).read_text())
    change(config)
    (out / name).write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("name, change, found", [
    ("config.json", lambda c: c.update(vocab_size=512), "config.json: vocab_size is 512, converting --source writes 256"),
    ("config.json", lambda c: c.update(architectures=["MistralForCausalLM"]),
     'config.json: architectures[0] is "MistralForCausalLM", converting --source writes "LlamaForCausalLM"'),
    ("config.json", lambda c: c["quantization_config"].update(pack_dtype="int8"),
     'config.json: quantization_config.pack_dtype is "int8", converting --source writes absent'),
    ("quantize_config.json", lambda c: c.pop("true_sequential"),
     "quantize_config.json: true_sequential is absent, converting --source writes true"),
])
def test_configs_that_differ_from_what_the_source_converts_to_fail(out, name, change, found):
    """Only format, bits, group_size and sym were compared (with the manifest, not the source): a config edited
    elsewhere, files re-signed, passed --source."""
    _set_config(out, name, change)
    resign(out)
    assert verify(out, gpus=None, workers=1).ok
    assert_fails(out, EXAMPLE, found)


@pytest.mark.parametrize("change, alone, found", [
    (lambda c: c["quantization_config"].update(desc_act=True),
     "config.json: desc_act is true, the manifest's quantization_defaults.desc_act is false",
     "config.json: quantization_config.desc_act is true, converting --source writes false"),
    (lambda c: c["quantization_config"].update(bits=4.0),
     "config.json: bits is 4.0, the manifest's quantization_defaults.bits is 4",
     "config.json: quantization_config.bits is 4.0, converting --source writes 4"),
])
def test_config_defaults_that_differ_from_the_manifest_fail_with_or_without_source(out, change, alone, found):
    """A default the output config keeps as read is held to the manifest's quantization_defaults without --source
    (an attack helper: an edit to either passed verify), and to the source's with it."""
    _set_config(out, "config.json", change)
    resign(out)
    assert_fails(out, None, alone)
    assert_fails(out, EXAMPLE, found)


@pytest.mark.parametrize("change, found", [
    (lambda m: m["source"].update(quantization_config=["quantize_config.json"]),
     "the manifest's source.quantization_config is [\"quantize_config.json\"], converting --source records"),
    (lambda m: m["source"].update(bytes=2**63), f"the manifest's source.bytes is {2**63}, converting --source records"),
])
def test_a_manifest_whose_record_of_the_source_config_was_edited_fails(out, change, found):
    """The manifest's ``quantization_defaults`` (the config's global settings, exactly as read) and
    ``source.quantization_config`` were compared with nothing: edited to say 8 bits where the source says 4, verify
    --source passed (found by an attack helper). They are now held to what converting the source records."""
    edit_manifest(out, change)
    assert verify(out, gpus=None, workers=1).ok
    assert_fails(out, EXAMPLE, found)


@pytest.mark.parametrize("change, alone, found", [
    (lambda m: m["quantization_defaults"].update(bits=8, group_size=32, sym=False),
     "quantize_config.json: bits is 4, the manifest's quantization_defaults.bits is 8",
     "the manifest's quantization_defaults.bits is 8, converting --source records 4"),
    (lambda m: m["quantization_defaults"].update(desc_act=True),
     "config.json: desc_act is false, the manifest's quantization_defaults.desc_act is true",
     "the manifest's quantization_defaults.desc_act is true, converting --source records false"),
])
def test_manifest_defaults_that_differ_from_the_output_configs_fail_without_source(out, change, alone, found):
    """An attack helper: quantization_defaults edited to 8 bits passed verify without --source, though the output's
    own configs, which keep the defaults as read, say 4."""
    edit_manifest(out, change)
    assert_fails(out, None, alone)
    assert_fails(out, EXAMPLE, found)


def test_a_compressed_tensors_source_config_edited_in_the_output_fails(tmp_path):
    fixture = Path(__file__).resolve().parent / "fixtures" / "llmcompressor" / "w4a16_g128"
    out = tmp_path / "out"
    convert(fixture, out, workers=1)
    assert check(out, fixture).ok

    def change(config):
        kept = config["quantization_config"]["source_quantization_config"]
        kept["config_groups"]["group_0"]["weights"]["observer"] = "mse"

    _set_config(out, "config.json", change)
    resign(out)
    # without --source: the manifest's quantization_defaults, which record the config groups as read
    assert_fails(out, None, "config.json: source_quantization_config.config_groups is {\"group_0\"",
                 "the manifest's quantization_defaults.config_groups is")
    assert_fails(out, fixture, "config.json: quantization_config.source_quantization_config.config_groups.group_0."
                               "weights.observer is \"mse\", converting --source writes ")


def _converted_moe_fixture(tmp_path: Path) -> tuple[Path, Path]:
    """The llm-compressor Qwen3-MoE fixture (its router ignored) copied and converted: (source, output)."""
    src = tmp_path / "src"
    shutil.copytree(Path(__file__).parent / "fixtures" / "llmcompressor" / "qwen3_moe", src)
    (src / "reference_dequant.safetensors").unlink(missing_ok=True)
    out = tmp_path / "out"
    convert(src, out, workers=1)
    return src, out


def test_a_key_the_converter_adds_may_be_absent_but_not_a_key_of_the_source(tmp_path):
    """An output of an earlier converter release (before 2026-11-26 no '-:' rule for the router llm-compressor
    ignores) lacks a key today's converter adds: still the source's conversion (it passed --source before the config
    comparison came). A key the source's config has, dropped from the output, still fails."""
    src, out = _converted_moe_fixture(tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert "dynamic" in config["quantization_config"] and "dynamic" not in json.loads(
        (src / "config.json").read_text())["quantization_config"]
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((out / name).read_text())
        (data.get("quantization_config", data)).pop("dynamic")
        (out / name).write_text(json.dumps(data, indent=2))
    resign(out)
    assert check(out, src).ok, problems_of(check(out, src))
    data = json.loads((out / "config.json").read_text())
    data.pop("vocab_size")
    (out / "config.json").write_text(json.dumps(data, indent=2))
    resign(out)
    assert_fails(out, src, "config.json: vocab_size is absent")


def _set_shard_metadata(path: Path, metadata) -> None:
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    if metadata is not None:
        header = {"__metadata__": metadata, **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size:])


@pytest.mark.parametrize("metadata, said", [({"format": "tf"}, '{"format": "tf"}'), (None, "absent"),
                                            ({"format": "pt", "note": "x"}, '{"format": "pt", "note": "x"}')])
def test_a_shard_whose_metadata_was_edited_fails(out, metadata, said):
    """The converter writes every shard's __metadata__ as {"format": "pt"}, which loaders read (transformers refuses a
    format it does not know); one edited in a shard's header, files re-signed, passed verify, --source too."""
    _set_shard_metadata(out / "model-00001-of-00002.safetensors", metadata)
    resign(out)
    shard = "model-00001-of-00002.safetensors"
    expected = f'shard {shard}: __metadata__ is {said}, the converter writes {{"format": "pt"}}'
    assert expected in verify(out, gpus=None, workers=1).problems
    assert_fails(out, EXAMPLE, expected)


def test_a_deeply_nested_config_value_is_compared_without_an_internal_error(tmp_path, capsys):
    """A config value nested 700 deep (JSON the reader takes) converted with exit 0, then 'verify --source' was exit 3,
    'internal error: RecursionError' (the key-by-key comparison recursed), and since the --json reports' escapes a
    report holding it too ('inspect --json-stdout'). Equal configs pass; an edited one fails, exit 1."""
    from edit_checkpoint import set_quant_config

    from marlin_convert.cli.app import main

    src = tmp_path / "in"
    shutil.copytree(EXAMPLE, src)
    deep = json.loads("[" * 700 + "]" * 700)
    set_quant_config(src, dynamic={"+:.*nothing": {"bits": 4, "x": deep}})
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["inspect", str(src), "--json-stdout"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "--source", str(src), "-q"]) == 0
    _set_config(out, "config.json", lambda c: c["quantization_config"]["dynamic"]["+:.*nothing"].update(
        x=json.loads("[" * 700 + "1" + "]" * 700)))
    resign(out)
    capsys.readouterr()
    assert main(["verify", str(out), "--skip-kernel", "--source", str(src), "-q"]) == 1
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err


def _edit_quant_configs(out: Path, change) -> None:
    """``change`` on both output configs' quantization settings, then the files re-recorded (:func:`resign`)."""
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((out / name).read_text())
        change(data.get("quantization_config", data))
        (out / name).write_text(json.dumps(data, indent=2))
    resign(out)


def test_a_compressed_tensors_output_must_state_lm_head_and_its_exclusions(tmp_path):
    """A second attack helper: removing the lm_head flag, or a '-:' rule of a module the source's config leaves
    unquantized, from a compressed-tensors output passed verify, with --source too (keys the converter adds are not
    compared with the source); the converter always writes both, so the audit holds them."""
    src, out = _converted_moe_fixture(tmp_path)
    rules = json.loads((out / "quantize_config.json").read_text())["dynamic"]
    excluded = [rule for rule in rules if rule.startswith("-:")]
    assert excluded
    saved = {name: (out / name).read_text() for name in ("config.json", "quantize_config.json", MANIFEST_FILE)}
    _edit_quant_configs(out, lambda section: section.pop("lm_head"))
    for source_dir in (None, src):
        assert_fails(out, source_dir, "lm_head is absent, the converter writes false")
    for name, text in saved.items():
        (out / name).write_text(text)
    _edit_quant_configs(out, lambda section: section["dynamic"].pop(excluded[0]))
    module = excluded[0][len("-:^"):-1].replace("\\", "")
    for source_dir in (None, src):
        assert_fails(out, source_dir, f"says module '{module}' is quantized")


def test_a_gptq_lm_head_flag_that_is_no_boolean_fails(tmp_path):
    """A second attack helper: lm_head 0, null or "false" in a GPTQ output passed plain verify (loaders read them as
    not quantized); the converter keeps the source's flag, which it reads as a JSON boolean."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    _edit_quant_configs(out, lambda section: section.update(lm_head="false"))
    assert_fails(out, None, 'lm_head is "false", not a JSON boolean')
