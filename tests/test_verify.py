"""``verify`` trusts nothing: manifest types, the manifest against the files, every digest, corrupt tables.

All on the CPU (``--skip-kernel`` / ``gpus=None``); the kernel half is in ``test_verify_gpu.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import shutil
from pathlib import Path

import numpy as np
import pytest
from edit_checkpoint import rerecord, set_quant_config
from make_gptq_checkpoint import tiny_llama, with_quantized_lm_head, write_checkpoint

from marlin_convert.cli.app import main
from marlin_convert.convert import convert
from marlin_convert.errors import VerificationFailed
from marlin_convert.manifest import MANIFEST_FILE, load_manifest, manifest_digest
from marlin_convert.safetensors_io import read_header
from marlin_convert.verify import verify

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A converted act-order checkpoint (2 shards, with an index), written once: tests copy it before changing it."""
    root = tmp_path_factory.mktemp("verify")
    src = write_checkpoint(root / "in", tiny_llama(num_layers=1, shards=2, group_size=64, act_order=True))
    convert(src, root / "out", workers=1)
    return root / "out"


@pytest.fixture
def out(tmp_path, converted):
    copy = tmp_path / "out"
    shutil.copytree(converted, copy)
    return copy


def _edit_manifest(out, change) -> None:
    path = out / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _flip(path, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def test_a_fresh_conversion_passes_with_every_file_and_tensor_checked(out, capsys):
    manifest = load_manifest(out)
    report = verify(out, gpus=None, workers=2)
    assert report.ok and len(report.results) == 7 and report.problems == []
    assert report.files_checked == len(manifest["files"]) and report.files_checked >= 5
    assert report.tensors_checked == len(manifest["passthrough"]) + sum(len(k["tensors"]) for k in manifest["kept"])
    assert report.manifest_sha256 == manifest_digest(out)
    assert verify(out, gpus=None, workers=1).to_dict()["ok"] is True


@pytest.mark.parametrize("path, value, named", [
    (("layers", 0, "bits"), "4", "layers[0].bits"),
    (("layers", 0, "bits"), 4.0, "layers[0].bits"),
    (("layers", 0, "bits"), 3, "layers[0].bits"),
    (("layers", 0, "sym"), "true", "layers[0].sym"),
    (("layers", 0, "in_features"), None, "layers[0].in_features"),
    (("layers", 0, "workspace", "ints"), "64", "layers[0].workspace.ints"),
    (("layers", 0, "sources", 0, "digests", "qweight"), 5, "layers[0].sources[0].digests.qweight"),
    (("layers", 0, "sources", 0, "slices"), [3, 1], "layers[0].sources[0].slices"),
    (("layers", 0, "shapes", "B"), [1, -2], "layers[0].shapes.B"),
    (("layers",), {}, "'layers'"),
    (("passthrough", 0, "sha256"), "md5:00", "passthrough[0].sha256"),
    (("files",), [], "'files'"),
    (("checkpoint_format",), "gptq", "checkpoint_format"),
    (("model_dtype",), 16, "model_dtype"),
    # the top level too: any value passed in these
    (("tool",), None, "'tool': expected a string, got null\n"),  # (once: it said "got null null")
    (("created",), 20260101, "'created': expected a string"),
    (("notes",), "a note", "'notes': expected a list"),
    (("source", "path"), ["in"], "'source.path': expected a string, got a list"),
    (("source", "bytes"), -1, "'source.bytes': -1 is below 0"),
    (("source", "quantization_config"), [None], "'source.quantization_config[0]': expected a string"),
    (("quantization_defaults",), None, "'quantization_defaults': expected an object"),
    (("quantization_defaults", "bits"), "x", "'quantization_defaults.bits': expected an integer, got a string"),
    (("quantization_defaults", "bits"), 4.0, "'quantization_defaults.bits': expected an integer, got a number"),
    (("quantization_defaults", "bits"), 5, "'quantization_defaults.bits': 5 is not one of 2, 3, 4, 8"),
    (("quantization_defaults", "group_size"), [[[]]], "'quantization_defaults.group_size': expected an integer"),
    (("quantization_defaults", "group_size"), 0, "'quantization_defaults.group_size': 0 is neither -1"),
    (("quantization_defaults", "sym"), 3, "'quantization_defaults.sym': expected a boolean or null, got an integer"),
    (("quantization_defaults", "desc_act"), 0, "'quantization_defaults.desc_act': expected a boolean"),
    (("quantization_defaults", "checkpoint_format"), "marlin", "'quantization_defaults.checkpoint_format'"),
    (("quantization_defaults", "dynamic"), {"+:.*": {"bits": "4"}},
     "'quantization_defaults.dynamic': dynamic rule \"+:.*\": 'bits' must be a JSON integer"),
    (("quantization_defaults", "dynamic"), [], "'quantization_defaults.dynamic': expected an object or null"),
])
def test_a_field_of_the_wrong_type_or_value_exits_2_naming_it(out, capsys, path, value, named):
    def change(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    _edit_manifest(out, change)
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("Error:") == 1 and named in err and "Traceback" not in err


@pytest.mark.parametrize("version, shown", [(2.0, "2.0"), (True, "true"), ("2", '"2"'), (None, "null")])
def test_a_manifest_version_that_only_equals_2_in_python_is_refused(out, capsys, version, shown):
    _edit_manifest(out, lambda m: m.update(version=version))
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("Error:") == 1 and f"manifest version {shown}, this tool reads 2" in err


def test_a_manifest_with_a_repeated_key_exits_2(out, capsys):
    path = out / MANIFEST_FILE
    path.write_text(path.read_text().replace('"format":', '"version": 2, "format":', 1))
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 2
    assert "duplicate key 'version'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../escape.json", "/etc/passwd"])
