"""Shared test setup: import paths for ``scripts/`` (the checkpoint generator) and ``tests/`` (the references), and
``MARLIN_TEST_SHARD=i/n``: run only every n-th selected test from the i-th on (``scripts/gpu_check.sh`` runs the GPU
tests as several such processes at once on one GPU)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "scripts", REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer tiny Llama GPTQ checkpoint (group size 64, 2 shards), written once per session. Read-only:
    tests that modify a checkpoint must write their own."""
    from make_gptq_checkpoint import tiny_llama, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-gptq"), tiny_llama(num_layers=2, group_size=64, shards=2))


@pytest.hookimpl(trylast=True)  # (after -m / -k have deselected theirs: the shards split what is left)
def pytest_collection_modifyitems(config, items):
    """MARLIN_TEST_SHARD=i/n (0 <= i < n): keep the selected tests whose position modulo n is i, so that n processes
    with i = 0 .. n - 1 run every selected test exactly once (round robin: a test's parametrized cases spread over all
    shards)."""
    shard = os.environ.get("MARLIN_TEST_SHARD", "")
    if not shard:
        return
    match = re.fullmatch(r"(\d+)/(\d+)", shard)
    if match is None or not int(match.group(1)) < int(match.group(2)):
        raise pytest.UsageError(f"MARLIN_TEST_SHARD={shard!r}: expected i/n with 0 <= i < n, e.g. 0/3")
    index, count = int(match.group(1)), int(match.group(2))
    kept = [item for position, item in enumerate(items) if position % count == index]
    dropped = [item for position, item in enumerate(items) if position % count != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
