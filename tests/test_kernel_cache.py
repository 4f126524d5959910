"""The kernel's build cache: a finished build is imported directly, anything else goes back to the JIT build.

Runs without a GPU: the project's own C extension (``marlin_convert/_repack``) stands in for a built kernel.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from marlin_convert import kernel, layout


def _built_extension() -> Path:
    if layout._repack is None:
        pytest.skip("the C extension is not built here (numpy fallback): nothing to stand in for a kernel build")
    return Path(layout._repack.__file__)


def test_a_finished_build_is_imported_directly(tmp_path):
    shutil.copy(_built_extension(), tmp_path / "_repack.so")
    (tmp_path / kernel.BUILT_MARKER).write_text("_repack\n")
    module = kernel._import_built("_repack", tmp_path)
    assert module is not None and hasattr(module, "gptq_to_marlin")


@pytest.mark.parametrize("marker", [None, "another_build\n", ""])
def test_without_the_marker_of_this_build_the_jit_path_runs(tmp_path, marker):
    shutil.copy(_built_extension(), tmp_path / "_repack.so")
    if marker is not None:
        (tmp_path / kernel.BUILT_MARKER).write_text(marker)
    assert kernel._import_built("_repack", tmp_path) is None


def test_a_marker_without_its_library_or_an_unloadable_one_is_no_build(tmp_path):
    (tmp_path / kernel.BUILT_MARKER).write_text("_repack\n")
    assert kernel._import_built("_repack", tmp_path) is None  # no library
    (tmp_path / "_repack.so").write_bytes(b"not an ELF file")
    assert kernel._import_built("_repack", tmp_path) is None  # ImportError: rebuild


def test_missing_build_folder_is_no_build(tmp_path):
    assert kernel._import_built("marlin_convert_kernel_x", tmp_path / "absent") is None


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_ours_is_exclusive(tmp_path):
    """torch's JIT marks a build folder busy with a "lock" file it removes in a finally; a GPU process killed while
    building leaves it, and every later build would wait forever. Our flock, held by every build, clears it; a
    second holder waits until the first lets go (the kernel drops a flock when its holder dies)."""
    import subprocess
    import sys

    (tmp_path / "lock").write_text("")
    with kernel._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        probe = ("import fcntl, sys\n"
                 f"f = open({str(tmp_path / kernel.BUILD_LOCK)!r}, 'a')\n"
                 "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(7)\n")
        assert subprocess.run([sys.executable, "-c", probe]).returncode == 7  # held: another builder would wait
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0  # released


def test_the_cache_key_covers_the_python_abi(monkeypatch):
    """The extension is a CPython module: a build for another interpreter must not be picked up."""
    first = kernel._build_spec((9, 0))
    real = kernel.sysconfig.get_config_var
    monkeypatch.setattr(kernel.sysconfig, "get_config_var",
                        lambda name: "cpython-399-other" if name == "SOABI" else real(name))
    other = kernel._build_spec((9, 0))
    assert first.key != other.key and first.build_dir != other.build_dir
    assert kernel._build_spec((8, 0)).key != first.key  # and the GPU architecture, as before


def test_a_cached_build_needs_no_compiler(tmp_path, monkeypatch):
    """unavailable_reason: with a finished build in the cache, no nvcc is needed; without one, its absence is the
    reason (the GPU itself is stood in for: this runs without one)."""
    monkeypatch.setenv("MARLIN_CONVERT_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel, "check_environment", lambda device_index=0, build_tools=True: (9, 0))
    monkeypatch.setattr(kernel, "_find_nvcc", lambda: None)
    assert "nvcc" in kernel.unavailable_reason(0)
    spec = kernel._build_spec((9, 0))
    spec.build_dir.mkdir(parents=True)
    (spec.build_dir / f"{spec.name}.so").write_bytes(b"\x7fELF")
    (spec.build_dir / kernel.BUILT_MARKER).write_text(spec.name + "\n")
    module = object()  # a build that loads (the stub library above would not: see the next test)
    monkeypatch.setattr(kernel, "_import_built", lambda name, build_dir: module if name == spec.name else None)
    monkeypatch.setattr(kernel, "_modules", {})
    assert kernel.unavailable_reason(0) is None
    assert kernel._modules[spec.key] is module  # kept, so load_kernel does not initialise the extension twice


def test_a_damaged_cached_build_without_a_compiler_is_a_reason(tmp_path, monkeypatch):
    """A finished build whose library does not load, and no nvcc to rebuild it: the GPU tests skip with that reason
    instead of failing when they load the kernel."""
    monkeypatch.setenv("MARLIN_CONVERT_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel, "check_environment", lambda device_index=0, build_tools=True: (9, 0))
    monkeypatch.setattr(kernel, "_find_nvcc", lambda: None)
    monkeypatch.setattr(kernel, "_modules", {})
    spec = kernel._build_spec((9, 0))
    spec.build_dir.mkdir(parents=True)
    (spec.build_dir / f"{spec.name}.so").write_bytes(b"not an ELF file")
    (spec.build_dir / kernel.BUILT_MARKER).write_text(spec.name + "\n")
    reason = kernel.unavailable_reason(0)
    assert reason is not None and "does not load" in reason and "nvcc" in reason and str(spec.build_dir) in reason


def test_hopper_builds_sm90a_and_newer_gpus_get_portable_ptx(monkeypatch):
    """Compute capability 9.0 is built as sm_90a with the wgmma define; a newer GPU gets sm_90 machine code and
    compute_90 PTX (90a PTX compiles for 9.0 only), also in an all-architectures build; Ampere no define; an 8.x not
    in the list the newest listed 8.y below it."""
    monkeypatch.delenv("MARLIN_CONVERT_ALL_ARCHS", raising=False)
    hopper = kernel._build_spec((9, 0))
    assert hopper.archs == ("90a",)
    assert "-gencode=arch=compute_90a,code=sm_90a" in hopper.cuda_flags and kernel.SM90A_DEFINE in hopper.cuda_flags
    newer = kernel._build_spec((10, 0))
    assert newer.archs == ("90",) and kernel.SM90A_DEFINE not in newer.cuda_flags
    assert "-gencode=arch=compute_90,code=compute_90" in newer.cuda_flags
    ampere = kernel._build_spec((8, 0))
    assert ampere.archs == ("80",) and kernel.SM90A_DEFINE not in ampere.cuda_flags
    orin = kernel._build_spec((8, 7))  # not in the list: the newest supported 8.x below it, never sm_90 code
    assert orin.archs == ("86",) and "-gencode=arch=compute_86,code=compute_86" in orin.cuda_flags
    monkeypatch.setenv("MARLIN_CONVERT_ALL_ARCHS", "1")
    every = kernel._build_spec((10, 0))
    assert every.archs == kernel.SUPPORTED_ARCHS and kernel.SM90A_DEFINE in every.cuda_flags
    assert "-gencode=arch=compute_90,code=compute_90" in every.cuda_flags
    assert not any("code=compute_90a" in flag for flag in every.cuda_flags)


def test_trace_builds_have_their_own_key_and_define(monkeypatch):
    """MARLIN_CONVERT_TRACE=1 (development builds: scripts/trace_kernel.py) adds the trace define to both compilers'
    flags and so to the cache key: a trace build never stands in for the release build, nor the other way round."""
    monkeypatch.delenv("MARLIN_CONVERT_ALL_ARCHS", raising=False)
    monkeypatch.delenv("MARLIN_CONVERT_TRACE", raising=False)
    release = kernel._build_spec((9, 0))
    assert kernel.TRACE_DEFINE not in release.cuda_flags and kernel.TRACE_DEFINE not in release.cxx_flags
    monkeypatch.setenv("MARLIN_CONVERT_TRACE", "1")
    traced = kernel._build_spec((9, 0))
    assert kernel.TRACE_DEFINE in traced.cuda_flags and kernel.TRACE_DEFINE in traced.cxx_flags
    assert traced.key != release.key and traced.build_dir != release.build_dir