def test_file_names_outside_the_directory_are_refused(out, capsys, name):
    _edit_manifest(out, lambda m: m["files"].update({name: {"bytes": 1, "sha256": "sha256:" + "0" * 64}}))
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 2
    assert f"files[{name!r}]: file name {name!r} is not inside the directory" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../escape.safetensors", "/etc/passwd"])
def test_a_layer_shard_outside_the_directory_is_refused(out, capsys, name):
    _edit_manifest(out, lambda m: m["layers"][0]["shards"].update({"B": name}))
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 2
    assert f"layers[0].shards.B: shard name {name!r} is not a file name in the directory" in capsys.readouterr().err


def test_a_file_linked_out_of_the_directory_is_not_read(out, tmp_path):
    elsewhere = tmp_path / "tokenizer-elsewhere.json"
    elsewhere.write_text("{}")
    victim = next(p for p in sorted(out.iterdir()) if p.suffix == ".json" and p.name != MANIFEST_FILE)
    victim.unlink()
    victim.symlink_to(elsewhere)
    _fails(out, f"file {victim.name} is a link out of")


def _fails(out, *fragments) -> str:
    report = verify(out, gpus=None, workers=1)
    assert not report.ok
    text = "\n".join(report.problems + [p for r in report.failures for p in r.integrity_problems]
                     + [p for k in report.kept for p in k.problems])
    for fragment in fragments:
        assert fragment in text, text
    return text


def test_a_removed_layer_leaves_its_tensors_unaccounted(out):
    _edit_manifest(out, lambda m: m["layers"].pop(3))
    _fails(out, "is not accounted for by the manifest")


def test_no_layers_at_all_fails(out):
    _edit_manifest(out, lambda m: m.update(layers=[]))
    _fails(out, "is not accounted for by the manifest")


@pytest.mark.parametrize("field, value, fragment", [
    ("workspace", {"rule": "(N / 64) * 16", "ints": 8}, "workspace 8 ints"),
    ("bits", 8, "manifest shape of B"),
    ("group_size", 32, "groups"),
    ("scale_dtype", "bfloat16", "scale_dtype says bfloat16"),
    ("num_groups", 3, "manifest says 3 groups"),
    ("padded_out_features", 1024, "padded shape"),
])
def test_an_edited_layer_field_fails_that_layer(out, field, value, fragment):
    _edit_manifest(out, lambda m: m["layers"][2].update({field: value}))
    report = verify(out, gpus=None, workers=1)
    name = load_manifest(out)["layers"][2]["name"]
    assert [r.name for r in report.failures] == [name]
    assert any(fragment in p for p in report.failures[0].integrity_problems), report.failures[0].integrity_problems


def test_an_edited_layer_zero_format_fails_that_layer(out):
    """A new-user helper: the layer-level zero_format (v1 <-> v2) was compared with nothing, so a manifest reader that
    trusts it would take the source's zero points one off; it must be its source's."""
    def flip(manifest):
        layer = manifest["layers"][2]
        layer["zero_format"] = "v2" if layer["zero_format"] == "v1" else "v1"

    _edit_manifest(out, flip)
    report = verify(out, gpus=None, workers=1)
    assert [r.name for r in report.failures] == [load_manifest(out)["layers"][2]["name"]]
    assert any("zero_format" in p and "its source's" in p for p in report.failures[0].integrity_problems)


