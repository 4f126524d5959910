#!/usr/bin/env python3
"""Benchmark the converter on a generated checkpoint: throughput, the same-run `cp -r` baseline, peak RSS.

    python scripts/bench_convert.py                      # Llama-7B-shaped, ~3.9 GB, 4 shards
    python scripts/bench_convert.py --preset qwen3-moe   # Qwen3-30B-A3B-shaped MoE slice (128 experts)
    python scripts/bench_convert.py --preset many-experts  # 16 layers x 256 experts of small matrices, 72 MB
    python scripts/bench_convert.py --preset tiny        # seconds, for a smoke run

The checkpoint is generated once into --dir (kept between runs). Both the copy and the conversion run with
the source in the page cache (the copy runs first and warms it) and after an fsync of everything before it,
each as a child process whose peak resident set size is read from the OS (wait4's ru_maxrss, through
scripts/peak_rss.py's small launcher). The plan alone is timed too, as ``--dry-run`` (configs and headers read, every
layer checked with its g_idx and qzeros read, every output tensor declared): with many-experts' 12,352 small layers it
is a large part of the run, which is bound by work per layer, not per byte (it misses the throughput target). Targets
(issue #2): at least 0.5 GB/s on a 2-core machine, and peak RSS at most twice the largest tensor plus 400 MB. They
apply to the full presets: the tiny preset is a smoke run, printed without PASS / MISS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

import make_gptq_checkpoint as gen  # noqa: E402
from peak_rss import measure  # noqa: E402

from marlin_convert.safetensors_io import read_header  # noqa: E402

TARGET_GBPS = 0.5
RSS_ALLOWANCE_BYTES = 400 << 20
#: presets too small for the targets to mean anything (start-up dominates): no PASS / MISS for them
SMOKE_PRESETS = {"tiny"}
#: times are printed to 0.01 s: a rate or ratio over a time below this would divide by what reads as 0
SHORTEST_SECONDS = 0.005


def size_label(nbytes: float) -> str:
    """Decimal units with enough precision for any size: GB from 1 GB, MB from 1 MB, else kB."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.3f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / 1e3:.1f} kB"


def rate_label(nbytes: float, seconds: float) -> str:
    """``nbytes`` over ``seconds`` in GB/s (MB/s below 0.1 GB/s), or "n/a" when the time prints as 0.00 s."""
    if seconds < SHORTEST_SECONDS:
        return "n/a (time rounds to 0)"
    rate = nbytes / seconds
    return f"{rate / 1e9:.3f} GB/s" if rate >= 1e8 else f"{rate / 1e6:.2f} MB/s"


def ratio_label(seconds: float, baseline: float) -> str:
    """``seconds / baseline`` as "1.23x", or "n/a" when the baseline prints as 0.00 s."""
    return "n/a (baseline time rounds to 0)" if baseline < SHORTEST_SECONDS else f"{seconds / baseline:.2f}x"


def verdict(ok: bool, preset: str) -> str:
    """PASS or MISS against a target, or, for a smoke preset, that the targets are for the full presets."""
    if preset in SMOKE_PRESETS:
        return f"(no verdict: targets apply only to the full presets, not {preset})"
    return "PASS" if ok else "MISS"


def _preset(name: str, shards: int):
    if name == "llama-7b":
        return gen.llama_7b(shards=shards)
    if name == "qwen3-moe":
        return gen.qwen3_moe(num_layers=4, num_experts=128, hidden=2048, expert_intermediate=768, shards=shards)
    if name == "qwen3-moe-stacked":
        return gen.qwen3_moe(num_layers=4, num_experts=128, hidden=2048, expert_intermediate=768, stacked=True,
                             shards=shards)
    if name == "many-experts":  # tens of thousands of small layers: what planning costs per layer
        return gen.qwen3_moe(num_layers=16, num_experts=256, hidden=128, expert_intermediate=64, group_size=64,
                             shards=shards)
    return gen.tiny_llama(num_layers=2, shards=shards)


