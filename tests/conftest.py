"""Shared test setup: import paths for ``scripts/`` (the checkpoint generator) and ``tests/`` (the references)."""

from __future__ import annotations

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