def test_an_edited_shape_fails_that_layer(out):
    def change(manifest):
        manifest["layers"][1]["shapes"]["B"][0] += 1

    _edit_manifest(out, change)
    _fails(out, "manifest shape of B")


@pytest.mark.parametrize("removed, fragment", [
    ("config.json", "config.json listed in the manifest is missing"),
    ("quantize_config.json", "quantize_config.json is missing"),
    ("model.safetensors.index.json", "model.safetensors.index.json is missing"),
])
def test_a_deleted_config_or_index_fails(out, removed, fragment):
    (out / removed).unlink()
    _fails(out, fragment)


def test_index_and_file_problems_are_named_for_what_they_are(out):
    """An index entry no shard holds, the manifest listing itself, and a directory where a listed file should be."""
    path = out / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["ghost"] = next(iter(index["weight_map"].values()))
    path.write_text(json.dumps(index))
    first = next(name for name in json.loads((out / MANIFEST_FILE).read_text())["files"] if name.endswith(".json"))
    _edit_manifest(out, lambda m: m["files"].update({MANIFEST_FILE: m["files"][first]}))
    (out / "generation_config.json").rename(out / "moved.json")
    (out / "generation_config.json").mkdir()
    _fails(out, "'ghost' maps to", "but no shard holds it", f"file {MANIFEST_FILE} is listed in the manifest itself",
           "file generation_config.json listed in the manifest is a directory")


def test_configs_must_say_what_the_manifest_says(out):
    path = out / "quantize_config.json"
    config = json.loads(path.read_text())
    config["checkpoint_format"] = "gptq"
    path.write_text(json.dumps(config))
    _fails(out, "quantize_config.json: checkpoint_format is \"gptq\"", "file quantize_config.json")


def test_an_lm_head_flag_that_contradicts_the_layers_fails(out, tmp_path):
    """An output config whose lm_head says quantized while lm_head.weight is passed through (or not quantized while
    layer lm_head is converted) would have a loader build the head wrongly."""
    path = out / "quantize_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "lm_head": True}))
    _fails(out, "quantize_config.json: lm_head is true, but 'lm_head.weight' is passed through unquantized")
    src = write_checkpoint(tmp_path / "q", with_quantized_lm_head(tiny_llama(num_layers=1, vocab=256)))
    convert(src, tmp_path / "q_out", workers=1)
    set_quant_config(tmp_path / "q_out", lm_head=False)
    _fails(tmp_path / "q_out", "config.json: lm_head is false, but layer 'lm_head' is converted",
           "quantize_config.json: lm_head is false")


def test_an_index_that_maps_a_tensor_elsewhere_fails(out):
    path = out / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-99.safetensors"
    path.write_text(json.dumps(index))
    _fails(out, f"'{name}' maps to \"model-99.safetensors\"")


def test_appended_bytes_and_added_files_fail(out):
    shard = next(out.glob("*.safetensors"))
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)
    (out / "extra.bin").write_bytes(b"x")
    _fails(out, "after the last tensor", f"file {shard.name} has", "file extra.bin is not listed")


def test_an_added_tensor_is_not_accounted_for(out):
    from marlin_convert.safetensors_io import PlannedTensor, ShardWriter, read_tensor

    shard = next(out.glob("*.safetensors"))
    header = read_header(shard)
    tensors = {name: read_tensor(header, name) for name in header.tensors}
    planned = [PlannedTensor(n, i.dtype, i.shape) for n, i in header.tensors.items()]
    planned.append(PlannedTensor("intruder.weight", "F16", (4,)))
    writer = ShardWriter(shard, planned, header.metadata)
    for name, array in tensors.items():
        writer.record(name, writer.write_array(name, array))
    writer.record("intruder.weight", writer.write_array("intruder.weight", np.ones(4, np.float16)))
    writer.close()
    _fails(out, "tensor 'intruder.weight' is not accounted for")


def test_flips_in_passthrough_tensors_are_named(out):
    manifest = load_manifest(out)
    rng = random.Random(0)
    for entry in manifest["passthrough"]:
        info = read_header(out / entry["shard"]).tensors[entry["name"]]
        _flip(out / entry["shard"], rng.randrange(info.begin, info.end), rng.randrange(8))
    text = _fails(out)
    for entry in manifest["passthrough"]:
        assert f"passthrough '{entry['name']}': SHA-256" in text


