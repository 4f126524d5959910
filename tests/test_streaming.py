"""Streaming is real: the converter's and verify's peak memory follows the largest tensor, not the shard or the model.

Each conversion runs in a child process whose peak resident set size is read from the OS (wait4's
ru_maxrss, through scripts/peak_rss.py's small launcher). Two checkpoints with the same layer shape, one four times the size of the other, must peak at
about the same RSS, and the peak above a plan-only baseline must stay within a small multiple of the largest
tensor. (Timing figures live in scripts/bench_convert.py, not here.)
"""

from __future__ import annotations

import sys

import pytest
from make_gptq_checkpoint import CheckpointSpec, LinearSpec, TensorSpec, write_checkpoint
from peak_rss import measure

MIB = 1 << 20
K = N = 4096  # qweight of one layer: K/8 * N * 4 bytes = 8 MiB
LARGEST = K // 8 * N * 4


def _peak_rss(code: str) -> int:
    return measure([sys.executable, "-c", code])[1]


def _checkpoint(path, layers: int, shards: int):
    spec = CheckpointSpec(
        linears=[LinearSpec(f"model.layers.{i}.mlp.down_proj", K, N) for i in range(layers)],
        extras=[TensorSpec("model.embed_tokens.weight", (1024, N), "float16")],  # 8 MiB passthrough
        group_size=128,
        shards=shards,
    )
    return write_checkpoint(path, spec)


def _assert_streams(baseline: int, peak_small: int, peak_large: int, model_bytes: int, summed_large: int) -> None:
    """The peaks (bytes) of one command on the small and the large checkpoint, against the bounds of streaming."""
    print(f"baseline {baseline / MIB:.0f} MiB, peak small {peak_small / MIB:.0f} MiB, "
          f"peak large {peak_large / MIB:.0f} MiB, largest tensor {LARGEST / MIB:.0f} MiB, "
          f"large model {model_bytes / MIB:.0f} MiB, summed over processes {summed_large / MIB:.0f} MiB")
    # four times the model, the same peak (within two tensors' worth of allocator noise)
    assert peak_large - peak_small < 2 * LARGEST
    # above the baseline: a few working copies of the largest tensor per worker, far below the model size
    assert peak_large - baseline < 12 * LARGEST
    assert peak_large - baseline < model_bytes / 2
    # all processes together (each worker counted with the parent's RSS it was forked with): still << model
    assert summed_large < 3 * baseline + 24 * LARGEST


@pytest.mark.slow
def test_peak_memory_follows_the_largest_tensor_not_the_model(tmp_path):
    small = _checkpoint(tmp_path / "small", layers=8, shards=1)  # ~66 MiB in one shard
    large = _checkpoint(tmp_path / "large", layers=32, shards=1)  # ~264 MiB in one shard
    convert = ("from pathlib import Path; from marlin_convert.convert import convert; "
               "Path({out!r} + '.rss').write_text(str(convert({src!r}, {out!r}, workers=2).peak_rss_bytes))")
    plan_only = "import marlin_convert.cli.app; from marlin_convert.convert import build_plan; build_plan({src!r})"

    baseline = _peak_rss(plan_only.format(src=str(large)))
    peak_small = _peak_rss(convert.format(src=str(small), out=str(tmp_path / "out-small")))
    peak_large = _peak_rss(convert.format(src=str(large), out=str(tmp_path / "out-large")))
    model_bytes = sum(p.stat().st_size for p in large.glob("*.safetensors"))
    # the OS figure is the largest single process; the converter also sums every process's peak (2 workers)
    summed_large = int((tmp_path / "out-large.rss").read_text())

    _assert_streams(baseline, peak_small, peak_large, model_bytes, summed_large)


@pytest.mark.slow
@pytest.mark.parametrize("with_source", [False, True])
def test_verify_peak_memory_follows_the_largest_tensor_not_the_model(tmp_path, with_source):
    """The same for ``verify --skip-kernel`` (and with ``--source``, which also reads the source's tensors and files):
    each worker holds one slice being rebuilt and hashed, so four times the model must not raise the peak."""
    from marlin_convert.convert import convert

    sources = {name: _checkpoint(tmp_path / f"{name}-in", layers=layers, shards=1)
               for name, layers in (("small", 8), ("large", 32))}
    for name, src in sources.items():
        convert(src, tmp_path / f"{name}-out", workers=1)
    check = ("from pathlib import Path; from marlin_convert.verify import verify; "
             "report = verify(Path({out!r}), gpus=None, workers=2, source_dir={source}); "
             "assert report.ok, report; Path({out!r} + '.rss').write_text(str(report.peak_rss_bytes))")
    plan_only = "import marlin_convert.cli.app; from marlin_convert.manifest import read_manifest"

    def peak(name: str) -> int:
        source = f"Path({str(sources[name])!r})" if with_source else "None"
        return _peak_rss(check.format(out=str(tmp_path / f"{name}-out"), source=source))

    baseline = _peak_rss(plan_only)
    peak_small, peak_large = peak("small"), peak("large")
    model_bytes = sum(p.stat().st_size for p in (tmp_path / "large-out").glob("*.safetensors"))
    summed_large = int((tmp_path / "large-out.rss").read_text())
    _assert_streams(baseline, peak_small, peak_large, model_bytes, summed_large)