def ensure_source(directory: Path, preset: str, shards: int) -> Path:
    """The generated GPTQ checkpoint ``directory/<preset>-gptq``, written on first use and reused after."""
    source = directory / f"{preset}-gptq"
    marker = source / ".complete"
    if not marker.exists():
        shutil.rmtree(source, ignore_errors=True)
        print(f"generating {preset} checkpoint in {source} ...", flush=True)
        # in a child process, so that this process stays small (see scripts/peak_rss.py)
        code = (f"import sys; sys.path[:0] = [{str(REPO / 'scripts')!r}, {str(REPO)!r}]; import bench_convert as b, "
                f"make_gptq_checkpoint as gen; gen.write_checkpoint({str(source)!r}, b._preset({preset!r}, "
                f"{shards}))")
        subprocess.run([sys.executable, "-c", code], check=True)
        marker.write_text("ok")
    return source


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-7b",
                        choices=["llama-7b", "qwen3-moe", "qwen3-moe-stacked", "many-experts", "tiny"])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "marlin-convert-bench")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="conversions to time; the best is reported")
    parser.add_argument("--keep", action="store_true", help="keep the converted output")
    parser.add_argument("--stack-experts", action="store_true", help="convert with --stack-experts")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")  # time this checkout

    source = ensure_source(args.dir, args.preset, args.shards)
    total = _dir_bytes(source)
    largest = max(info.nbytes for p in source.glob("*.safetensors") for info in read_header(p).tensors.values())

    copy_dir, out_dir = args.dir / "copy", args.dir / "out"
    stack = ["--stack-experts"] if args.stack_experts else []
    cp_seconds = []
    for _ in range(2):  # the first copy warms the page cache for everything after it
        shutil.rmtree(copy_dir, ignore_errors=True)
        os.sync()  # start each timed run with no dirty pages of the previous one still being written back
        seconds, _ = measure(["cp", "-r", str(source), str(copy_dir)])
        cp_seconds.append(seconds)
    shutil.rmtree(copy_dir, ignore_errors=True)

    runs, summed_peaks = [], []
    report_path = args.dir / "report.json"
    for _ in range(max(1, args.repeat)):
        shutil.rmtree(out_dir, ignore_errors=True)
        os.sync()
        runs.append(measure([sys.executable, "-m", "marlin_convert.cli.app", str(source), str(out_dir), "-q",
                             "--workers", str(args.workers), "--json", str(report_path), *stack]))
        summed_peaks.append(json.loads(report_path.read_text())["peak_rss_bytes"])
    out_bytes = _dir_bytes(out_dir)
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    plan_seconds, plan_dir = [], args.dir / "plan"  # (a dry run writes nothing: an OUT_DIR that does not exist)
    for _ in range(max(1, args.repeat)):
        plan_seconds.append(measure([sys.executable, "-m", "marlin_convert.cli.app", str(source), str(plan_dir), "-q",
                                     "--dry-run", *stack])[0])

    convert_seconds = min(r[0] for r in runs)
    peak_rss = max(r[1] for r in runs)
    summed_peak = max(summed_peaks)
    rss_limit = 2 * largest + RSS_ALLOWANCE_BYTES
    gbps = total / convert_seconds / 1e9
    cp_best = min(cp_seconds[1:])
    rows = [
        ("preset", args.preset + (" --stack-experts" if args.stack_experts else "")),
        ("checkpoint", f"{size_label(total)} in {len(list(source.glob('*.safetensors')))} shard(s), "
                       f"out {size_label(out_bytes)}"),
        ("cores / workers", f"{os.cpu_count()} / {args.workers}"),
        ("convert wall time", f"{convert_seconds:.2f} s (best of {len(runs)}: "
                              + ", ".join(f"{r[0]:.2f}" for r in runs) + ")"),
        ("throughput", f"{rate_label(total, convert_seconds)} (target >= {TARGET_GBPS} GB/s) "
                       f"{verdict(gbps >= TARGET_GBPS, args.preset)}"),
        ("plan (--dry-run)", f"{min(plan_seconds):.2f} s (best of {len(plan_seconds)}: "
                             + ", ".join(f"{t:.2f}" for t in plan_seconds) + ")"),
        ("cp -r wall time", f"{cp_best:.2f} s (warm cache; cold first copy {cp_seconds[0]:.2f} s)"),
        ("convert / cp -r", f"{ratio_label(convert_seconds, cp_best)} the time of a plain copy"),
        ("largest tensor", f"{largest / 2**20:.1f} MiB"),
        ("peak RSS", f"{peak_rss / 2**20:.1f} MiB largest process (OS), {summed_peak / 2**20:.1f} MiB summed over the "
                     f"main process and {args.workers} workers; limit 2 x largest + 400 MiB = "
                     f"{rss_limit / 2**20:.1f} MiB: {verdict(summed_peak <= rss_limit, args.preset)}"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