@pytest.mark.parametrize("kind", ["perm", "g_idx", "B", "s"])
def test_bit_flips_in_every_marlin_tensor_fail_the_layer_by_name(out, kind):
    manifest = load_manifest(out)
    rng = random.Random(kind)
    pristine = {p.name: p.read_bytes() for p in out.glob("*.safetensors")}
    for trial in range(12):
        entry = rng.choice(manifest["layers"])
        shard = out / entry["shards"][kind]
        info = read_header(shard).tensors[entry["outputs"][kind]]
        _flip(shard, rng.randrange(info.begin, info.end), rng.randrange(8))
        report = verify(out, gpus=None, workers=1)
        assert [r.name for r in report.failures] == [entry["name"]], (trial, report.failures)
        shard.write_bytes(pristine[shard.name])


def test_an_expected_manifest_digest_shows_tampering(out, capsys):
    digest = manifest_digest(out)
    assert verify(out, gpus=None, workers=1, expect_manifest=digest).ok
    _edit_manifest(out, lambda m: m["notes"].append("edited"))
    with pytest.raises(VerificationFailed, match=f"SHA-256 is sha256:[0-9a-f]{{64}}, expected {digest}"):
        verify(out, gpus=None, workers=1, expect_manifest=digest)
    assert main(["verify", str(out), "--skip-kernel", "-q", "--manifest-sha256", digest]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("Error:") == 1
    assert f"{MANIFEST_FILE}: SHA-256 is sha256:" in captured.err and f"expected {digest}" in captured.err


@pytest.mark.parametrize("edit", [
    lambda m: m["layers"][0].update(bits="x"),
    lambda m: m.update(version=3),
])
def test_a_manifest_digest_that_differs_stops_verify_before_the_manifest_is_read(out, capsys, edit):
    """The digest is the first check: a manifest that is not the recorded one is not believed in anything (its
    fields are neither reported on nor used to size work)."""
    digest = manifest_digest(out)
    _edit_manifest(out, edit)
    assert main(["verify", str(out), "--skip-kernel", "-q", "--manifest-sha256", digest]) == 1
    err = capsys.readouterr().err
    assert err.count("Error:") == 1 and f"expected {digest}" in err and "field" not in err and "version" not in err


def test_a_manifest_digest_is_matched_in_any_form_and_a_malformed_one_is_refused_up_front(out, capsys):
    hex_digits = manifest_digest(out).removeprefix("sha256:")
    for given in (hex_digits, "sha256:" + hex_digits, hex_digits.upper()):
        assert main(["verify", str(out), "--skip-kernel", "-q", "--manifest-sha256", given]) == 0, given
    capsys.readouterr()
    for given in ("abc", "sha256:" + hex_digits[:-1], hex_digits[:-1] + "g", "sha1:" + hex_digits):
        assert main(["verify", str(out), "--skip-kernel", "-q", "--manifest-sha256", given]) == 2, given
        captured = capsys.readouterr()
        assert captured.out == ""  # refused before any work
        assert f"Error: --manifest-sha256 {given!r}: expected a SHA-256 digest" in captured.err


@pytest.fixture
def partial(tmp_path):
    """One layer converted, one kept in GPTQ form (group size 48 has no Marlin form)."""
    from make_gptq_checkpoint import CheckpointSpec, LinearSpec

    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.up_proj", 128, 256),
                                   LinearSpec("model.layers.0.mlp.down_proj", 96, 128, group_size=48)],
                          extras=[], group_size=64, dynamic={r"+:.*down_proj": {"group_size": 48}})
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1, skip_incompatible=True)
    return tmp_path / "out"


def test_kept_layers_are_checked_byte_for_byte_and_counted(partial, capsys):
    assert main(["verify", str(partial), "--skip-kernel"]) == 0
    text = capsys.readouterr().out
    assert "passed: 2/2 layers ok (1 converted, 1 kept in GPTQ form)" in text
    assert "kept in GPTQ form: model.layers.0.mlp.down_proj (" in text
    assert main(["verify", str(partial), "--skip-kernel", "-q"]) == 0  # -q: failures and the summary only
    assert "kept in GPTQ form: model.layers.0.mlp.down_proj (" not in capsys.readouterr().out
    manifest = load_manifest(partial)
    kept = manifest["kept"][0]
    shard = partial / kept["shards"]["qweight"]
    info = read_header(shard).tensors[kept["tensors"]["qweight"]]
    _flip(shard, info.begin + 3, 2)
    report = verify(partial, gpus=None, workers=1)
    assert [k.name for k in report.kept if not k.ok] == ["model.layers.0.mlp.down_proj"]
    assert "kept 'model.layers.0.mlp.down_proj' qweight: SHA-256" in report.kept[0].problems[0]
    assert main(["verify", str(partial), "--skip-kernel", "-q"]) == 1
    captured = capsys.readouterr()
    assert "1 kept layer(s) differ" in captured.err
    assert "kept in GPTQ form: model.layers.0.mlp.down_proj (" in captured.out  # a failing one is shown with -q


