"""Bad input: one test each. Every case exits non-zero with one ``Error:`` line naming the file, tensor and
reason, prints no traceback, and leaves nothing at OUT_DIR (nor a temporary directory beside it)."""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import resource
import struct
import subprocess
import sys

import numpy as np
import pytest
from edit_checkpoint import set_quant_config
from make_gptq_checkpoint import CheckpointSpec, LinearSpec, TensorSpec, qwen3_moe, tiny_llama, write_checkpoint
from safetensors.numpy import save_file

from marlin_convert import strict_json
from marlin_convert.cli.app import main
from marlin_convert.errors import InputError
from marlin_convert.safetensors_io import read_header, read_tensor

LAYER = "model.layers.0.mlp.down_proj"


def _spec(**kw):
    return CheckpointSpec(linears=[LinearSpec(LAYER, 256, 128)],
                          extras=[TensorSpec("model.norm.weight", (128,), "float16")], **kw)


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "in", _spec(group_size=64))


def _rewrite_tensors(directory, change):
    """Load model.safetensors, let ``change(dict)`` edit it, save it back."""
    path = directory / "model.safetensors"
    header = read_header(path)
    tensors = {name: read_tensor(header, name) for name in header.tensors}
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _run_failing(capsys, tmp_path, args, *fragments):
    rc = main(args)
    captured = capsys.readouterr()
    assert rc != 0
    errors = [line for line in captured.err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, captured.err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in captured.err
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers
    return errors[0]


def _convert_fails(capsys, tmp_path, src, *fragments):
    out = tmp_path / "out"
    line = _run_failing(capsys, tmp_path, [str(src), str(out)], *fragments)
    assert not out.exists()
    return line


@pytest.mark.parametrize("scale_dtype,bits,what", [("float16", 0x7E00, "NaN"), ("float16", 0xFC00, "-inf"),
                                                   ("bfloat16", 0x7FC0, "NaN"), ("bfloat16", 0x7F80, "inf")])
def test_a_nan_or_infinite_scale_stops_the_conversion(capsys, tmp_path, scale_dtype, bits, what):
    """Every weight of that group would be NaN or infinite: a broken checkpoint, which a lossless repack would carry
    on (and verify --skip-kernel pass). Named with layer, group and column; nothing written."""
    src = write_checkpoint(tmp_path / "in", _spec(group_size=64, scale_dtype=scale_dtype))
    path = src / "model.safetensors"
    info = read_header(path).tensors[f"{LAYER}.scales"]
    data = bytearray(path.read_bytes())
    at = info.begin + 2 * (1 * info.shape[1] + 5)  # group 1, column 5
    data[at:at + 2] = bits.to_bytes(2, "little")
    path.write_bytes(bytes(data))
    _convert_fails(capsys, tmp_path, src, f"layer '{LAYER}': 1 scale(s) are NaN or infinite, the first at group 1, "
                                          "column 5: the checkpoint is broken")


def test_a_failed_run_removes_the_directories_it_created_above_out_dir(capsys, tmp_path):
    """OUT_DIR's missing parents are created for the run; when it fails they go with its partial output (found by an
    attack helper: empty directories were left behind), but not a directory that existed before, nor one that got
    another file meanwhile."""
    src = write_checkpoint(tmp_path / "in", _spec(group_size=64))
    path = src / "model.safetensors"
    info = read_header(path).tensors[f"{LAYER}.scales"]
    data = bytearray(path.read_bytes())
    data[info.begin:info.begin + 2] = (0x7E00).to_bytes(2, "little")  # a NaN scale: the run fails while writing
    path.write_bytes(bytes(data))
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "new" / "deeper" / "out"
    assert main([str(src), str(out)]) == 2
    assert "NaN or infinite" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == []

    (tmp_path / "kept" / "new").mkdir()
    (tmp_path / "kept" / "new" / "user.txt").write_text("mine")
    assert main([str(src), str(tmp_path / "kept" / "new" / "deeper" / "out")]) == 2
    assert sorted(p.name for p in (tmp_path / "kept" / "new").iterdir()) == ["user.txt"]


def test_missing_config(capsys, tmp_path, src):
    (src / "config.json").unlink()
    (src / "quantize_config.json").unlink()
    _convert_fails(capsys, tmp_path, src, "no quantization config")


def test_unreadable_config(capsys, tmp_path, src):
    (src / "quantize_config.json").write_text("{ bits: 4")
    _convert_fails(capsys, tmp_path, src, "quantize_config.json", "not valid JSON")


def test_config_without_bits(capsys, tmp_path, src):
    (src / "quantize_config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]["bits"]
    (src / "config.json").write_text(json.dumps(config))
    _convert_fails(capsys, tmp_path, src, "has no 'bits'")


def test_not_a_gptq_checkpoint_other_method(capsys, tmp_path, src):
    (src / "quantize_config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (src / "config.json").write_text(json.dumps(config))
    _convert_fails(capsys, tmp_path, src, "not a GPTQ checkpoint", "awq")


def test_not_a_gptq_checkpoint_no_qweight(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: [t.pop(k) for k in list(t) if k.startswith(LAYER)])
    _convert_fails(capsys, tmp_path, src, "no tensor named '*.qweight'")


def test_no_safetensors_at_all(capsys, tmp_path, src):
    (src / "model.safetensors").unlink()
    _convert_fails(capsys, tmp_path, src, "no .safetensors file")


def test_truncated_shard(capsys, tmp_path, src):
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "truncated")


def test_corrupt_header(capsys, tmp_path, src):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\x00\xff{["
    path.write_bytes(bytes(data))
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "corrupt safetensors header")


def test_header_length_beyond_the_file(capsys, tmp_path, src):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 10 ** 9)
    path.write_bytes(bytes(data))
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "corrupt safetensors header")


def test_index_names_a_missing_shard(capsys, tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, shards=2))
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    _convert_fails(capsys, tmp_path, src, "model.safetensors.index.json", victim.name, "missing")


def test_index_that_lost_a_shards_entries_is_refused(capsys, tmp_path):
    """Every weight_map entry of the second shard deleted: that shard lies beside the first, of the same numbered
    series, and is listed nowhere. The output lacked a layer and lm_head and exited 0; now the index is refused. A
    .safetensors file outside the series (an adapter) is no shard of it and stays a note."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2, shards=2))
    second = sorted(src.glob("model-*.safetensors"))[1]
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    pristine = json.dumps(index)
    index["weight_map"] = {name: shard for name, shard in index["weight_map"].items() if shard != second.name}
    index_path.write_text(json.dumps(index))
    _convert_fails(capsys, tmp_path, src, "model.safetensors.index.json", f"lists no tensor in {second.name}",
                   "the index is incomplete")
    index_path.write_text(pristine)
    (src / "adapter_model.safetensors").write_bytes(second.read_bytes())
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0


def test_index_names_a_tensor_that_is_not_there(capsys, tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, shards=2))
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.9.ghost.weight"] = shard
    index_path.write_text(json.dumps(index))
    _convert_fails(capsys, tmp_path, src, "model.layers.9.ghost.weight", "does not contain it")


def test_scales_shape_disagrees_with_qweight(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"][:, :64].copy()}))
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.scales", "shape [4, 64], expected [4, 128]")


def test_qzeros_shape_disagrees(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.qzeros": t[f"{LAYER}.qzeros"][:2].copy()}))
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.qzeros", "has 2 rows", "config says group size 64")


def test_g_idx_shape_disagrees(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.g_idx": t[f"{LAYER}.g_idx"][:100].copy()}))
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.g_idx", "expected [256]")


def test_wrong_qweight_dtype(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.qweight": t[f"{LAYER}.qweight"].view(np.float32)}))
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.qweight", "dtype float32, expected int32")


def test_wrong_scales_dtype(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"].view(np.int16)}))
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.scales", "expected float16 or bfloat16 or float32")


def test_config_group_size_disagrees_with_the_scale_rows(capsys, tmp_path):
    src = write_checkpoint(tmp_path / "in", _spec(group_size=64))
    _scale_rows_for_group_96(src)  # valid for K = 256 (groups of 96, 96, 64: 3 rows), but the scales have 4 rows
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.scales", "has 4 rows: that is group size 64 for K = 256",
                   "config says group size 96 (3 rows)")


@pytest.mark.parametrize("bits, g_idx, fragments", [
    (3, True, ["has 32 rows of int32: 1024 bits per column are not a whole number of 3-bit values",
               "says bits = 3", "g_idx's K = 256 is what 32 rows hold at 4 bits"]),
    (3, False, ["has 32 rows of int32: 1024 bits per column are not a whole number of 3-bit values"]),
    (8, True, ["expected [128]: qweight's 32 rows of packed 8-bit values are K = 128",
               "g_idx's K = 256 is what 32 rows hold at 4 bits"]),
    (8, False, ["has 4 rows: that is group size 32 for K = 128 (qweight's 32 rows at 8 bits)",
                "says group size 64 (2 rows)"]),
])
def test_a_dynamic_rule_whose_bits_the_stored_shapes_contradict_stops_even_with_skip_incompatible(
        capsys, tmp_path, bits, g_idx, fragments):
    # the layer is stored 4-bit: a rule saying 3 (no Marlin form) or 8 bits is a malformed config, not a layer to keep
    src = write_checkpoint(tmp_path / "in", _spec(group_size=64, include_g_idx=g_idx,
                                                  dynamic={"+:.*down_proj": {"bits": bits}}))
    out = tmp_path / "out"
    line = _run_failing(capsys, tmp_path, [str(src), str(out), "--skip-incompatible"], f"{LAYER}", *fragments)
    assert "K = 341" not in line and "K = 170" not in line  # no K the stored rows cannot hold
    assert not out.exists()


def test_g_idx_out_of_range(capsys, tmp_path, src):
    def change(t):
        g_idx = t[f"{LAYER}.g_idx"].copy()
        g_idx[5] = 4
        t[f"{LAYER}.g_idx"] = g_idx
    _rewrite_tensors(src, change)
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.g_idx", "must lie in 0..3")


def test_g_idx_unbalanced(capsys, tmp_path, src):
    def change(t):
        g_idx = t[f"{LAYER}.g_idx"].copy()
        g_idx[0] = 1
        t[f"{LAYER}.g_idx"] = g_idx
    _rewrite_tensors(src, change)
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.g_idx", "unbalanced", "group 0 has 63 rows")


def test_out_dir_not_empty(capsys, tmp_path, src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    rc = main([str(src), str(out)])
    err = capsys.readouterr().err
    # not a previous output: the hint does not offer --overwrite, which would be refused too
    assert rc == 2 and "is not empty and not a previous marlin-convert output: it holds no marlin_manifest.json" in err \
        and "--overwrite to replace" not in err
    assert "Hint: empty it, or choose another OUT_DIR" in err
    assert (out / "precious.txt").read_text() == "keep me"
    # --overwrite replaces a previous output only: a directory without the manifest is not the tool's to delete
    _run_failing(capsys, tmp_path, [str(src), str(out), "--overwrite"], "holds no marlin_manifest.json")
    assert (out / "precious.txt").read_text() == "keep me"
    (out / "precious.txt").unlink()
    assert main([str(src), str(out), "-q"]) == 0
    # a previous output: refused without --overwrite, with the hint to pass it
    _run_failing(capsys, tmp_path, [str(src), str(out)], "is not empty (a previous output)")
    # a previous output with something added (notes, an adapter folder): not the tool's to delete, even with
    # --overwrite; named in the error
    (out / "NOTES.md").write_text("added to a previous output")
    (out / "lora").mkdir()
    _run_failing(capsys, tmp_path, [str(src), str(out), "--overwrite"], "holds what its manifest does not list: "
                                                                          "NOTES.md, lora")
    assert (out / "NOTES.md").exists() and (out / "lora").is_dir()
    (out / "NOTES.md").unlink()
    (out / "lora").rmdir()
    assert main([str(src), str(out), "--overwrite", "-q"]) == 0
    assert (out / "marlin_manifest.json").exists()


@pytest.mark.parametrize("manifest_text", ["", "{", "{}", '{"format": "marlin-convert-manifest", "version": 0}'])
def test_overwrite_refuses_a_directory_whose_manifest_is_not_this_tools(capsys, tmp_path, src, manifest_text):
    """A file named marlin_manifest.json does not make a directory of someone's work replaceable."""
    out = tmp_path / "home"
    (out / "docs").mkdir(parents=True)
    (out / "thesis.tex").write_text("precious")
    (out / "marlin_manifest.json").write_text(manifest_text)
    _run_failing(capsys, tmp_path, [str(src), str(out), "--overwrite"],
                 "not a previous marlin-convert output: it holds a marlin_manifest.json that is not this tool's")
    assert sorted(p.name for p in out.iterdir()) == ["docs", "marlin_manifest.json", "thesis.tex"]


