"""Bad input: one test each. Every case exits non-zero with one ``Error:`` line naming the file, tensor and
reason, prints no traceback, and leaves nothing at OUT_DIR (nor a temporary directory beside it)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from make_gptq_checkpoint import CheckpointSpec, LinearSpec, TensorSpec, tiny_llama, write_checkpoint
from safetensors.numpy import save_file

from marlin_convert.cli.app import main
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
    config = json.loads((src / "quantize_config.json").read_text())
    config["group_size"] = 96  # valid for K = 256 (groups of 96, 96, 64: 3 rows), but the scales have 4 rows
    (src / "quantize_config.json").write_text(json.dumps(config))
    _convert_fails(capsys, tmp_path, src, f"{LAYER}.scales", "has 4 rows: that is group size 64 for K = 256",
                   "config says group size 96 (3 rows)")


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
    _run_failing(capsys, tmp_path, [str(src), str(out)], "is not empty")
    assert (out / "precious.txt").read_text() == "keep me"
    assert main([str(src), str(out), "--overwrite", "-q"]) == 0
    assert not (out / "precious.txt").exists() and (out / "marlin_manifest.json").exists()


def test_out_dir_inside_in_dir(capsys, tmp_path, src):
    _run_failing(capsys, tmp_path, [str(src), str(src / "converted")], "inside")
    assert not (src / "converted").exists()


def test_out_dir_equal_to_in_dir(capsys, tmp_path, src):
    _run_failing(capsys, tmp_path, [str(src), str(src), "--overwrite"], "inside (or equal to)")
    assert (src / "model.safetensors").exists()


def test_unwritable_out_dir(capsys, tmp_path, src):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    _run_failing(capsys, tmp_path, [str(src), str(blocker / "out")], "cannot create the output directory")


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


def test_too_little_free_space_is_refused_before_writing(capsys, tmp_path, src, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 10 ** 9 - 1000, 1000))
    _convert_fails(capsys, tmp_path, src, "not enough disk space", "1000 are free")


def test_unsupported_layer_without_skip_names_layer_and_reason(capsys, tmp_path):
    src = write_checkpoint(tmp_path / "in", _spec(bits=2))
    line = _convert_fails(capsys, tmp_path, src, LAYER, "2-bit")
    assert "cannot be converted" in line