def test_a_partial_checkpoint_must_say_so(partial):
    _edit_manifest(partial, lambda m: m.update(checkpoint_format="marlin"))
    _fails(partial, "checkpoint_format is 'marlin' with 1 layer(s) kept", "quantize_config.json: checkpoint_format is "
                                                                         "\"marlin-partial\", expected \"marlin\"")


# ------------------------------------------------------------------------ found in the audit of issues #7 / #8


def _layer_index(manifest, suffix: str) -> int:
    return next(i for i, entry in enumerate(manifest["layers"]) if entry["name"].endswith(suffix))


def test_swapped_layer_names_fail_both_layers(out):
    """Same shapes, every digest intact: only the names tie an entry to its tensors (an engine loads layer q_proj
    from what the manifest says q_proj is)."""
    def change(manifest):
        q, o = _layer_index(manifest, "q_proj"), _layer_index(manifest, "o_proj")
        layers = manifest["layers"]
        layers[q]["name"], layers[o]["name"] = layers[o]["name"], layers[q]["name"]

    _edit_manifest(out, change)
    text = _fails(out, "manifest output B is", "q_proj.B")
    report = verify(out, gpus=None, workers=1)
    assert sorted(r.name.rsplit(".", 1)[1] for r in report.failures) == ["o_proj", "q_proj"], text


def test_a_renamed_source_tensor_fails_the_layer(out):
    def change(manifest):
        manifest["layers"][0]["sources"][0]["tensors"]["qweight"] = "elsewhere.qweight"

    _edit_manifest(out, change)
    _fails(out, "its qweight is named 'elsewhere.qweight'")


def test_a_shard_listed_twice_fails(out):
    _edit_manifest(out, lambda m: m["shards"].append(m["shards"][0]))
    _fails(out, "more than once")


@pytest.mark.parametrize("victim", ["config.json", "quantize_config.json", "model.safetensors.index.json", "shard"])
def test_a_fifo_in_place_of_a_file_fails_without_blocking(out, victim):
    """Reading a FIFO blocks until someone writes to it: verify used to hang here."""
    path = next(out.glob("*.safetensors")) if victim == "shard" else out / victim
    path.unlink()
    os.mkfifo(path)
    unblock = threading.Timer(10, _open_for_writing, [path])  # a regression fails the test instead of hanging it
    unblock.start()
    try:
        _fails(out, f"{path.name}", "not a regular file")
    finally:
        unblock.cancel()


