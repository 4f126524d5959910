#!/usr/bin/env python3
"""Benchmark ``marlin-convert verify`` on a generated, converted checkpoint, next to a SHA-256 pass in the same run.

    python scripts/bench_verify.py                        # Llama-7B-shaped (3.9 GB, 4 shards): --skip-kernel,
                                                          # and the kernel check too where a CUDA GPU is visible
    python scripts/bench_verify.py --preset tiny          # seconds, for a smoke run
    python scripts/bench_verify.py --gpu 0 --gpu 0,1      # one GPU, then layers spread over two (same run)
    python scripts/bench_verify.py --profile-gpu 0        # also: where each GPU process's host time goes (cProfile)

The GPTQ checkpoint is generated once into --dir and converted once (both kept between runs, reused when present).
Then, with the converted files in the page cache (one untimed pass reads them first):

1. one single-process SHA-256 pass over every converted file (the baseline of issue #10's target: ``verify
   --skip-kernel`` at most 1.5 times its time);
2. ``verify --skip-kernel`` and, with a GPU, ``verify --gpu ...`` (batches 1, 16, 128), each as a child process
   whose wall time and peak RSS come from the OS (scripts/peak_rss.py), best of --repeat runs.

Printed per run: wall time, GB/s of checkpoint over the whole command and over verify's own work (its time after
start-up, less the kernel load), time per stage (read, inverse + hash summed over the worker processes; upload,
reference and kernel summed over the GPU's timed events) with GB/s, peak RSS (largest process, and summed over
verify's processes) and peak GPU memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_convert import SMOKE_PRESETS, ensure_source, rate_label, ratio_label, size_label, verdict  # noqa: E402
from peak_rss import measure  # noqa: E402

#: issue #10: --skip-kernel at most this many times one single-process SHA-256 pass; the kernel check at least this
TARGET_SHA_RATIO = 1.5
TARGET_GPU_GBPS = 2.0
TARGET_GPU_WALL_SECONDS = 5.0
READ_CHUNK = 16 << 20


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def sha256_pass(directory: Path) -> float:
    """Seconds for one single-process SHA-256 pass over every file of ``directory``."""
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    start = time.perf_counter()
    for path in _files(directory):
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(buffer):
                digest.update(view[:got])
    return time.perf_counter() - start


def _prepare(args) -> Path:
    """The converted checkpoint of ``args.preset`` (generated and converted once, reused when present)."""
    source = ensure_source(args.dir, args.preset, args.shards)
    out = args.dir / f"{args.preset}-marlin"
    marker = args.dir / f"{args.preset}-marlin.complete"
    if not marker.exists() or not out.exists():
        shutil.rmtree(out, ignore_errors=True)
        print(f"converting into {out} ...", flush=True)
        subprocess.run([sys.executable, "-m", "marlin_convert.cli.app", str(source), str(out), "-q"], check=True,
                       stdout=subprocess.DEVNULL)
        marker.write_text("ok")
    return out


def _verify_runs(out: Path, extra: list[str], repeat: int, report: Path) -> list[tuple[float, int, dict]]:
    runs = []
    for _ in range(max(1, repeat)):
        seconds, peak = measure([sys.executable, "-m", "marlin_convert.cli.launch", "verify", str(out), "-q",
                                 "--json", str(report), *extra])
        runs.append((seconds, peak, json.loads(report.read_text())))
    return runs


#: where profiled_checker writes its statistics (set by --profile-gpu; the GPU processes inherit the environment)
PROFILE_ENV = "MARLIN_BENCH_GPU_PROFILE"


def profiled_checker(gpu: int):
    """A GPU process's checker (``marlin_convert.gpu_workers.CHECKER``, for --profile-gpu): the real one, with its
    host work (submit, and the slot polling) under cProfile, the statistics written to ``$MARLIN_BENCH_GPU_PROFILE``
    + ``.gpu<N>`` at finish."""
    import cProfile

    from marlin_convert.gpu_workers import kernel_checker

    make = kernel_checker(gpu)

    def build(slots, setup):
        checker = make(slots, setup)
        profile = cProfile.Profile()
        submit, uploaded, finish = checker.submit, checker.uploaded_slots, checker.finish

        def finish_and_dump():
            results = finish()
            profile.dump_stats(f"{os.environ[PROFILE_ENV]}.gpu{gpu}")
            return results

        checker.submit = lambda *args: profile.runcall(submit, *args)
        checker.uploaded_slots = lambda: profile.runcall(uploaded)
        checker.finish = finish_and_dump
        return checker

    return build


def _profile_gpu(out: Path, gpus: str, workers: int, directory: Path) -> None:
    """One verify in this process, its GPU processes' host work profiled; prints the top functions per GPU."""
    import pstats

    from marlin_convert import gpu_workers
    from marlin_convert.verify import parse_gpus, verify

    os.environ[PROFILE_ENV] = str(directory / "gpu-feed.prof")
    gpu_workers.CHECKER = "bench_verify:profiled_checker"
    report = verify(out, gpus=parse_gpus(gpus), workers=workers)
    print(f"\n== verify --gpu {gpus} in this process, GPU processes profiled: {'ok' if report.ok else 'FAILED'}; "
          f"feed (host) {report.stage_seconds.get('feed (host)', 0.0):.2f} s")
    for gpu in parse_gpus(gpus):
        path = directory / f"gpu-feed.prof.gpu{gpu}"
        print(f"-- GPU {gpu} ({path}): top 30 by own time")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(30)