def test_a_hub_snapshot_is_never_converted_into_its_own_blobs(capsys, tmp_path):
    """IN_DIR's files are links into OUT_DIR (a Hugging Face snapshot and its blobs): replacing OUT_DIR would delete
    the source; refused before any work, with --overwrite too."""
    repo = tmp_path / "models--org--tiny"
    snapshot = write_checkpoint(tmp_path / "plain", _spec(group_size=64))
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    for i, path in enumerate(sorted(snapshot.iterdir())):
        blob = repo / "blobs" / (f"{i:x}" * 40)[:40]
        path.rename(blob)
        (repo / "snapshots" / "abc123" / path.name).symlink_to(f"../../blobs/{blob.name}")
    before = sorted(p.name for p in (repo / "blobs").iterdir())
    for extra in ([], ["--overwrite"]):
        _run_failing(capsys, tmp_path, [str(repo / "snapshots" / "abc123"), str(repo / "blobs"), *extra],
                     "inside OUT_DIR", "would destroy the source")
        assert sorted(p.name for p in (repo / "blobs").iterdir()) == before


def test_the_current_directory_is_never_out_dir(capsys, tmp_path, src, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    _run_failing(capsys, tmp_path, [str(src), "."], "the current directory")
    _run_failing(capsys, tmp_path, [str(src), ".", "--overwrite"], "the current directory")
    assert here.is_dir()


def test_an_overwritten_out_dir_that_cannot_all_be_removed_is_named(capsys, tmp_path, src):
    """--overwrite publishes the new output and names what stays of the old one (here an immutable file of it), and
    the next run on the same OUT_DIR removes it once it can."""
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0  # a previous output, one of its files made immutable
    stuck = out / "config.json"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("needs chattr +i (root, a file system with attributes) to make a file that cannot be removed")
    try:
        capsys.readouterr()
        assert main([str(src), str(out), "--overwrite"]) == 0
        printed = capsys.readouterr().out
        assert (out / "marlin_manifest.json").exists()
        left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
        assert len(left) == 1 and (left[0] / "config.json").exists()
        assert "the previous OUT_DIR's contents could not all be removed" in printed
        assert f"they are left in {left[0]}" in printed and "config.json: Operation not permitted" in printed
    finally:
        subprocess.run(["chattr", "-R", "-i", str(tmp_path)], capture_output=True)
    assert main([str(src), str(out), "--overwrite"]) == 0
    assert f"removed {left[0]}" in capsys.readouterr().out
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_out_dir_inside_in_dir(capsys, tmp_path, src):
    _run_failing(capsys, tmp_path, [str(src), str(src / "converted")], "inside")
    assert not (src / "converted").exists()


def test_out_dir_equal_to_in_dir(capsys, tmp_path, src):
    _run_failing(capsys, tmp_path, [str(src), str(src), "--overwrite"], "inside (or equal to)")
    assert (src / "model.safetensors").exists()


def test_unwritable_out_dir(capsys, tmp_path, src):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for out in (blocker / "out", blocker / "sub" / "out"):  # the file named, however deep OUT_DIR lies under it
        _run_failing(capsys, tmp_path, [str(src), str(out)], f"OUT_DIR {out} cannot be created: {blocker} is a file")
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_disk_full_while_writing_leaves_nothing_behind(capsys, tmp_path, src, monkeypatch, workers):
    real_pwrite = os.pwrite

    def pwrite_until_full(fd, data, offset):
        if offset > 0:  # each shard's header (at offset 0) lands, then the disk is full
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_until_full)  # forked worker processes inherit the patch
    out = tmp_path / "out"
    _run_failing(capsys, tmp_path, [str(src), str(out), "--workers", workers], "no space left on device")
    assert not out.exists()


def test_an_input_file_that_vanishes_during_the_conversion_is_named_not_out_dir(capsys, tmp_path, src, monkeypatch):
    """A file of IN_DIR removed while the conversion ran (found by a new-user helper: tokenizer.json deleted a second
    in) was reported as 'OUT_DIR: cannot write: No such file or directory'. The error now names the input file; the
    output is discarded."""
    from marlin_convert import convert as convert_module

    gone = src / "tokenizer.json"

    def vanished(*_args, **_kwargs):
        raise FileNotFoundError(2, "No such file or directory", str(gone))

    monkeypatch.setattr(convert_module, "output_file_digests", vanished)
    out = tmp_path / "out"
    line = _run_failing(capsys, tmp_path, [str(src), str(out)], f"{gone.resolve()}: cannot read: No such file")
    assert "OUT_DIR" not in line and str(out) not in line
    assert not out.exists()


def test_a_vanished_input_file_behind_a_link_is_named_too(tmp_path):
    """An attack helper: in a Hugging Face cache snapshot (files are links into the blob store, outside IN_DIR) a
    vanished input was still blamed on OUT_DIR, since only the resolved path was compared."""
    from marlin_convert.convert import _input_file_of

    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (snapshot / "tokenizer.json").symlink_to(blobs / "0123abcd")  # (its blob gone: a dangling link)
    error = FileNotFoundError(2, "No such file or directory", str(snapshot / "tokenizer.json"))
    assert _input_file_of(error, snapshot) == str(snapshot / "tokenizer.json")
    outside = FileNotFoundError(2, "No such file or directory", str(tmp_path / "out" / "x"))
    assert _input_file_of(outside, snapshot) is None


@pytest.mark.parametrize("dry_run", [False, True])
def test_too_little_free_space_is_refused_before_writing(capsys, tmp_path, src, monkeypatch, dry_run):
    """The dry run asks what the real run asks before it writes: too little free space is exit 2 in both, and the
    dry run's report keeps its plan and says why the run would stop."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 10 ** 9 - 1000, 1000))
    report = tmp_path / "report.json"
    out = tmp_path / "out"
    _run_failing(capsys, tmp_path, [str(src), str(out), "--json", str(report), *(["--dry-run"] if dry_run else [])],
                 "not enough disk space", "1000 are free")
    assert not out.exists()
    data = json.loads(report.read_text())
    assert (data["ok"], data["exit_code"]) == (False, 2) and "not enough disk space" in data["error"]
    assert ("layers" in data) == dry_run  # the plan


def test_an_out_dir_on_a_file_system_that_stores_nothing_is_named_as_such(capsys, tmp_path, src, monkeypatch):
    """OUT_DIR under /proc (a file system of size 0) was refused for 'not enough disk space: ... 0 are free', which
    sends the user to free space that cannot exist (found by an attack helper). It is named as what it is."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 0))
    line = _run_failing(capsys, tmp_path, [str(src), str(tmp_path / "out")], "stores no files", "its size is 0")
    assert "disk space" not in line and not (tmp_path / "out").exists()