def _open_for_writing(path) -> None:
    """Let a reader blocked on FIFO ``path`` go on (it then reads nothing)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only while a reader waits
    except OSError:
        pass


def test_a_fifo_added_to_the_directory_is_not_listed(out):
    os.mkfifo(out / "pipe")
    _fails(out, "file pipe is not listed in the manifest")


def test_files_linked_into_a_blob_store_verify(out, tmp_path):
    """The Hugging Face cache stores every file of a snapshot ``<repo>/snapshots/<rev>`` as a link to
    ``<repo>/blobs/<hash>``."""
    repo = tmp_path / "models--org--marlin"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.parent.mkdir(parents=True)
    out.rename(snapshot)
    blobs = repo / "blobs"
    blobs.mkdir()
    for path in list(snapshot.iterdir()):
        blob = blobs / hashlib.sha256(path.name.encode()).hexdigest()
        path.rename(blob)
        path.symlink_to(os.path.relpath(blob, snapshot))
    assert verify(snapshot, gpus=None, workers=1).ok


def test_a_source_that_is_not_the_converted_checkpoint_fails(tmp_path, converted, out, capsys):
    """Another model's checkpoint differs from the output: its layers fail (exit 1), each naming what the source
    lacks (this was exit 2 blaming the source, which a tampered manifest caused just as well)."""
    from make_gptq_checkpoint import qwen3_moe

    source = converted.parent / "in"
    assert main(["verify", str(out), "--skip-kernel", "-q", "--source", str(source)]) == 0
    capsys.readouterr()
    # another model: the manifest's source tensors are not there (was: an internal error, KeyError)
    other = write_checkpoint(tmp_path / "other", qwen3_moe(num_layers=1, num_experts=2, hidden=128,
                                                          expert_intermediate=128, vocab=64))
    assert main(["verify", str(out), "--skip-kernel", "-q", "--source", str(other)]) == 1
    captured = capsys.readouterr()
    assert "internal error" not in captured.err
    assert "the manifest names source tensor 'model.layers.0.mlp." in captured.out
    # a checkpoint that shares no tensor with the one converted: a wrong --source argument (exit 2, one line, the
    # hint names the directory the manifest records), not a verify failure of every layer
    from make_gptq_checkpoint import CheckpointSpec, LinearSpec

    unrelated = write_checkpoint(tmp_path / "unrelated", CheckpointSpec(
        linears=[LinearSpec("encoder.block.0.dense", 256, 128)], extras=[], group_size=128))
    assert main(["verify", str(out), "--skip-kernel", "-q", "--source", str(unrelated)]) == 2
    captured = capsys.readouterr()
    assert "holds none of the source tensors the manifest names" in captured.err
    assert "give the directory the checkpoint was converted from" in captured.err
    # a source the converter itself refuses (a stacked layer's g_idx without its experts) is a bad argument
    stacked = write_checkpoint(tmp_path / "stacked", qwen3_moe(num_layers=1, num_experts=2, hidden=128,
                                                               expert_intermediate=128, vocab=64, stacked=True))
    convert(stacked, tmp_path / "stacked-out", workers=1)
    flat = tmp_path / "flat"
    shutil.copytree(stacked, flat)
    name = "model.layers.0.mlp.experts.down_proj.g_idx"
    (flat / "model.safetensors").write_bytes(_with_shape(stacked / "model.safetensors", name, [256]))
    assert main(["verify", str(tmp_path / "stacked-out"), "--skip-kernel", "-q", "--source", str(flat)]) == 2
    assert (f"tensor '{name}' has shape [256]: 1-D, but model.layers.0.mlp.experts.down_proj.qweight is 3-D (stacked, "
            "2 experts), so g_idx must be 2-D" in capsys.readouterr().err)


def _with_shape(path, name, shape):
    """The file's bytes with one tensor's header shape changed (same byte count)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header[name]["shape"] = shape
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (size - len(text))
    assert len(text) == size
    return data[:8] + text + data[8 + size:]


def _swap_first_two_experts(manifest):
    layers = manifest["expert_groups"][0]["layers"]
    layers[0], layers[1] = layers[1], layers[0]


@pytest.mark.parametrize("change, found", [
    (_swap_first_two_experts, "expert_groups [0] is"),
    (lambda m: m["expert_groups"][1].update(num_experts=5), "expert_groups [1] is"),
    (lambda m: m["expert_groups"].pop(), "expert_groups has 2 group(s), the layers make 3"),
    (lambda m: m["expert_groups"].append({}), "expert_groups has 4 group(s), the layers make 3"),
    (lambda m: m.update(expert_groups="x"), 'expert_groups is "x"'),
    (lambda m: m["expert_groups"][0].update(num_experts=3.0), "expert_groups [0] is"),  # JSON 3.0 is not 3
])
def test_expert_groups_that_the_layers_do_not_make_fail(tmp_path, capsys, change, found):
    """expert_groups is what an engine reads to find and order a layer's experts: verify recomputes it from the
    layers (it was not read at all: experts swapped, counts changed, groups dropped all passed)."""
    from make_gptq_checkpoint import qwen3_moe

    src = write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=1, num_experts=3, hidden=128,
                                                     expert_intermediate=128, vocab=64))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    assert len(load_manifest(out)["expert_groups"]) == 3  # gate, up, down
    assert verify(out, gpus=None, workers=1).ok
    _edit_manifest(out, change)
    report = verify(out, gpus=None, workers=1)
    assert not report.ok and any(f"manifest {found}" in problem for problem in report.problems), report.problems