def _print_run(title: str, runs: list[tuple[float, int, dict]], total: int, sha_seconds: float | None,
               preset: str) -> None:
    seconds, peak, data = min(runs, key=lambda r: r[0])
    stages = data["stage_seconds"]
    own = data["seconds"] - stages.get("kernel load", 0.0)
    print(f"\n== {title}: {'ok' if data['ok'] else 'FAILED'} ({data['layers_checked']} layers/experts, "
          f"{data['files_checked']} files)")
    rows = [("wall time", f"{seconds:.2f} s (best of {len(runs)}: " + ", ".join(f"{r[0]:.2f}" for r in runs)
             + f"), {rate_label(total, seconds)} over the whole command")]
    rows.append(("verify's own work", f"{own:.2f} s, {rate_label(total, own)} (start-up"
                 + (f" and {stages['kernel load']:.2f} s kernel load" if "kernel load" in stages else "")
                 + " excluded)"))
    if sha_seconds is not None:
        ratio = seconds / sha_seconds if sha_seconds else float("inf")
        rows.append(("vs SHA-256 pass", f"{ratio_label(seconds, sha_seconds)} its time (target <= "
                                        f"{TARGET_SHA_RATIO}x): {verdict(ratio <= TARGET_SHA_RATIO, preset)}"))
    else:
        rate = total / own / 1e9 if own > 0 else 0.0
        if preset in SMOKE_PRESETS:
            rows.append(("targets", verdict(True, preset)))
        else:
            rows.append(("targets", f">= {TARGET_GPU_GBPS} GB/s: {verdict(rate >= TARGET_GPU_GBPS, preset)}; "
                                    f"whole command < {TARGET_GPU_WALL_SECONDS:.0f} s: "
                                    f"{verdict(seconds < TARGET_GPU_WALL_SECONDS, preset)}"))
    for stage in ("read", "read + inverse", "hash", "upload", "reference", "kernel", "feed (host)"):
        if stage in stages:
            where = ("summed over workers" if stage in ("read", "read + inverse", "hash") else
                     "host time queuing the GPU work, summed over the GPU processes" if stage == "feed (host)" else
                     "GPU events, summed")
            rows.append((f"stage: {stage}", f"{stages[stage]:.2f} s ({where}), {rate_label(total, stages[stage])}"))
    if data.get("timeline"):
        rows.append(("timeline (s since verify began)",
                     ", ".join(f"{event} {at:+.2f}" for event, at in data["timeline"].items())))
    rows.append(("peak RSS", f"{peak / 2**20:.0f} MiB largest process (OS), {data['peak_rss_bytes'] / 2**20:.0f} MiB "
                             "summed over verify's processes"))
    if data.get("gpu_peak_bytes"):
        rows.append(("peak GPU memory", ", ".join(f"{d}: {b / 2**20:.0f} MiB" for d, b in data["gpu_peak_bytes"].items())))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-7b", choices=["llama-7b", "qwen3-moe", "qwen3-moe-stacked", "tiny"])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "marlin-convert-bench")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--gpu", action="append", default=None,
                        help="GPU list for a kernel run; repeat for several runs (default: 0 when CUDA is visible)")
    parser.add_argument("--skip-gpu", action="store_true", help="only the --skip-kernel run")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--profile-gpu", metavar="GPUS", default=None,
                        help="after the timed runs, one verify --gpu GPUS with each GPU process's host work profiled")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")

    out = _prepare(args)
    total = sum(p.stat().st_size for p in _files(out))
    sha_pass = sha256_pass(out)  # the untimed warm-up read: puts every file in the page cache
    sha_seconds = min(sha256_pass(out) for _ in range(max(1, args.repeat)))
    print(f"checkpoint {out}: {size_label(total)} in {len(_files(out))} files; {os.cpu_count()} cores, "
          f"{args.workers} workers")
    print(f"SHA-256, one process: {sha_seconds:.2f} s, {rate_label(total, sha_seconds)} "
          f"(best of {max(1, args.repeat)}; cold-ish first pass {sha_pass:.2f} s)")
    report = args.dir / "verify-report.json"
    workers = ["--workers", str(args.workers)]
    _print_run("verify --skip-kernel", _verify_runs(out, ["--skip-kernel", *workers], args.repeat, report), total,
               sha_seconds, args.preset)
    gpu_lists = args.gpu
    if gpu_lists is None and not args.skip_gpu:
        try:
            import torch

            gpu_lists = ["0"] if torch.cuda.is_available() else None
        except ImportError:
            gpu_lists = None
    if gpu_lists and not args.skip_gpu:
        for gpu in gpu_lists:
            runs = _verify_runs(out, ["--gpu", gpu, *workers], args.repeat, report)
            _print_run(f"verify --gpu {gpu} (batches 1, 16, 128)", runs, total, None, args.preset)
    else:
        print("\n(no CUDA GPU here: the kernel run is skipped)")
    if args.profile_gpu is not None:
        _profile_gpu(out, args.profile_gpu, args.workers, args.dir)


if __name__ == "__main__":
    main()