def test_unsupported_layer_without_skip_names_layer_and_reason(capsys, tmp_path):
    src = write_checkpoint(tmp_path / "in", _spec(bits=2))
    line = _convert_fails(capsys, tmp_path, src, LAYER, "2-bit")
    assert "none of the 1 quantized layers can be converted" in line  # (the only layer)


# --------------------------------------------------------------------------------- hostile input (issue #8)


def _rewrite_header(directory, change, extra_data=b""):
    """Rewrite model.safetensors' header: ``change(header)`` edits the dict in place or returns the new JSON
    text; the data section is kept (``extra_data`` is appended to it)."""
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    text = change(header) or json.dumps(header)
    encoded = text.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:] + extra_data)


def _by_offset(header):
    return sorted((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def _shift(header, name, delta):
    header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]


NORM = "model.norm.weight"


def _duplicate_norm(header):
    text = json.dumps(header)
    return text[:-1] + f', "{NORM}": {{"dtype": "F16", "shape": [0], "data_offsets": [0, 0]}}}}'


HEADER_CASES = {
    "negative shape": (lambda h: h[NORM].update(shape=[-128]), "non-negative integers"),
    "float in shape": (lambda h: h[NORM].update(shape=[128.0]), "non-negative integers"),
    "shape beyond 64 bits": (lambda h: h[NORM].update(shape=[2 ** 64, 0]), "non-negative integers"),
    "element count beyond 64 bits": (lambda h: h[NORM].update(shape=[2 ** 63, 2, 0]), "more elements than 64 bits"),
    "float offsets": (lambda h: h[NORM].update(data_offsets=[float(o) for o in h[NORM]["data_offsets"]]),
                      "two non-negative integers"),
    "three offsets": (lambda h: h[NORM].update(data_offsets=[0, 0, 0]), "two non-negative integers"),
    "unknown dtype": (lambda h: h[NORM].update(dtype="F17"), 'has dtype "F17", not a safetensors dtype (BOOL,'),
    # 4-bit elements pack two to a byte: an odd count is no whole number of bytes (the reference library refuses it)
    "sub-byte dtype, odd count": (lambda h: h[NORM].update(dtype="F4", shape=[3]), "not a whole number of bytes"),
    # the values as JSON writes them (false, not Python's False)
    "boolean offset": (lambda h: h[NORM].update(data_offsets=[False, h[NORM]["data_offsets"][1]]),
                       "has data_offsets [false, "),
    "entry not an object": (lambda h: h.update({NORM: [1, 2]}), "not an object"),
    "duplicate key": (_duplicate_norm, "duplicate key 'model.norm.weight'"),
    "overlapping offsets": (lambda h: _shift(h, _by_offset(h)[1], -2), "overlaps tensor"),
    "metadata a list": (lambda h: h.update(__metadata__=["format", "pt"]), "'__metadata__' must map strings"),
    "metadata a string": (lambda h: h.update(__metadata__="pt"), "'__metadata__' must map strings"),
    "metadata an int": (lambda h: h.update(__metadata__=7), "'__metadata__' must map strings"),
    "metadata value not a string": (lambda h: h.update(__metadata__={"format": 1}), "'__metadata__' must map"),
    "header a list": (lambda h: "[]", "not an object"),
    "nested too deeply": (lambda h: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    # serde_json (the reference library's parser) rejects both; Python's json would accept them
    "NaN in an offset": (lambda h: json.dumps(h).replace("[0, ", "[NaN, ", 1), "NaN is not a JSON value"),
    "lone surrogate in a name": (lambda h: json.dumps(h)[:-1] + ', "\\ud800": {"dtype": "F16", "shape": [0], '
                                 '"data_offsets": [0, 0]}}', "lone surrogate"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_headers_the_reference_library_rejects_are_refused(capsys, tmp_path, src, case):
    change, fragment = HEADER_CASES[case]
    _rewrite_header(src, change)
    _convert_fails(capsys, tmp_path, src, "model.safetensors", fragment)


def test_header_with_a_hole_between_tensors_is_refused(capsys, tmp_path, src):
    _rewrite_header(src, lambda h: _shift(h, _by_offset(h)[-1], 2), extra_data=b"\0\0")
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "2 bytes before tensor", "belong to no tensor")


def test_bytes_after_the_last_tensor_are_refused(capsys, tmp_path, src):
    with open(src / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "16 bytes after the last tensor")


@pytest.fixture
def sharded(tmp_path):
    return write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, shards=2))


def _edit_index(directory, change):
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", "sub/model.safetensors", ".."])
def test_index_shard_names_must_stay_in_the_directory(capsys, tmp_path, sharded, shard):
    (sharded / "sub").mkdir()
    _edit_index(sharded, lambda index: index["weight_map"].update({next(iter(index["weight_map"])): shard}))
    _convert_fails(capsys, tmp_path, sharded, "model.safetensors.index.json", repr(shard), "not a plain file name")


@pytest.mark.parametrize("name", ["marlin_manifest.json", "tokenizer.json", "model-00002-of-00002.bin"])
def test_a_shard_not_named_safetensors_is_refused(capsys, tmp_path, sharded, name):
    """A shard named like a file the converter writes beside the shards (the manifest, a config) was overwritten by
    it: the output lost that shard's tensors and still exited 0."""
    old = sorted(sharded.glob("model-*.safetensors"))[-1]
    old.rename(sharded / name)
    _edit_index(sharded, lambda index: index["weight_map"].update(
        {tensor: name for tensor, shard in index["weight_map"].items() if shard == old.name}))
    _convert_fails(capsys, tmp_path, sharded, "model.safetensors.index.json", repr(name), "does not end in")


def test_shard_linked_to_a_blob_elsewhere_converts(capsys, tmp_path):
    """The Hugging Face cache layout: snapshot files are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    snapshot = write_checkpoint(repo / "snapshots" / "0123abc", tiny_llama(num_layers=1, shards=2))
    blobs = repo / "blobs"
    blobs.mkdir()
    for path in sorted(snapshot.iterdir()):
        blob = blobs / hashlib.sha256(path.name.encode()).hexdigest()
        path.rename(blob)
        path.symlink_to(os.path.relpath(blob, snapshot))
    assert main([str(snapshot), str(tmp_path / "out"), "-q"]) == 0
    capsys.readouterr()


def test_a_local_dir_download_linked_into_the_hub_cache_converts(capsys, tmp_path):
    """huggingface_hub before 0.23 left ``--local-dir`` downloads as links to ``~/.cache/.../blobs/<hash>``."""
    local = write_checkpoint(tmp_path / "local", tiny_llama(num_layers=1))
    blobs = tmp_path / "cache" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    for path in sorted(local.iterdir()):
        blob = blobs / hashlib.sha1(path.name.encode()).hexdigest()
        path.rename(blob)
        path.symlink_to(blob)
    assert main([str(local), str(tmp_path / "out"), "-q"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("name", ["model-00002-of-00002.safetensors", "model.safetensors.index.json", "config.json"])
def test_a_link_out_of_the_directory_is_not_read(capsys, tmp_path, sharded, name):
    """Outside the Hugging Face cache's blobs, a checkpoint file that links out of IN_DIR is refused unread."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (sharded / name).rename(elsewhere / name)
    (sharded / name).symlink_to(elsewhere / name)
    _convert_fails(capsys, tmp_path, sharded, name, "outside", "not read")


def test_shard_that_is_a_directory_or_a_broken_link(capsys, tmp_path, sharded):
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.unlink()
    victim.symlink_to(tmp_path / "nowhere")
    _convert_fails(capsys, tmp_path, sharded, victim.name, "is a broken link")
    victim.unlink()
    victim.mkdir()
    _convert_fails(capsys, tmp_path, sharded, victim.name, "is not a regular file")


def test_index_that_is_a_fifo_is_refused_without_reading(capsys, tmp_path, sharded):
    index = sharded / "model.safetensors.index.json"
    index.unlink()
    os.mkfifo(index)  # reading it would block forever
    _convert_fails(capsys, tmp_path, sharded, "model.safetensors.index.json", "not a regular file")


def test_index_metadata_that_is_not_an_object(capsys, tmp_path, sharded):
    _edit_index(sharded, lambda index: index.update(metadata=[1, 2]))
    _convert_fails(capsys, tmp_path, sharded, "model.safetensors.index.json", "'metadata' is a JSON list")


def test_index_weight_map_value_that_is_not_a_string(capsys, tmp_path, sharded):
    _edit_index(sharded, lambda index: index["weight_map"].update({"model.norm.weight": 3}))
    _convert_fails(capsys, tmp_path, sharded, "model.safetensors.index.json", "'model.norm.weight' to 3")


@pytest.mark.parametrize("weight_map,fragment", [({}, "'weight_map' is empty"), ([], "'weight_map' is a JSON list"),
                                                 (None, "no 'weight_map' object")])
def test_index_weight_map_empty_or_not_an_object(capsys, tmp_path, sharded, weight_map, fragment):
    """An empty weight_map is named as empty (it is an object: "no 'weight_map' object" misled a user)."""
    _edit_index(sharded, lambda index: index.update(weight_map=weight_map) if weight_map is not None
                else index.pop("weight_map"))
    _convert_fails(capsys, tmp_path, sharded, "model.safetensors.index.json", fragment)


def test_deeply_nested_config(capsys, tmp_path, src):
    (src / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    _convert_fails(capsys, tmp_path, src, "config.json", "nested too deeply")


def test_config_with_a_repeated_key(capsys, tmp_path, src):
    (src / "quantize_config.json").write_text('{"bits": 4, "group_size": 64, "bits": 8}')
    _convert_fails(capsys, tmp_path, src, "quantize_config.json", "duplicate key 'bits'")


@pytest.mark.parametrize("name", ["config.json", "quantize_config.json"])
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_in_a_config_is_refused(capsys, tmp_path, src, name, constant):
    text = (src / name).read_text()
    (src / name).write_text(text.replace("{", f'{{"damp_percent": {constant}, ', 1))  # Python's json reads it
    _convert_fails(capsys, tmp_path, src, name, f"{constant} is not a JSON value")


@pytest.mark.parametrize("name", ["config.json", "quantize_config.json"])
@pytest.mark.parametrize("number", ["1e999", "-1E400"])
def test_a_number_too_large_for_a_float_in_a_config_is_refused(capsys, tmp_path, src, name, number):
    """Python reads it as infinity and would write it back as Infinity, which no JSON reader (verify's included)
    takes: the output's configs were unreadable."""
    text = (src / name).read_text()
    (src / name).write_text(text.replace("{", f'{{"damp_percent": {number}, ', 1))
    _convert_fails(capsys, tmp_path, src, name, f"number {number} is too large for a 64-bit float")


@pytest.mark.parametrize("text, place", [
    ('{"a": {"b c": [1, N]}}', "'a[\"b c\"][1]'"),
    ('{"layers": [{"num_experts": -N}]}', "'layers[0].num_experts'"),
    ("N", "the document"),
])
def test_an_integer_of_too_many_digits_is_named_by_its_place_not_with_pythons_advice(text, place):
    digits = strict_json.MAX_INT_DIGITS + 1
    with pytest.raises(ValueError) as caught:
        strict_json.loads(text.replace("N", "7" * digits))
    assert str(caught.value) == f"{place}: a number of {digits} digits, too large to read"
    assert strict_json.loads(text.replace("N", "7" * (digits - 1)))  # the longest one still reads


def test_an_integer_of_too_many_digits_in_a_config_names_the_key(capsys, tmp_path, src):
    text = (src / "quantize_config.json").read_text()
    (src / "quantize_config.json").write_text(text.replace("{", '{"damp_percent": ' + "1" * 5000 + ", ", 1))
    line = _convert_fails(capsys, tmp_path, src, "quantize_config.json",
                          "'damp_percent': a number of 5000 digits, too large to read")
    assert "set_int_max_str_digits" not in line


@pytest.mark.parametrize("raw", [
    '{"k": "\\ud800"}', b'["ok", {"\\udfff": 1}]', b'"a \\ud83d b"', b'"\\ude00\\ud83d"',  # escapes, no pair
    '"\ud800"',  # a str may hold a lone surrogate itself, without any escape
    b'"\xed\xa0\x80"',  # one encoded in the bytes (not UTF-8)
])
def test_a_lone_surrogate_is_refused_with_or_without_an_escape(raw):
    with pytest.raises(ValueError, match="lone surrogate|can't decode"):
        strict_json.loads(raw)


def test_text_without_a_unicode_escape_reads_as_json_reads_it_and_a_surrogate_pair_is_one_character():
    text = '{"name": "gr\u00f6\u00dfe \u2713 \U0001f600", "list": [1, -2.5e3, true, false, null, "a\\"b\\n/"], "o": {}}'
    assert "\\u" not in text  # so loads skips its walk over the strings
    for raw in (text, text.encode()):
        assert strict_json.loads(raw) == json.loads(text)
    assert strict_json.loads(b'"\\ud83d\\ude00 \\u00e9"') == "\U0001f600 \u00e9"


@pytest.mark.parametrize("name", ["config.json", "quantize_config.json", "model.safetensors.index.json"])
def test_a_broken_link_as_config_or_index_is_named_not_ignored(capsys, tmp_path, sharded, name):
    (sharded / name).unlink()
    (sharded / name).symlink_to(tmp_path / "gone.json")
    _convert_fails(capsys, tmp_path, sharded, name, "broken link")


@pytest.mark.parametrize("value", [["float16"], 16, {"x": 1}])
def test_a_model_dtype_that_is_not_a_string_is_refused(capsys, tmp_path, src, value):
    """Recorded as the manifest's model_dtype, it made an output that its own verify refused."""
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = value
    (src / "config.json").write_text(json.dumps(config))
    _convert_fails(capsys, tmp_path, src, "config.json", "'torch_dtype' must be a JSON string")


@pytest.mark.parametrize("shape", [(0, 128), (32, 0), (0, 32, 128)])
def test_an_empty_qweight_is_refused(capsys, tmp_path, src, shape):
    """K = 0, N = 0 or no experts: an internal error (exit 3) before."""
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.qweight": np.zeros(shape, np.int32)}))
    _convert_fails(capsys, tmp_path, src, f"'{LAYER}.qweight' has shape {list(shape)}: an empty layer")


@pytest.mark.parametrize("suffix", ["B", "s"])
def test_a_source_tensor_named_like_a_marlin_output_is_refused(capsys, tmp_path, src, suffix):
    """``P.B`` beside ``P.qweight``: both would be written as ``P.B`` (a broken shard, before: an internal check)."""
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.{suffix}": np.zeros(4, np.float16)}))
    line = _convert_fails(capsys, tmp_path, src, f"'{LAYER}.{suffix}' would be written twice", "model.safetensors",
                          f"layer '{LAYER}'")
    assert "partial" not in line


@pytest.mark.parametrize("suffix", ["zp", "perm", "g_idx"])
def test_a_source_tensor_named_like_a_marlin_tensor_the_layer_does_not_write_is_refused(capsys, tmp_path, src,
                                                                                       suffix):
    """``P.zp`` of a symmetric layer (``P.perm``, ``P.g_idx`` without act-order) was copied through: beside ``P.B``
    and ``P.s`` a loader would read it as the layer's zero points (or permutation)."""
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.{suffix}": np.zeros(4, np.int32)}))
    if suffix == "g_idx":  # a GPTQ layer's own g_idx: here it is the layer's source tensor, read as such
        _convert_fails(capsys, tmp_path, src, f"{LAYER}.g_idx")
        return
    _convert_fails(capsys, tmp_path, src, f"tensor '{LAYER}.{suffix}' is named like a Marlin tensor of layer "
                   f"'{LAYER}', which is converted")


@pytest.mark.parametrize("shape", [(7,), (1, 128), (256,)])
def test_a_bias_whose_shape_is_not_the_layers_outputs_is_refused(capsys, tmp_path, src, shape):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.bias": np.zeros(shape, np.float16)}))
    _convert_fails(capsys, tmp_path, src, f"tensor '{LAYER}.bias' has shape {list(shape)}", "N = 128",
                   "its bias must be [128]")


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_a_bias_that_is_not_floating_point_is_refused(capsys, tmp_path, src, dtype):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.bias": np.zeros(128, dtype)}))
    _convert_fails(capsys, tmp_path, src, f"tensor '{LAYER}.bias' is", "must be float16, bfloat16 or float32")


def test_a_bias_of_the_layers_outputs_is_copied(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: t.update({f"{LAYER}.bias": np.arange(128, dtype=np.float16)}))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0
    capsys.readouterr()
    assert read_header(tmp_path / "out" / "model.safetensors").tensors[f"{LAYER}.bias"].shape == (128,)


# ------------------------------------------------------------------- what OUT_DIR gets from IN_DIR (issue #8)


def _convert_notes(capsys, tmp_path, src) -> list[str]:
    report = tmp_path / "report.json"
    assert main([str(src), str(tmp_path / "out"), "-q", "--json", str(report)]) == 0
    capsys.readouterr()
    return json.loads(report.read_text())["notes"]


def test_only_top_level_regular_files_are_copied_and_the_rest_is_named(capsys, tmp_path, src):
    (src / "alias.json").symlink_to("tokenizer.json")  # a link inside IN_DIR: copied as content
    (src / "loop").symlink_to(".")  # a directory link (a loop): never followed
    (src / "extra_dir").mkdir()
    (src / "extra_dir" / "big.txt").write_text("x")
    (src / ".git").mkdir()
    (src / ".git" / "config").write_text("[core]")
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    (src / "vocab.txt").symlink_to(secret)  # a link to a file outside IN_DIR: not copied
    notes = _convert_notes(capsys, tmp_path, src)
    out = tmp_path / "out"
    copied = sorted(p.name for p in out.iterdir())
    assert "tokenizer.json" in copied and "alias.json" in copied and not (out / "alias.json").is_symlink()
    for absent in ("loop", "extra_dir", ".git", "pytorch_model.bin", "vocab.txt"):
        assert absent not in copied
        assert any(absent in note for note in notes if note.startswith("not copied from IN_DIR")), (absent, notes)
    assert any("vocab.txt" in note and "outside IN_DIR" in note for note in notes)


def test_files_linked_into_the_hub_cache_blob_store_are_copied(capsys, tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot = write_checkpoint(repo / "snapshots" / "abc123", _spec(group_size=64))
    (repo / "blobs").mkdir()
    blob = "f00d" * 10  # a git hash: 40 hex digits
    (repo / "blobs" / blob).write_text("{{ messages }}")
    (snapshot / "chat_template.jinja").symlink_to(f"../../blobs/{blob}")
    assert main([str(snapshot), str(tmp_path / "out"), "-q"]) == 0
    capsys.readouterr()
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == "{{ messages }}"


@pytest.mark.parametrize("target, what", [("gone.json", "broken link (to gone.json)"),
                                          ("merges.txt", "a loop of links (through merges.txt)")])
def test_a_broken_link_among_the_extra_files_is_named_before_any_work(capsys, tmp_path, src, target, what):
    (src / "merges.txt").symlink_to(target)
    _convert_fails(capsys, tmp_path, src, str(src / "merges.txt"), what)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_an_unreadable_extra_file_is_named_before_any_work(capsys, tmp_path, src):
    (src / "merges.txt").write_text("a b")
    (src / "merges.txt").chmod(0)
    _convert_fails(capsys, tmp_path, src, str(src / "merges.txt"), "cannot read")


def _scale_rows_for_group_96(src):
    """Both configs say group size 96: 3 rows for K = 256; the scales have 4."""
    set_quant_config(src, group_size=96)


def _write_dynamic(src, config_rules: dict, quantize_rules: dict) -> None:
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["dynamic"] = config_rules
    (src / "config.json").write_text(json.dumps(config))
    quantize = json.loads((src / "quantize_config.json").read_text())
    quantize["dynamic"] = quantize_rules
    (src / "quantize_config.json").write_text(json.dumps(quantize))


def test_configs_whose_dynamic_rules_come_in_another_order_that_matters_are_refused(capsys, tmp_path, src):
    """The first matching rule wins: where the other order resolves a stored layer otherwise, the configs disagree;
    the error names the layer and the two rules."""
    rules = {"-:.*down_proj": {}, "+:.*down_proj": {"bits": 8}}
    _write_dynamic(src, rules, dict(reversed(list(rules.items()))))
    _convert_fails(capsys, tmp_path, src, "model.layers.0.mlp.down_proj", "in another order",
                   '"-:.*down_proj"', '"+:.*down_proj"')


def test_configs_whose_dynamic_rules_come_in_another_order_that_resolves_alike_convert(capsys, tmp_path, src):
    """transformers writes config.json with sorted keys, GPTQModel and AutoRound write quantize_config.json in the
    rules' own order: where every layer resolves alike either way, the checkpoint converts and verifies."""
    rules = {"+:.*up_proj": {"bits": 8}, "+:.*down_proj": {"desc_act": False}}
    assert list(rules) != sorted(rules)
    _write_dynamic(src, dict(sorted(rules.items())), rules)
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "--source", str(src), "-q"]) == 0
    capsys.readouterr()


def test_dynamic_rules_in_another_order_that_quantize_a_stored_fp16_module_are_refused(capsys, tmp_path):
    """An exclusion first in quantize_config.json, after a matching + rule in config.json's sorted order: the module
    stored unquantized would read as quantized through config.json alone."""
    spec = _spec(group_size=64)
    spec.extras.append(TensorSpec("model.layers.0.mlp.up_proj.weight", (128, 256), "float16"))
    src = write_checkpoint(tmp_path / "in", spec)
    rules = {"-:.*up_proj": {}, "+:.*mlp.*": {"desc_act": False}}
    _write_dynamic(src, dict(sorted(rules.items())), rules)
    _convert_fails(capsys, tmp_path, src, "module 'model.layers.0.mlp.up_proj'", "in another order")


@pytest.mark.parametrize("config_rules, quantize_rules, fragment", [
    ({"+:.*up_proj": {"bits": 4}}, {}, 'rule "+:.*up_proj" is only in config.json'),
    ({}, {"+:.*up_proj": {"bits": 4}}, 'rule "+:.*up_proj" is only in quantize_config.json'),
    ({"+:.*up_proj": {"bits": 4}}, {"+:.*up_proj": {"bits": 8}}, 'rule "+:.*up_proj" is {"bits": 4} against'),
])
def test_dynamic_rules_that_differ_are_named_rule_by_rule(capsys, tmp_path, src, config_rules, quantize_rules,
                                                          fragment):
    _write_dynamic(src, config_rules, quantize_rules)
    _convert_fails(capsys, tmp_path, src, "'dynamic' disagrees", fragment)


@pytest.mark.parametrize("pack_dtype, ok", [("int32", True), ("torch.int32", True), (None, True), ("int16", False),
                                            ("torch.int64", False)])
def test_gptqmodel_pack_dtype_other_than_int32_is_refused_by_name(capsys, tmp_path, src, pack_dtype, ok):
    set_quant_config(src, pack_dtype=pack_dtype)
    if ok:
        assert main(["inspect", str(src)]) == 0
        capsys.readouterr()
    else:
        _convert_fails(capsys, tmp_path, src, f'pack_dtype "{pack_dtype}"', "int32")


def test_autoround_awq_packing_is_refused_naming_the_key_and_value(capsys, tmp_path, src):
    set_quant_config(src, quant_method="auto-round", packing_format="auto_round:auto_awq")
    _convert_fails(capsys, tmp_path, src, 'packing_format is "auto_round:auto_awq": AWQ', "not GPTQ's")


def test_a_tensor_of_an_unexpected_dtype_is_named_by_its_dtype_name(capsys, tmp_path, src):
    name = f"{LAYER}.qweight"
    _rewrite_tensors(src, lambda tensors: tensors.update({name: tensors[name].view(np.int16)}))
    _convert_fails(capsys, tmp_path, src, name, "dtype int16, expected int32")


def test_configs_that_state_a_label_in_other_case_or_no_rules_two_ways_agree(capsys, tmp_path, src):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"].update(quant_method="GPTQ", dynamic=None)
    (src / "config.json").write_text(json.dumps(config))
    quantize = json.loads((src / "quantize_config.json").read_text())
    quantize.update(quant_method="gptq", dynamic={})
    (src / "quantize_config.json").write_text(json.dumps(quantize))
    assert main(["inspect", str(src)]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("key, value", [("bits", 8), ("group_size", 128), ("sym", False), ("desc_act", True)])
def test_configs_that_disagree_on_a_layer_setting_are_refused(capsys, tmp_path, src, key, value):
    """config.json's quantization_config and quantize_config.json stating different settings: the later file used
    to win silently, and the output's config.json kept the other value."""
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"][key] = value
    (src / "config.json").write_text(json.dumps(config))
    _convert_fails(capsys, tmp_path, src, "config.json (quantization_config) and", "quantize_config.json",
                   f"'{key}' disagrees: {json.dumps(value)} against")


def _g_idx_value(src, value):
    def change(t):
        g_idx = t[f"{LAYER}.g_idx"].copy()
        g_idx[5] = value
        t[f"{LAYER}.g_idx"] = g_idx
    _rewrite_tensors(src, change)


@pytest.mark.parametrize("case, change", [
    ("group size", _scale_rows_for_group_96),
    ("scales shape", lambda src: _rewrite_tensors(
        src, lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"][:, :64].copy()}))),
    ("qweight dtype", lambda src: _rewrite_tensors(
        src, lambda t: t.update({f"{LAYER}.qweight": t[f"{LAYER}.qweight"].view(np.float32)}))),
    ("g_idx range", lambda src: _g_idx_value(src, 4)),
    ("g_idx balance", lambda src: _g_idx_value(src, 1 - int(read_tensor(read_header(src / "model.safetensors"),
                                                                         f"{LAYER}.g_idx")[5]) % 2)),
])
def test_layer_errors_name_the_shard_by_its_full_path(capsys, tmp_path, src, case, change):
    change(src)
    line = _convert_fails(capsys, tmp_path, src, f"{LAYER}.")
    assert line.startswith(f"Error: {src / 'model.safetensors'}: tensor '{LAYER}."), (case, line)


def test_a_huge_expert_index_is_refused_at_once(capsys, tmp_path):
    """Experts 0, 1, 2 and 10^18 - 1: a hole, named at once (a search over 0..10^18 exhausted memory)."""
    src = write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64,
                                                      vocab=256))
    huge = "9" * 18

    def rename(tensors):
        for name in [n for n in tensors if ".experts.3." in n]:
            tensors[name.replace(".experts.3.", f".experts.{huge}.")] = tensors.pop(name)

    _rewrite_tensors(src, rename)
    _bounded_fails([str(src), str(tmp_path / "out")], "expert(s) 3, 4, 5", "missing")
    assert not (tmp_path / "out").exists()


def _bounded_fails(args, *fragments, seconds=120, memory_bytes=8 << 30):
    """``main(args)`` in a child process with a time and address-space limit (a regression that would hang or take
    the machine's memory fails the test instead): exit 2 and one ``Error:`` line holding ``fragments``."""
    code = "import sys; from marlin_convert.cli.app import main; sys.exit(main(sys.argv[1:]))"

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=seconds,
                          preexec_fn=limit)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize("regex, fragment", [("(a+)+$", "repeats a repeat"), ("(a{1,50}){1,50}$", "repeats a repeat"),
                                             ("(a|aa)*c", "repeats a repeat or alternatives"),
                                             # bounded repeats multiply too (each of these ran > 15 s on 40 a's)
                                             ("((a|aa){1,16}){1,16}c", "repeats a repeat or alternatives"),
                                             ("(a|aa){2,16}" * 4 + "c", "repeats a repeat or alternatives"),
                                             ("(?:a{1,16}){1,16}c", "repeats a repeat"),
                                             ("(.*.*.*.*.*.*.*.*.*.*.*)!", "11 repeats of a chosen count"),
                                             (".{0,16}" * 5 + "!", "5 repeats of a chosen count"),
                                             (".*a" * 4 + "!", "4 repeats of a chosen count"),
                                             ("a?" * 30 + "a" * 30, "30 optional parts"),
                                             # alternatives side by side: '(?:|.)' is '.?'
                                             ("(?:|.)" * 32 + "!", "32 optional parts or alternatives"),
                                             ("(?:model.|)(?:layers.|)" + "(?:.|..)" * 26 + "gate_proj",
                                              "28 optional parts or alternatives"),
                                             # 16 alternatives: a factor of 16, four optional parts (8.9 s a name)
                                             (("(?:" + "|".join("." * i for i in range(16)) + ")") * 8 + "!",
                                              "32 optional parts or alternatives"),
                                             # a fixed count of a zero-width part runs that often whatever the name:
                                             # 10 s a name, and minutes where two nest
                                             ("(?:){100000000}", "repeats its parts up to 100000000 times"),
                                             ("(?:(?:){60000}){60000}", "up to 3600060000 times"),
                                             ("(?:^){60000}" * 2, "up to 120000 times")])
def test_a_dynamic_rule_that_could_match_for_hours_is_refused(tmp_path, src, regex, fragment):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {f"-:{regex}": {}}
    (src / "config.json").write_text(json.dumps(config))
    _rewrite_tensors(src, lambda t: t.update({"a" * 40 + "!.qweight": t[f"{LAYER}.qweight"]}))
    _bounded_fails(["inspect", str(src)], "config.json", regex, fragment)


def test_a_module_name_too_long_to_match_against_the_config_regexes_is_refused(tmp_path, src):
    """A rule within the limits still takes time of a power of the name's length, which the checkpoint chooses:
    ``.*a.*a.*a!`` on one layer named with 2,000 a's took 29 s. Names over 256 characters are refused where a config
    regex would be matched against them; without rules the same checkpoint converts."""
    long_prefix = "model.layers.0.mlp." + "a" * 2000 + ".down_proj"

    def rename(tensors):
        for name in [n for n in tensors if n.startswith(f"{LAYER}.")]:
            tensors[long_prefix + name[len(LAYER):]] = tensors.pop(name)

    _rewrite_tensors(src, rename)
    assert main(["inspect", str(src)]) == 0
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {"+:.*a.*a.*a!": {"bits": 8}}
    (src / "config.json").write_text(json.dumps(config))
    _bounded_fails(["inspect", str(src)], "has a name of 2029 characters, longer than 256", seconds=60)


@pytest.mark.parametrize("regex", [
    # GPTQModel's documented dynamic rules, and llm-compressor's usual ignore / target entries
    r".*\.18\..*gate.*", r".*\.19\..*gate.*", r".*\.20\..*gate.*", r".*down.*", r".*\.(?:1[0-5])\..*",
    r"model\.layers\.(0|1)\..*", r"model\.layers\.(\d+)\.mlp\..*", r".*lm_head", r".*mlp.gate$",
    r"model.layers.\d+.mlp.experts.\d+.(gate|up|down)_proj", r"(\d{2}\.)+x",
    r".*q_proj.*|.*k_proj.*|.*v_proj.*",  # alternatives: the costliest one counts, not their sum
    r"[\w.]{1,1000}proj", r"(?:\b){5,}",  # a count beyond the longest name stops at the name's end
])
def test_the_rules_producers_write_compile(regex):
    from marlin_convert.config_regex import compile_config_regex

    assert compile_config_regex(regex, "test").pattern == regex


def test_a_newline_in_a_tensor_name_stays_on_the_error_line(capsys, tmp_path, src):
    bad = "a\nError: fake.qweight"
    _rewrite_tensors(src, lambda t: t.update({bad: np.zeros((32, 128), np.float32)}))
    line = _convert_fails(capsys, tmp_path, src, "a\\x0aError: fake.qweight", "dtype float32, expected int32")
    assert "\x1b" not in line


@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_json_report_inside_a_checkpoint_is_refused(capsys, tmp_path, src, command):
    out = tmp_path / "out"
    shard = src / "model.safetensors"
    before = shard.read_bytes()
    if command == "convert":
        args = [str(src), str(out), "--json", str(shard)]
    elif command == "inspect":
        args = ["inspect", str(src), "--json", str(src / "config.json")]
    else:
        assert main([str(src), str(out), "-q"]) == 0
        capsys.readouterr()
        args = ["verify", str(out), "--skip-kernel", "--json", str(out / "marlin_manifest.json")]
    _run_failing(capsys, tmp_path, args, "--json", "which this command reads or writes")
    assert shard.read_bytes() == before
    if command == "verify":
        assert main(["verify", str(out), "--skip-kernel", "-q"]) == 0


def test_json_report_over_a_hard_link_to_a_shard_leaves_the_shard_alone(capsys, tmp_path, src):
    """A --json path outside the checkpoints that is a hard link to a shard: the report replaces the name, never
    writes through it (the shard keeps its bytes, the conversion succeeds)."""
    shard = src / "model.safetensors"
    before = shard.read_bytes()
    link = tmp_path / "report.json"
    os.link(shard, link)
    assert main([str(src), str(tmp_path / "out"), "-q", "--json", str(link)]) == 0
    capsys.readouterr()
    assert shard.read_bytes() == before
    assert json.loads(link.read_text())["layers"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_workers_beyond_the_limit_are_refused(capsys, tmp_path, src, command):
    args = [str(src), str(tmp_path / "out"), "--workers", "257"] if command == "convert" else \
        ["verify", str(tmp_path), "--skip-kernel", "--workers", "257"]
    _run_failing(capsys, tmp_path, args, "--workers", "256")


def test_a_source_that_shrinks_while_copied_is_named(tmp_path):
    from marlin_convert.safetensors_io import PlannedTensor, ShardWriter

    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100)
    writer = ShardWriter(tmp_path / "out.safetensors", [PlannedTensor("t", "U8", (400,))], {})
    with pytest.raises(InputError, match=r"source\.bin: cannot read tensor 't': it ended early"):
        writer.copy_range("t", source, 0, 400)
    writer.abort()


def test_a_missing_tensor_of_a_layer_is_named_with_the_shard_of_its_qweight(capsys, tmp_path, src):
    _rewrite_tensors(src, lambda t: t.pop(f"{LAYER}.scales"))
    _convert_fails(capsys, tmp_path, src, f"{src / 'model.safetensors'}: tensor '{LAYER}.scales' is missing")


def test_a_layer_without_its_qweight_is_refused(capsys, tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1))
    layer = "model.layers.0.mlp.up_proj"
    _rewrite_tensors(src, lambda t: t.pop(f"{layer}.qweight"))
    _convert_fails(capsys, tmp_path, src, layer, "qzeros, scales", "no 'model.layers.0.mlp.up_proj.qweight'")