@pytest.mark.parametrize("change, found", [
    ("embedding", "tensor 'model.embed_tokens.weight' differs from --source's"),
    ("tokenizer", "file tokenizer.json differs from --source's"),
    ("drop-tokenizer", "file tokenizer.json (copied into OUT_DIR) is not a file of --source"),
])
def test_a_source_that_differs_in_a_copied_tensor_or_file_fails(tmp_path, converted, capsys, change, found):
    """--source proves the output came from that checkpoint: the copies too (a source that differed only in its
    embedding or tokenizer passed, 'compared byte for byte')."""
    source = tmp_path / "source"
    shutil.copytree(converted.parent / "in", source)
    (converted / "tokenizer.json").exists() or pytest.skip("the generated checkpoint has no tokenizer.json")
    if change == "embedding":
        name = "model.embed_tokens.weight"
        shard = next(p for p in sorted(source.glob("*.safetensors")) if name in read_header(p).tensors)
        header = read_header(shard)
        with open(shard, "r+b") as f:
            f.seek(header.data_start + header.tensors[name].begin)
            f.write(b"\x00" * 16)
    elif change == "tokenizer":
        (source / "tokenizer.json").write_text('{"changed": true}')
    else:
        (source / "tokenizer.json").unlink()
    assert main(["verify", str(converted), "--skip-kernel", "-q", "--source", str(converted.parent / "in")]) == 0
    assert "copied tensor(s) and file(s) with its own" in capsys.readouterr().out
    assert main(["verify", str(converted), "--skip-kernel", "-q", "--source", str(source)]) == 1
    captured = capsys.readouterr()
    assert found in captured.out + captured.err, captured


@pytest.mark.parametrize("change, found", [
    ({"bits": 8}, "bits 8 (the config); it was converted with 4"),
    ({"group_size": 32}, "group_size 32 (the config); it was converted with 64"),
    ({"sym": False}, "sym false (the config); it was converted with true"),
    ({"dynamic": {"+:.*down_proj": {"bits": 8}}}, "module 'model.layers.0.mlp.down_proj' bits 8 (dynamic rule"),
    ({"dynamic": {"-:.*q_proj": {}}}, "says module 'model.layers.0.self_attn.q_proj' is not quantized"),
])
def test_configs_that_give_a_converted_layer_other_settings_fail(out, capsys, change, found):
    """A loader sizes B and s from the configs: settings that disagree with the converted layers fail verify, even
    with the files' digests re-recorded (they passed: only the format keys were compared)."""
    set_quant_config(out, **change)
    for name in ("config.json", "quantize_config.json"):
        rerecord(out, name)
    report = verify(out, gpus=None, workers=1)
    assert not report.ok
    for name in ("config.json", "quantize_config.json"):
        assert any(p.startswith(f"{name}: ") and found in p for p in report.problems), report.problems


def test_an_act_order_layer_whose_source_says_trivial_fails_that_layer(out, capsys):
    """An attack helper: sources[].g_idx "trivial" on a layer with perm (act-order) passed verify, with --source too;
    the layer's act_order is true only when a source's g_idx is act-order."""
    index = next(i for i, entry in enumerate(load_manifest(out)["layers"]) if entry["act_order"])
    name = load_manifest(out)["layers"][index]["name"]
    _edit_manifest(out, lambda m: m["layers"][index]["sources"][0].update(g_idx="trivial"))
    report = verify(out, gpus=None, workers=1)
    assert [r.name for r in report.failures] == [name]
    assert any("act_order is true" in p and "trivial" in p for p in report.failures[0].integrity_problems)
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 1
    assert name in capsys.readouterr().err


def test_source_compares_each_layer_entry_with_the_replanned_conversion(tmp_path, converted, out):
    """--source holds every field the plan decides, a source's g_idx kind among them, and names the field."""
    index = next(i for i, entry in enumerate(load_manifest(out)["layers"]) if entry["act_order"])
    _edit_manifest(out, lambda m: m["layers"][index]["sources"][0].update(g_idx="trivial"))
    report = verify(out, gpus=None, workers=1, source_dir=converted.parent / "in")
    assert [r.name for r in report.failures] == [load_manifest(out)["layers"][index]["name"]]
    assert ('the manifest\'s sources[0].g_idx is "trivial", converting --source records "act_order"'
            in report.failures[0].integrity_problems)


