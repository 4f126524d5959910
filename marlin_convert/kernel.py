"""The bundled CUDA kernel: JIT build, cache, and the Python entry points.

``marlin_gemm(A, B, s, workspace, zp=None, bits=4)`` computes ``C = A @ W`` with ``W = (q - z) * s`` stored in the
Marlin tile format (see ``kernel/README.md`` and ``shared/FORMAT.md``): fp16 or bf16 activations, 4- or 8-bit weights,
symmetric (``z = 2^(bits-1)``) or with zero points. The extension (``kernel/binding.cpp`` + ``kernel/marlin_gemm.cu``)
is compiled on first use with :func:`torch.utils.cpp_extension.load` (the ``kernel/*.cu`` units in parallel, through
ninja) into a cache folder keyed by a hash of every file in ``kernel/``, the compiler flags, the GPU architecture, and
the torch and CUDA versions. Later processes import the finished build directly (a marker file says it is complete),
without torch's JIT machinery or nvcc. Cache root: ``$MARLIN_CONVERT_CACHE`` or ``~/.cache/marlin_convert``.

This module imports nothing heavy at import time: torch is imported inside the functions, so the converter (which
never needs torch) can import the package on machines without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sysconfig
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .errors import KernelError, KernelUnavailableError

#: the kernel sources (every file in this folder is hashed into the cache key)
KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernel"
#: architectures the build flags support; the JIT compiles only the running GPU's one (set
#: ``MARLIN_CONVERT_ALL_ARCHS=1`` to build all four into one binary). Hopper is built as ``90a`` (its
#: architecture-specific features: the wgmma kernels), which runs on compute capability 9.0 only
SUPPORTED_ARCHS = ("80", "86", "89", "90a")
#: defined for the kernel when the build has sm_90a code (kernel/marlin_gemm.cu then may launch the wgmma kernels)
SM90A_DEFINE = "-DMARLIN_CONVERT_SM90A"
#: compiler flags of the build (part of the cache key, with the -gencode flags of the architectures)
CXX_FLAGS = ["-O3", "-std=c++17"]
CUDA_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
#: defined for the kernel and binding when ``MARLIN_CONVERT_TRACE=1`` (development builds: the kernels stamp each
#: block's phases into a buffer, ``scripts/trace_kernel.py``); part of the cache key, so such a build never replaces
#: the release one
TRACE_DEFINE = "-DMARLIN_CONVERT_TRACE"
#: minimum compute capability (mma.sync m16n8k16 with fp32 accumulation, cp.async, ldmatrix)
MIN_CAPABILITY = (8, 0)

_lock = threading.Lock()
_modules: dict[str, object] = {}
_by_device: dict[int, object] = {}  # device index -> module, once checked and loaded (no re-checks per call)


def required_workspace_ints(n: int) -> int:
    """Zeroed int32 workspace the kernel needs for ``n`` output columns: ``(n // 64) * 16`` (FORMAT.md section 4,
    the "vLLM legacy" rule). The kernel rejects a smaller one and leaves it zeroed after every call."""
    return (int(n) // 64) * 16


def gencode_flags(archs=SUPPORTED_ARCHS) -> list[str]:
    """``-gencode`` flags for the given architectures (``"80"`` -> ``-gencode=arch=compute_80,code=sm_80``)."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def _capability_of(arch: str) -> tuple[int, int]:
    """The compute capability an architecture name is for: ``"86"`` -> (8, 6), ``"90a"`` -> (9, 0)."""
    digits = arch.removesuffix("a")
    return int(digits[:-1]), int(digits[-1])


@contextlib.contextmanager
def _arch_list_env(value: str):
    """Set ``TORCH_CUDA_ARCH_LIST`` for the duration of the block only, then restore (or remove) it."""
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous


def kernel_sources() -> list[Path]:
    """The kernel's CUDA translation units (``kernel/*.cu``: the launcher and the kinds, compiled in parallel)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def cache_root() -> Path:
    """Root of the build cache: ``$MARLIN_CONVERT_CACHE`` or ``~/.cache/marlin_convert``."""
    env = os.environ.get("MARLIN_CONVERT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "marlin_convert"


def source_hash() -> str:
    """sha256 over the names and bytes of every file in ``kernel/`` (headers and README included, so any edit
    rebuilds)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in KERNEL_DIR.rglob("*") if p.is_file()):
        digest.update(path.relative_to(KERNEL_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _find_nvcc() -> str | None:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def check_environment(device_index: int = 0, build_tools: bool = True) -> tuple[int, int]:
    """Check what the kernel needs, in order, each with its own message: PyTorch with CUDA, a visible GPU, compute
    capability >= 8.0, and (``build_tools``) nvcc and ninja. Returns the GPU's ``(major, minor)``; raises
    :class:`KernelUnavailableError`."""
    try:
        import torch
    except ImportError as exc:
        raise KernelUnavailableError("PyTorch is not installed, so the GPU kernel cannot run",
                                     hint="install a CUDA build of torch") from exc
    if torch.version.cuda is None or not torch.backends.cuda.is_built():
        raise KernelUnavailableError(
            f"PyTorch {torch.__version__} was built without CUDA, so the kernel cannot run on a GPU",
            hint="install a CUDA build of torch (see pytorch.org)")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise KernelUnavailableError("no CUDA GPU is visible (torch.cuda.is_available() is False)",
                                     hint="check nvidia-smi and CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    if not 0 <= device_index < count:
        raise KernelUnavailableError(f"GPU {device_index} does not exist: {count} GPU(s) visible (0..{count - 1})")
    capability = torch.cuda.get_device_capability(device_index)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device_index)
        raise KernelUnavailableError(
            f"GPU {device_index} ({name}) has compute capability {capability[0]}.{capability[1]}; the Marlin kernel "
            f"needs >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ampere or newer)")
    if build_tools:
        check_build_tools()
    return int(capability[0]), int(capability[1])


def check_build_tools() -> None:
    """nvcc and ninja, which building the kernel needs (a cached build loads without them). Raises
    :class:`KernelUnavailableError`."""
    if _find_nvcc() is None:
        raise KernelUnavailableError("nvcc (CUDA's compiler) was not found; it is needed to build the kernel",
                                     hint="install the CUDA toolkit and put nvcc on PATH, or set CUDA_HOME")
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise KernelUnavailableError("ninja was not found; torch needs it to build the kernel",
                                     hint="pip install ninja")


def unavailable_reason(device_index: int = 0) -> str | None:
    """``None`` when the kernel can be loaded (a finished build in the cache) or built (nvcc, ninja) and run here,
    else the reason (used by the GPU tests to skip). Without the build tools a cached build is loaded here to find
    out (a damaged one cannot be rebuilt); the module is kept for :func:`load_kernel`."""
    try:
        capability = check_environment(device_index, build_tools=False)
        spec = _build_spec(capability)
        if not _is_built(spec.name, spec.build_dir):
            check_build_tools()
        elif spec.key not in _modules:
            try:
                check_build_tools()
            except KernelUnavailableError as exc:
                module = _import_built(spec.name, spec.build_dir)
                if module is None:
                    raise KernelUnavailableError(
                        f"the cached kernel build in {spec.build_dir} does not load, and it cannot be rebuilt here: "
                        f"{exc.message}", exc.hint) from exc
                _modules[spec.key] = module
    except KernelUnavailableError as exc:
        return exc.message
    return None


@dataclass(frozen=True)
class _BuildSpec:
    """One build of the extension: cache key, module name, build folder, target architectures, nvcc and C++
    flags."""

    key: str
    name: str
    build_dir: Path
    archs: tuple[str, ...]
    cuda_flags: list[str] = field(hash=False)
    cxx_flags: list[str] = field(hash=False)


def _build_spec(capability: tuple[int, int]) -> _BuildSpec:
    """What a build for a GPU of this compute capability is: its cache key (sources, architectures, flags, torch
    and CUDA versions, and the Python ABI, since the extension is a CPython module), module name, build folder and
    nvcc flags."""
    import torch

    arch = f"{capability[0]}{capability[1]}"
    capability = tuple(capability)
    if os.environ.get("MARLIN_CONVERT_ALL_ARCHS") == "1":
        archs = SUPPORTED_ARCHS
    else:
        # this GPU's own entry ("90a" for 9.0); else the newest listed one of its major version below it (8.7, a
        # Jetson Orin: sm_86 code, which runs on any 8.x with x >= 6), never an "a" one (that code runs on its own
        # capability only); else, a newer GPU, sm_90
        own = [a for a in SUPPORTED_ARCHS if _capability_of(a) == capability]
        below = [a for a in SUPPORTED_ARCHS if not a.endswith("a") and _capability_of(a)[0] == capability[0]
                 and _capability_of(a)[1] < capability[1]]
        archs = tuple((own or below or ["90"])[-1:])
    flags = gencode_flags(archs) + ([SM90A_DEFINE] if "90a" in archs else [])
    if not any(_capability_of(a) == capability for a in archs):  # PTX for the driver to compile, never an "a" one's
        ptx = archs[-1].removesuffix("a")
        flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    trace = [TRACE_DEFINE] if os.environ.get("MARLIN_CONVERT_TRACE") == "1" else []
    cuda_flags = [*CUDA_FLAGS, *flags, *trace]
    cxx_flags = [*CXX_FLAGS, *trace]
    key_text = "|".join([source_hash(), "sm" + arch, ",".join(archs), torch.__version__, str(torch.version.cuda),
                         str(sysconfig.get_config_var("SOABI")), " ".join(cxx_flags), " ".join(cuda_flags)])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    name = f"marlin_convert_kernel_{key}"
    return _BuildSpec(key, name, cache_root() / f"kernel-{key}", tuple(archs), cuda_flags, cxx_flags)


def _is_built(name: str, build_dir: Path) -> bool:
    """Whether ``build_dir`` holds a finished build of extension ``name``: its marker names it and the library is
    there (whether the library loads is only known by loading it: :func:`_import_built`)."""
    try:
        return (build_dir / BUILT_MARKER).read_text().strip() == name and (build_dir / f"{name}.so").is_file()
    except OSError:
        return False


def _build(capability: tuple[int, int], verbose: bool = False):
    spec = _build_spec(capability)
    key, name, build_dir, archs = spec.key, spec.name, spec.build_dir, spec.archs
    if key in _modules:
        return _modules[key]
    built = _import_built(name, build_dir)
    if built is not None:
        _modules[key] = built
        return built
    check_build_tools()
    from torch.utils import cpp_extension  # only to build: its import (setuptools included) took 0.4 s on the H200

    build_dir.mkdir(parents=True, exist_ok=True)
    arch_list = ";".join(f"{a[0]}.{a[1:]}" for a in archs)
    try:
        with _build_lock(build_dir), _arch_list_env(arch_list):
            built = _import_built(name, build_dir)  # another process may have finished it while we waited
            if built is not None:
                _modules[key] = built
                return built
            module = cpp_extension.load(
                name=name,
                sources=[str(KERNEL_DIR / "binding.cpp"), *(str(p) for p in kernel_sources())],
                extra_cflags=spec.cxx_flags,
                extra_cuda_cflags=spec.cuda_flags,
                extra_include_paths=[str(KERNEL_DIR)],
                build_directory=str(build_dir),
                verbose=verbose,
            )
            (build_dir / BUILT_MARKER).write_text(name + "\n")  # written last: the .so beside it is complete
    except Exception as exc:  # compiler output is in the exception text; keep its end
        text = str(exc)
        raise KernelUnavailableError(
            f"building the kernel failed (build folder {build_dir}): {text[-2000:]}",
            hint="run with MARLIN_CONVERT_VERBOSE_BUILD=1 for the full compiler output") from exc
    _modules[key] = module
    return module


#: file written into a build folder once its extension built and loaded (the fast path imports only then)
BUILT_MARKER = "built"
#: our lock file in a build folder (torch's own is "lock", see _build_lock)
BUILD_LOCK = "marlin-convert.lock"


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an exclusive ``flock`` on the build folder while building in it. torch's JIT build marks a folder busy
    with a plain file ("lock") that it removes in a ``finally``: a build killed with SIGKILL (verify's GPU process
    when its parent stops it, or dies) leaves that file behind, and every later build would wait for it forever.
    Every build of this folder holds this lock first, so a "lock" file found while holding it is such a leftover,
    and is removed. The kernel releases a flock when its holder dies, whatever the way."""
    import fcntl

    with open(build_dir / BUILD_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import_built(name: str, build_dir: Path):
    """The extension module of a finished earlier build in ``build_dir`` (its marker names it), imported directly,
    or None. Skips torch's JIT machinery (ninja file, ninja run: about a second per process), which an unchanged
    build does not need: the cache key already covers the sources, flags' inputs, GPU architecture and torch."""
    import importlib.util

    if not _is_built(name, build_dir):
        return None
    spec = importlib.util.spec_from_file_location(name, build_dir / f"{name}.so")
    if spec is None or spec.loader is None:
        return None
    try:  # an extension is loaded (dlopen) by module_from_spec and initialised by exec_module
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:  # a damaged file, or a torch upgraded in place: rebuild through the JIT path
        return None
    return module


def load_kernel(device_index: int = 0, verbose: bool | None = None):
    """Check the environment, then build (first time) or load (cached) the extension module for this GPU."""
    module = _by_device.get(device_index)
    if module is not None:
        return module
    capability = check_environment(device_index, build_tools=False)  # nvcc / ninja only if it must be built
    if verbose is None:
        verbose = os.environ.get("MARLIN_CONVERT_VERBOSE_BUILD") == "1"
    with _lock:
        module = _build(capability, verbose)
        _by_device[device_index] = module
        return module


def ensure_kernel(device_index: int = 0):
    """Make sure the kernel runs on GPU ``device_index`` (building it if needed); returns that ``torch.device``.
    Raises :class:`KernelUnavailableError` with the reason when it cannot."""
    import torch

    load_kernel(device_index)
    return torch.device("cuda", device_index)


def marlin_gemm(A, B, s, workspace, perm=None, out=None, split_k: int = 0, *, zp=None, bits: int = 4):
    """``C = A[:, perm] @ W`` on the GPU, with ``W[k, n] = (q[k, n] - z[g, n]) * s[g, n]`` (``g`` the group of row
    ``k``), fp32 accumulation; ``z = 2^(bits-1)`` (8 or 128) when ``zp`` is None.

    Arguments (all on the same CUDA device; ``p = 32 / bits`` values per int32 word):

    - ``A``: float16 or bfloat16 ``[m, k]``, rows dense (contiguous); any ``m >= 1`` (``m == 0`` returns an empty
      result).
    - ``B``: int32 ``[k / 16, n * bits / 2]`` (``2 n`` for 4-bit, ``4 n`` for 8-bit), Marlin tiles (FORMAT.md sections 2
      and 7); ``k % 16 == 0``, ``n % 64 == 0``. Rows must be dense, so a slice ``stacked[e]`` of a contiguous
      ``[E, k / 16, ...]`` expert buffer works in place.
    - ``s``: ``A``'s dtype, ``[k / g, n]``, scales permuted for Marlin (FORMAT.md section 3); the group size is
      ``g = k / s.shape[0]`` (a multiple of 16); one row means channelwise (``g = k``, channelwise table).
    - ``workspace``: int32, zeroed, at least :func:`required_workspace_ints` ``(n)`` elements; left zeroed.
    - ``perm``: optional int32 ``[k]`` (act-order): the activations' columns are gathered as ``A[:, perm]`` first.
    - ``out``: optional ``[m, n]`` contiguous output buffer of ``A``'s dtype (every element is written), sharing no
      memory with the other arguments.
    - ``split_k``: 0 chooses the split over k automatically; ``> 0`` caps it (benchmarks and tests).
    - ``zp``: optional int32 ``[k / g, n / p]``: the true zero points in the Marlin order (FORMAT.md section 7
      "Asymmetric", ``layout.marlin_zero_points``), one row per scale row; None for a symmetric layer.
    - ``bits``: 4 or 8, the weight width.

    Returns ``C`` ``[m, n]`` in ``A``'s dtype (``out`` when given). Raises :class:`KernelError` when the arguments
    break a limit (the message names the values) and :class:`KernelUnavailableError` when the kernel cannot run here.
    """
    import torch

    if not isinstance(A, torch.Tensor) or not A.is_cuda:
        where = A.device if isinstance(A, torch.Tensor) else type(A).__name__
        raise KernelError(f"marlin_gemm: A must be a CUDA tensor, got {where}")
    module = load_kernel(A.device.index if A.device.index is not None else torch.cuda.current_device())
    try:
        return module.marlin_gemm(A, B, s, workspace, perm, out, int(split_k), zp, int(bits))
    except (RuntimeError, TypeError, ValueError) as exc:
        message = str(exc).split("\nException raised from", 1)[0].strip()
        raise KernelError(message) from exc
