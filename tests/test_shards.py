"""MARLIN_TEST_SHARD=i/n (tests/conftest.py): the shards that scripts/gpu_check.sh runs at once split the selected tests
into disjoint parts that together are all of them; a malformed value stops pytest with a usage error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _collect(shard: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MARLIN_TEST_SHARD"}
    if shard is not None:
        env["MARLIN_TEST_SHARD"] = shard
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                           "tests/test_layout.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _ids(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_partition_the_selected_tests():
    everything = _ids(_collect(None, "-k", "not hypothesis"))
    shards = [_ids(_collect(f"{i}/3", "-k", "not hypothesis")) for i in range(3)]
    assert len(everything) >= 6
    assert sorted(sum(shards, [])) == sorted(everything)  # each selected test in exactly one shard
    assert all(abs(len(part) - len(everything) / 3) < 1 for part in shards)  # round robin: sizes differ by <= 1


def test_malformed_shard_is_a_usage_error():
    for value in ("1", "3/3", "a/b", "-1/2"):
        result = _collect(value)
        assert result.returncode == 4, (value, result.stdout, result.stderr)  # pytest's usage-error status
        assert "MARLIN_TEST_SHARD" in result.stdout + result.stderr