@pytest.mark.parametrize("header_len, fragment", [(150 * 2**20, "more than the 100000000 this tool reads"),
                                                  (300 * 2**20, "does not fit a 209715200-byte file")])
def test_a_header_length_names_the_right_reason(tmp_path, header_len, fragment):
    """A length prefix past the file's end and one within it but over the header cap get different reasons."""
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len))
        f.truncate(200 * 2**20)  # sparse: no 200 MB written
    with pytest.raises(InputError, match=fragment):
        read_header(path)


# ------------------------------------------------------------------ a file swapped after it was checked


def _swap_for_an_outside_link(path, tmp_path):
    """Replace ``path`` by a link to a byte-identical copy outside its directory: a read through the link would
    succeed, so only a check of the file actually opened can refuse it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    copy = elsewhere / path.name
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)


def test_open_inside_checks_the_file_it_opened(tmp_path):
    from marlin_convert.fileio import NotReadHere, open_inside

    root = tmp_path / "root"
    root.mkdir()
    (root / "plain").write_bytes(b"x")
    (root / "alias").symlink_to("plain")
    os.close(open_inside(root / "plain"))
    os.close(open_inside(root / "alias"))  # a link that stays inside
    (root / "secret").write_bytes(b"s")
    _swap_for_an_outside_link(root / "secret", tmp_path)
    with pytest.raises(NotReadHere, match=r"outside .*root; not read"):
        open_inside(root / "secret")
    os.mkfifo(root / "fifo")  # opened without blocking (no writer exists), then refused
    with pytest.raises(NotReadHere, match="not a regular file"):
        open_inside(root / "fifo")
    blobs = tmp_path / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    blob = blobs / ("ab" * 20)
    blob.write_bytes(b"w")
    (root / "weights").symlink_to(blob)  # the Hugging Face cache's blob store: read
    os.close(open_inside(root / "weights"))


def test_a_shard_swapped_for_an_outside_link_after_its_header_was_read_is_not_read(tmp_path, src):
    """Checked once and re-opened per tensor: every re-open checks the file it opened."""
    from marlin_convert.safetensors_io import PlannedTensor, ShardWriter

    path = src / "model.safetensors"
    header = read_header(path)
    _swap_for_an_outside_link(path, tmp_path)
    name = f"{LAYER}.qweight"
    with pytest.raises(InputError, match=r"model\.safetensors: cannot read tensor .*: it leads to .*elsewhere"):
        read_tensor(header, name)
    info = header.tensors[name]
    writer = ShardWriter(tmp_path / "out.safetensors", [PlannedTensor("t", "U8", (info.nbytes,))], {})
    with pytest.raises(InputError, match=r"model\.safetensors: cannot read: it leads to .*elsewhere"):
        writer.copy_range("t", path, info.begin, info.nbytes)
    writer.abort()


def test_a_shard_swapped_for_an_outside_link_during_the_conversion_stops_it(capsys, tmp_path, src, monkeypatch):
    import marlin_convert.convert as convert_module

    planned = convert_module.plan_layers

    def plan_then_swap(checkpoint):
        layers = planned(checkpoint)
        _swap_for_an_outside_link(src / "model.safetensors", tmp_path)
        return layers

    monkeypatch.setattr(convert_module, "plan_layers", plan_then_swap)
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "outside", "not read")


def test_a_converted_shard_swapped_for_an_outside_link_after_the_audit_fails_verify(capsys, tmp_path, src,
                                                                                    monkeypatch):
    import marlin_convert.verify as verify_module

    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    audited = verify_module.audit

    def audit_then_swap(out_dir, manifest):
        checked = audited(out_dir, manifest)
        _swap_for_an_outside_link(out / "model.safetensors", tmp_path)
        return checked

    monkeypatch.setattr(verify_module, "audit", audit_then_swap)
    capsys.readouterr()
    rc = main(["verify", str(out), "--skip-kernel", "--workers", "1"])
    captured = capsys.readouterr()
    assert rc == 1, captured
    assert "it leads to" in captured.out + captured.err and "Traceback" not in captured.err


def test_a_shard_written_to_during_the_conversion_stops_it(capsys, tmp_path, src, monkeypatch):
    """g_idx made out of range after planning checked it (same size, same file): the bytes converted are not the
    ones checked, so nothing is published (it was, with an out-of-range g_idx in the output)."""
    import marlin_convert.convert as convert_module

    planned = convert_module.plan_layers
    shard = src / "model.safetensors"

    def plan_then_write(checkpoint):
        layers = planned(checkpoint)
        info = read_header(shard).tensors[f"{LAYER}.qweight"]
        with open(shard, "r+b") as f:
            f.seek(read_header(shard).data_start + info.begin)
            f.write(b"\xff" * 16)
        return layers

    monkeypatch.setattr(convert_module, "plan_layers", plan_then_write)
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "changed since its header was read",
                   "modification or status-change time moved")


def test_a_shard_written_to_after_its_last_read_stops_the_conversion_before_publishing(capsys, tmp_path, src,
                                                                                      monkeypatch):
    import marlin_convert.convert as convert_module

    digest = convert_module.manifest_digest

    def write_then_digest(directory):
        with open(src / "model.safetensors", "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x00")
        return digest(directory)

    monkeypatch.setattr(convert_module, "manifest_digest", write_then_digest)
    _convert_fails(capsys, tmp_path, src, "model.safetensors", "changed while it was being converted",
                   "the output is discarded")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_json_file_of_gigabytes_is_refused_unread(capsys, tmp_path, sharded, name):
    """Sparse (no disk used): read whole, it took 6 GB of memory before the parser refused it."""
    with open(sharded / name, "r+b") as f:
        f.truncate(3 << 30)
    _bounded_fails([str(sharded), str(tmp_path / "out")], name, "more than the 268435456 this tool reads",
                   memory_bytes=2 << 30)


def test_a_manifest_of_gigabytes_is_refused_unread(capsys, tmp_path, src):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    with open(out / "marlin_manifest.json", "r+b") as f:
        f.truncate(3 << 30)
    _bounded_fails(["verify", str(out), "--skip-kernel"], "marlin_manifest.json",
                   "unreadable: 3221225472 bytes, more than", memory_bytes=2 << 30)


@pytest.mark.parametrize("change, fragments", [
    # a billion experts and no source: the audit built a list of a billion expected slices (ran for ever, GBs)
    ({"num_experts": 10**9, "expert_stride_int32": 1, "sources": []},
     ["layers[0].num_experts': 1000000000 experts, but shapes.B is [16, 256]"]),
    ({"num_experts": 10**9, "expert_stride_int32": 1, "sources": [],
      "shapes": {"B": [10**9, 16, 256], "s": [10**9, 4, 128]}},
     ["layers[0].sources': 0 source(s) for 1000000000 expert(s), expected 1 or 1000000000 (one per expert)"]),
])
def test_a_manifest_whose_expert_count_its_entry_does_not_bear_out_is_refused_at_once(capsys, tmp_path, src, change,
                                                                                     fragments):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    path = out / "marlin_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["layers"][0].update(change)
    path.write_text(json.dumps(manifest))
    _bounded_fails(["verify", str(out), "--skip-kernel"], "marlin_manifest.json: field", *fragments, seconds=60,
                   memory_bytes=2 << 30)


def test_every_read_of_a_shard_checks_it_is_the_file_whose_header_was_read(tmp_path, src):
    """Swapped for another file inside IN_DIR (even a byte-identical copy), or written to with its modification time
    put back: each later read refuses it at once, not only the check before publishing (a shard swapped and swapped
    back between the two was converted from the other file's bytes)."""
    path = src / "model.safetensors"
    name = f"{LAYER}.qweight"
    header = read_header(path)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # another inode at the path, same bytes
    with pytest.raises(InputError, match="changed since its header was read: another file is now at its path"):
        read_tensor(header, name)
    header = read_header(path)
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(header.data_start + header.tensors[name].begin)
        f.write(b"\x00" * 8)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the modification time put back
    with pytest.raises(InputError, match="modification or status-change time moved"):
        read_tensor(header, name)


def test_an_error_quoting_a_huge_config_value_is_shortened(capsys, tmp_path, src):
    """A dynamic rule of 300,000 characters: the Error line keeps its start and end (at most MAX_LINE characters,
    one line), the --json report of the failure holds the message whole."""
    from marlin_convert.cli._errors import MAX_LINE

    rule = "+:" + "(a" * 50000 + ")" * 50000
    _write_dynamic(src, {rule: {"bits": 8}}, {rule: {"bits": 8}})
    report = tmp_path.parent / f"{tmp_path.name}-report.json"
    rc = main([str(src), str(tmp_path / "out"), "--json", str(report)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert rc == 2 and len(errors) == 1 and len(errors[0]) <= MAX_LINE + 60, (rc, len(err))
    assert "characters left out" in errors[0] and all(len(line) <= MAX_LINE + 60 for line in err.splitlines())
    assert len(json.loads(report.read_text())["error"]) > 100000


@pytest.mark.parametrize("how", ["ismount", "mountinfo"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_out_dir_on_a_mount_point_is_refused_before_any_work(capsys, tmp_path, src, monkeypatch, dry_run, how):
    """The output is built beside OUT_DIR and renamed into place: an (empty) mount point cannot be replaced so, and the
    run failed after writing everything into its parent. Refused before any work, by the dry run too; a bind mount on
    the same file system is found in /proc/self/mountinfo (os.path.ismount cannot tell it)."""
    from marlin_convert import outdir

    out = tmp_path / "mnt"
    out.mkdir()
    if how == "ismount":
        real_ismount = os.path.ismount
        monkeypatch.setattr(os.path, "ismount", lambda p: os.path.realpath(p) == str(out) or real_ismount(p))
    else:
        monkeypatch.setattr(outdir, "_mount_points", lambda: {"/", str(out)})
    _run_failing(capsys, tmp_path, [str(src), str(out), *(["--dry-run"] if dry_run else [])],
                 f"OUT_DIR {out} is a mount point")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("exists", [False, True])
def test_out_dir_on_a_read_only_file_system_is_refused_before_any_work(capsys, tmp_path, src, monkeypatch, dry_run,
                                                                        exists):
    """Where the working directory beside OUT_DIR cannot be made (a read-only file system here), the run and its dry
    run stop before any work, naming the directory that cannot be written."""
    place = tmp_path / "ro"
    place.mkdir()
    out = place / "out"
    if exists:
        out.mkdir()
    real_statvfs = os.statvfs

    class _ReadOnly:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return os.ST_RDONLY | self._real.f_flag if name == "f_flag" else getattr(self._real, name)

    monkeypatch.setattr(os, "statvfs", lambda p: _ReadOnly(real_statvfs(p)) if os.path.realpath(p) == str(place)
                        else real_statvfs(p))
    _run_failing(capsys, tmp_path, [str(src), str(out), *(["--dry-run"] if dry_run else [])],
                 f"OUT_DIR {out} cannot be written", f"{place} is on a read-only file system")
    assert sorted(p.name for p in place.iterdir()) == (["out"] if exists else [])


def _killed(*args, **kwargs):
    os.kill(os.getpid(), 9)  # as the kernel's out-of-memory killer ends a process


def _crashed(*args, **kwargs):
    # pytest's faulthandler, inherited by this forked worker, would print a "Fatal Python error: Segmentation fault"
    # dump into the test run's output (written to the terminal, not captured): off in this process only
    faulthandler.disable()
    os.kill(os.getpid(), 11)  # SIGSEGV: as a fault in native code ends a process


# (how the worker ends, what the Error line says, the exit code)
WORKER_ENDS = {"killed": (_killed, ["a worker process ended abruptly"], 2),
               "crashed": (_crashed, ["internal error", "a worker process crashed (SIGSEGV)"], 3)}


@pytest.mark.parametrize("end", list(WORKER_ENDS))
@pytest.mark.parametrize("command", ["convert", "verify"])
def test_a_worker_process_killed_is_named_not_called_a_bug(capsys, tmp_path, src, monkeypatch, command, end):
    """A worker ended by SIGKILL (the out-of-memory killer, on a machine too small for a layer) was 'internal error:
    BrokenProcessPool: ...' with 'this is a bug in marlin-convert', exit 3, for convert and verify alike. One ended by
    SIGSEGV (a fault in native code: the C extension, numpy, torch) is a bug, and was then reported as the kill ("ended
    abruptly (killed: by the system's out-of-memory killer, say)", exit 2), which sent its user after memory: it is
    an internal error naming the signal, exit 3. Nothing is left either way."""
    import marlin_convert.convert as convert_module
    import marlin_convert.verify as verify_module

    ending, fragments, code = WORKER_ENDS[end]
    out = tmp_path / "out"
    if command == "verify":
        assert main([str(src), str(out), "-q"]) == 0
        monkeypatch.setattr(verify_module, "_run", ending)
        args = ["verify", str(out), "--skip-kernel", "--workers", "2"]
    else:
        monkeypatch.setattr(convert_module, "run_job", ending)
        args = [str(src), str(out), "--workers", "2"]
    line = _run_failing(capsys, tmp_path, args, *fragments)
    assert ("internal error" in line) == (end == "crashed") and ("out-of-memory" in line) == (end == "killed")
    assert main(args) == code
    if command == "convert":
        assert not out.exists()


def test_the_crashing_worker_cases_print_no_fault_dump(tmp_path):
    """The cases above whose worker ends by SIGSEGV printed pytest's "Fatal Python error: Segmentation fault" dump
    (the worker's stack) into the test run's output, which read as the test suite itself crashing."""
    env = {key: value for key, value in os.environ.items() if key != "MARLIN_TEST_SHARD"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path),
                           f"{__file__}::test_a_worker_process_killed_is_named_not_called_a_bug", "-k", "crashed"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr
    assert "Fatal Python error" not in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_running_out_of_memory_is_named_not_called_a_bug(capsys, tmp_path, src, monkeypatch, workers):
    """A MemoryError (a machine with overcommit off or a ulimit -v, too small for a layer) was 'internal error:
    MemoryError: ...' and 'this is a bug in marlin-convert', exit 3."""
    import marlin_convert.convert as convert_module

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 1.00 GiB for an array with shape (4096, 65536) and data type int32")

    monkeypatch.setattr(convert_module, "run_job", no_memory)
    out = tmp_path / "out"
    line = _run_failing(capsys, tmp_path, [str(src), str(out), "--workers", workers], "out of memory",
                        "Unable to allocate 1.00 GiB")
    assert "internal error" not in line and "bug" not in capsys.readouterr().err
    assert main([str(src), str(out), "--workers", workers]) == 2
    assert not out.exists()


def test_a_file_system_without_locks_leaves_no_working_directory_and_says_so(capsys, tmp_path, src, monkeypatch):
    """Where flock is not supported (Lustre mounted noflock: ENOSYS; NFS without its lock daemon: ENOLCK) the run said
    it 'cannot create the output's working directory' (it had created it) and left the empty hidden
    .OUT.partial-PID behind, at every run."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "out"
    line = _run_failing(capsys, tmp_path, [str(src), str(out)], "cannot lock the output's working directory",
                        "Function not implemented")
    assert "cannot create" not in line
    assert not out.exists()


def test_output_parent_renamed_while_converting_leaves_no_working_directory(capsys, tmp_path, src, monkeypatch):
    """OUT_DIR's parent renamed while the run worked (folders reorganised during a long conversion): the run failed,
    rightly, but its clean-up removed the working directory by its old path, so the hidden .out.partial-PID, with
    every shard written so far, stayed in the renamed folder for good."""
    import marlin_convert.convert as convert_module

    parent, moved = tmp_path / "parent", tmp_path / "moved"
    parent.mkdir()
    real = convert_module.output_file_digests

    def rename_then_describe(*args, **kwargs):
        parent.rename(moved)
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "output_file_digests", rename_then_describe)
    assert main([str(src), str(parent / "out"), "-q"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(p.name for p in moved.iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_worker_processes_that_cannot_be_started_are_named_not_called_a_bug(capsys, tmp_path, src, monkeypatch,
                                                                            command):
    """fork refused (EAGAIN: the process limit, ulimit -u or a container's pids.max; ENOMEM): verify said 'internal
    error: BlockingIOError ...', exit 3, and convert 'OUT_DIR: cannot write: Resource temporarily unavailable'."""
    import errno

    out = tmp_path / "out"
    if command == "verify":
        assert main([str(src), str(out), "-q"]) == 0

    def no_fork():
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    args = ([str(src), str(out), "--workers", "2"] if command == "convert" else
            ["verify", str(out), "--skip-kernel", "--workers", "2"])
    line = _run_failing(capsys, tmp_path, args, "cannot start worker processes", "Resource temporarily unavailable")
    assert "internal error" not in line and "cannot write" not in line
    assert main(args) == 2


@pytest.mark.parametrize("command", ["convert", "verify", "verify --source"])
def test_threads_that_cannot_be_started_are_named_not_called_a_bug(capsys, tmp_path, src, monkeypatch, command):
    """A thread refused (RuntimeError "can't start new thread": threads count against the process limit, ulimit -u or
    a container's pids.max): the pool's own managing thread in convert and verify, verify --source's comparing thread.
    Each was 'internal error: RuntimeError', exit 3."""
    import threading

    out = tmp_path / "out"
    if command != "convert":
        assert main([str(src), str(out), "-q"]) == 0

    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    args = {"convert": [str(src), str(out), "--workers", "2"],
            "verify": ["verify", str(out), "--skip-kernel", "--workers", "2"],
            "verify --source": ["verify", str(out), "--skip-kernel", "--workers", "1", "--source", str(src)]}[command]
    line = _run_failing(capsys, tmp_path, args, "cannot start", "can't start new thread")
    assert "internal error" not in line
    assert main(args) == 2


def test_a_thread_refused_anywhere_else_is_named_not_called_a_bug(capsys, tmp_path, src, monkeypatch):
    """A thread refused where the library does not start it itself (multiprocessing's queue feeders, which verify's
    GPU staging starts on its first put, in the main thread) reached the CLI as 'internal error: RuntimeError', exit 3.
    The CLI's one place for errors names it: exit 2 and the process-limit hint."""
    import marlin_convert.verify as verify_module

    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0

    def refused(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(verify_module, "_pool", refused)
    args = ["verify", str(out), "--skip-kernel", "--workers", "2"]
    line = _run_failing(capsys, tmp_path, args, "cannot start a thread: can't start new thread")
    assert "internal error" not in line
    assert main(args) == 2
    assert "Hint: the process limit (ulimit -u" in capsys.readouterr().err


# refuses the thread a pool's managing thread starts for its call queue (the queue's feeder) as the system would at the
# process limit; argv: marlin-convert's arguments
_FEEDER_REFUSED = """
import sys, threading
from marlin_convert.cli.app import main
real = threading.Thread.start
def start(self):
    if self.name == "QueueFeederThread":
        raise RuntimeError("can't start new thread")
    return real(self)
threading.Thread.start = start
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_a_thread_the_worker_pool_starts_itself_refused_ends_the_run(tmp_path, src, command):
    """The pool's managing thread starts a thread of its own (its call queue's feeder) on the first item. Refused
    (threads count against the process limit), it ended the managing thread, no item ever reached a worker, and the
    run waited for them for good: convert and verify hung until killed. Now exit 2, naming it, with the
    process-limit hint, and nothing left behind."""
    out = tmp_path / "out"
    if command == "verify":
        assert main([str(src), str(out), "-q"]) == 0
    args = {"convert": [str(src), str(out), "--workers", "2"],
            "verify": ["verify", str(out), "--skip-kernel", "--workers", "2"]}[command]
    proc = subprocess.run([sys.executable, "-c", _FEEDER_REFUSED, *args], capture_output=True, text=True, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "the thread that manages them ended with work pending" in errors[0] and "internal error" not in errors[0]
    assert "ulimit -u" in proc.stderr
    assert "Traceback" not in proc.stderr  # (the managing thread's death: Python's hook printed its traceback)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert (command == "verify") == out.exists()


def test_a_failed_run_leaves_a_parent_that_another_process_created_meanwhile(tmp_path, monkeypatch):
    """PartialDir listed OUT_DIR's missing parents, then made them with mkdir(parents=True, exist_ok=True): one that
    another process created in between (a second run's, the user's mkdir -p) was taken for this run's own, and a
    failing run removed it while it was empty (a second run between its mkdir and its working directory's then
    failed with ENOENT)."""
    from pathlib import Path

    from marlin_convert.outdir import PartialDir

    shared = tmp_path / "shared"
    real_mkdir = os.mkdir

    def raced(path, *args, **kwargs):
        if Path(path) == shared and not shared.exists():
            real_mkdir(path)  # another process got there first
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", raced)
    partial = PartialDir(shared / "mine" / "out")
    assert partial.path.is_dir()
    partial.discard()
    assert shared.is_dir() and not (shared / "mine").exists()
