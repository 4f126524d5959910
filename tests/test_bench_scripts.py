"""The benchmark scripts' smoke preset: sizes readable at any scale, no infinite rates, no verdicts on targets
that only the full presets are measured against."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bench_convert import rate_label, ratio_label, size_label, verdict

REPO = Path(__file__).resolve().parent.parent


def test_sizes_rates_and_verdicts_are_printed_with_meaning_at_every_scale():
    assert size_label(454_400) == "454.4 kB" and size_label(3_500_000) == "3.50 MB"
    assert size_label(3_900_000_000) == "3.900 GB"
    assert rate_label(454_400, 0.001) == "n/a (time rounds to 0)" and rate_label(454_400, 0.0) == rate_label(1, 0.001)
    assert rate_label(1_420_000, 1.0) == "1.42 MB/s" and rate_label(620_000_000, 1.0) == "0.620 GB/s"
    assert ratio_label(0.32, 0.0) == "n/a (baseline time rounds to 0)" and ratio_label(3.0, 2.0) == "1.50x"
    assert verdict(True, "llama-7b") == "PASS" and verdict(False, "qwen3-moe") == "MISS"
    assert "PASS" not in verdict(True, "tiny") and "targets apply only to the full presets" in verdict(False, "tiny")


@pytest.mark.parametrize("script, extra", [("bench_convert.py", []), ("bench_verify.py", ["--skip-gpu"])])
def test_the_tiny_preset_prints_no_zero_sizes_no_inf_and_no_pass_or_miss(tmp_path, script, extra):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--preset", "tiny", "--repeat", "1",
                           "--dir", str(tmp_path), *extra], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "0.000 GB" not in text and "inf" not in text.replace("info", ""), text
    assert "PASS" not in text and "MISS" not in text, text
    assert "targets apply only to the full presets" in text, text