@pytest.mark.parametrize("group_size", [129, 256])
def test_a_layer_group_size_at_or_above_k_is_held_exactly(tmp_path, group_size):
    """An attack helper: 128 -> 129 or 256 on a K = 128 layer (one group either way) passed verify, with or without
    --source; the field is the group size the config gives the layer."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, group_size=128))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    index = next(i for i, entry in enumerate(load_manifest(out)["layers"]) if entry["in_features"] == 128)
    name = load_manifest(out)["layers"][index]["name"]
    _edit_manifest(out, lambda m: m["layers"][index].update(group_size=group_size))
    _fails(out, f"gives module '{name}' group_size 128 (the config); it was converted with {group_size}")
    report = verify(out, gpus=None, workers=1, source_dir=src)
    assert [r.name for r in report.failures] == [name]
    assert (f"the manifest's group_size is {group_size}, converting --source records 128"
            in report.failures[0].integrity_problems)


def test_an_output_config_that_states_fewer_keys_than_the_defaults_passes(out):
    """A review helper: outputs of releases before 768ff4f kept config.json's quantization_config as it was, without
    the keys only quantize_config.json stated; a key the output config does not state is not compared with the
    manifest's quantization_defaults (it failed as "desc_act is null")."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    for key in ("desc_act", "sym"):
        del config["quantization_config"][key]
    path.write_text(json.dumps(config))
    rerecord(out, "config.json")
    report = verify(out, gpus=None, workers=1)
    assert report.ok, report.problems


def test_dynamic_rules_reordered_so_an_excluded_module_resolves_quantized_fail(tmp_path):
    """A review helper: the same rules in another order passed verify (compared as a set), with --source too; but
    the first matching rule wins, and o_proj, passed through unquantized under "-:.*o_proj", would then resolve to
    "+:.*self_attn.*" and a loader would look for its Marlin tensors."""
    src = tmp_path / "in"
    shutil.copytree(FIXTURES / "gptqmodel" / "dynamic_lm_head", src)
    rules = json.loads((src / "quantize_config.json").read_text())["dynamic"]
    reordered_source = {"-:.*o_proj": {}, "+:.*self_attn.*": {}, **{k: v for k, v in rules.items() if k != "-:.*o_proj"}}
    set_quant_config(src, dynamic=reordered_source)
    out = tmp_path / "out"
    convert(src, out, workers=1)
    assert verify(out, gpus=None, workers=1, source_dir=src).ok
    swapped = {"+:.*self_attn.*": {}, "-:.*o_proj": {}, **{k: v for k, v in rules.items() if k != "-:.*o_proj"}}
    set_quant_config(out, dynamic=swapped)
    for name in ("config.json", "quantize_config.json"):
        rerecord(out, name)
    for source_dir in (None, src):
        report = verify(out, gpus=None, workers=1, source_dir=source_dir)
        assert any("says module 'model.layers.0.self_attn.o_proj' is quantized" in p and '"-:.*o_proj"' in p
                   for p in report.problems), report.problems


def test_an_lm_head_flag_false_beside_a_kept_lm_head_fails(tmp_path):
    """A review helper: the audit counted converted layers only, so lm_head: false passed beside an lm_head kept in
    GPTQ form (group 16: --skip-incompatible keeps it), which convert refuses on a source."""
    src = write_checkpoint(tmp_path / "in", with_quantized_lm_head(tiny_llama(num_layers=1, vocab=256), group_size=16))
    out = tmp_path / "out"
    convert(src, out, workers=1, skip_incompatible=True)
    assert [entry["name"] for entry in load_manifest(out)["kept"]] == ["lm_head"]
    assert verify(out, gpus=None, workers=1).ok
    set_quant_config(out, lm_head=False)
    for name in ("config.json", "quantize_config.json"):
        rerecord(out, name)
    report = verify(out, gpus=None, workers=1)
    assert any("lm_head is false, but layer 'lm_head' is kept in GPTQ form" in p for p in report.problems), \
        report.problems


def test_the_completion_queue_yields_each_finished_task_once_and_never_looks_at_pending_ones():
    """verify takes its workers' finished tasks from a queue their futures enter on completion: it had called
    concurrent.futures.wait(FIRST_COMPLETED) over every pending task each time, a lock, a sort and a scan per
    pending task and call, quadratic in the tasks (one per layer source): 172 s for 47,275 of them, the workers busy
    for about 20. A pending future here raises if anything asks it whether it is done."""
    from concurrent.futures import Future

    from marlin_convert.workers import completion_queue, take_completed

    class Pending(Future):
        def done(self):
            raise AssertionError("a pending future was scanned")

    early = Future()
    early.set_result("early")  # (done before the queue exists: in it all the same)
    pending = [Pending() for _ in range(1000)]
    later = [Future() for _ in range(3)]
    finished = completion_queue([early, *pending, *later])
    assert take_completed(finished) == [early]
    assert take_completed(finished, 0.05) == []  # (waited 50 ms for one: none came)
    for index, future in enumerate(later):
        future.set_result(index)
    assert take_completed(finished, 1.0) == later and take_completed(finished) == []
