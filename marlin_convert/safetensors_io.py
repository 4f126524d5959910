"""Safetensors I/O, one tensor at a time.

Reading: :func:`read_header` parses and checks a file's header without touching the data; :func:`read_tensor`
reads one tensor's bytes with a single positioned read into a fresh numpy array, through a fresh checked open of its
file or, for many small reads (planning's, a conversion worker's batch of jobs), through :class:`HeldShards`, which
opens each file once.

Writing: :class:`ShardWriter` is told every tensor's name, dtype and shape up front, writes the header first,
and then takes the tensors in any order at their known offsets (positioned writes), so several threads can
fill one file and nothing larger than one tensor is ever held. Tensors that pass through unchanged are copied
file-to-file through one small buffer and hashed on the way (:mod:`marlin_convert.fileio`).

File layout (the safetensors format): 8-byte little-endian header length ``L``; ``L`` bytes of JSON mapping each
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data start) plus an
optional ``"__metadata__"`` string map; then the data.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import strict_json
from .errors import InputError, OutputError
from .fileio import SourceReadError, copy_hashing, digest_text, open_inside

#: safetensors dtype name -> numpy dtype used to hold the raw bytes (bfloat16 is kept as its uint16 bits)
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "U64": np.dtype("<u8"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
}
#: bits per element of every dtype the safetensors format defines (the reference implementation's list, 0.8): a
#: tensor's data is elements x bits / 8 bytes, a whole number (the 4- and 6-bit types pack). Tensors of the dtypes
#: without a NUMPY_DTYPES entry are copied byte for byte but never read as arrays (no quantized tensor has them).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
#: the short names people use for the same dtypes (config files, the manifest)
DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16",
               "I32": "int32", "I64": "int64", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
               "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
               "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F4": "float4_e2m1",
               "F6_E2M3": "float6_e2m3", "F6_E3M2": "float6_e3m2", "C64": "complex64"}

#: the ``__metadata__`` of every shard the converter writes (loaders read its ``format``; ``verify`` checks it)
SHARD_METADATA = {"format": "pt"}

#: a header larger than this is not a plausible safetensors header (the reference implementation uses 100 MB)
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``dtype`` is the safetensors name ("F16", "I32", ...), offsets are absolute."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class SafetensorsFile:
    """A parsed safetensors header. ``tensors`` keeps the file's data order (by offset). ``identity``: the file's
    device, inode, size, modification and status-change times (ns) when the header was read: every later read
    checks the file it opens against it (:func:`open_as_read`), and :func:`changed_since_read` the path."""

    path: Path
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    identity: tuple[int, int, int, int, int] | None = None

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_header(path: Path) -> SafetensorsFile:
    """Parse and check ``path``'s header as strictly as the reference safetensors library does.

    Checked: the length prefix fits the file and is at most :data:`MAX_HEADER_BYTES`; the header is one UTF-8 JSON
    object with no repeated key; ``__metadata__``, if present, maps strings to strings; every other entry has a
    known ``dtype``, a ``shape``
    of non-negative integers whose product fits 64 bits, and ``data_offsets`` of two integers whose span is the
    shape's byte size; sorted by offset, the tensors follow each other with no gap and no overlap and end
    exactly where the file does (a shorter file is a truncated download). Raises :class:`InputError` naming the
    file (and tensor) on the first inconsistency. Reads the header only.
    """
    path = Path(path)
    try:
        if not path.is_file():  # a FIFO would block, a device never end
            raise InputError(f"{path}: not a regular file")
        with open(open_inside(path), "rb") as f:
            identity = _identity(os.fstat(f.fileno()))
            size = identity[2]
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InputError(f"{path}: corrupt safetensors file: only {size} bytes, no header")
            (header_len,) = struct.unpack("<Q", prefix)
            if 8 + header_len > size:
                raise InputError(f"{path}: corrupt safetensors header: its length prefix does not fit a "
                                 f"{size}-byte file (not a safetensors file?)")
            if header_len > MAX_HEADER_BYTES:
                raise InputError(f"{path}: safetensors header of {header_len} bytes, more than the "
                                 f"{MAX_HEADER_BYTES} this tool reads (not a checkpoint's header?)")
            raw = f.read(header_len)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        header = strict_json.loads(raw)
    except ValueError as exc:
        raise InputError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")

    data_start = 8 + header_len
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{path}: corrupt safetensors header: '__metadata__' must map strings to strings")
    tensors = sorted((_tensor_info(path, name, entry, data_start) for name, entry in header.items()),
                     key=lambda t: (t.begin, t.end))
    _check_data_layout(path, tensors, data_start, size)
    return SafetensorsFile(path, data_start, {t.name: t for t in tensors}, metadata, identity)


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _what_changed(then: tuple, now: tuple) -> str | None:
    if now == then:
        return None
    if now[:2] != then[:2]:
        return "another file is now at its path"
    if now[2] != then[2]:
        return f"its size went from {then[2]} to {now[2]} bytes"
    return "it was written to, or its times were reset (its modification or status-change time moved)"


def changed_since_read(file: SafetensorsFile) -> str | None:
    """What changed about the file at ``file``'s path since :func:`read_header` read it (another file there, its
    size, its times), or None: a conversion whose source changed under it used bytes the checks never saw."""
    try:
        now = _identity(os.stat(file.path))
    except OSError as exc:
        return f"it can no longer be read: {exc.strerror or exc}"
    return None if file.identity is None else _what_changed(file.identity, now)


def _check_opened(fd: int, path: Path, identity: tuple | None, held: bool = False) -> None:
    """Raise :class:`InputError` when the file open on ``fd`` is not, or is no longer, the one whose header was read
    (``identity``; None: no check). ``held``: ``fd`` was opened earlier (:class:`HeldShards`), so the file may have
    been replaced at ``path`` since (its status-change time moves when it is renamed or unlinked): where another file
    is at ``path`` now, or none, the error says so rather than that the file was written to."""
    changed = None if identity is None else _what_changed(identity, _identity(os.fstat(fd)))
    if changed is not None and held:
        try:
            now = _identity(os.stat(path))
        except OSError as exc:
            changed = f"it can no longer be read at its path: {exc.strerror or exc}"
        else:
            if now[:2] != identity[:2]:
                changed = _what_changed(identity, now)  # (another file is now at its path)
    if changed is not None:
        raise InputError(f"{path}: changed since its header was read: {changed}",
                         hint="convert again once nothing writes to IN_DIR")


def open_as_read(path: Path, identity: tuple | None) -> int:
    """Open ``path`` (:func:`~marlin_convert.fileio.open_inside`) and check that the file opened is the one whose
    header was read (``identity``, :attr:`SafetensorsFile.identity`; None: no check). Raises OSError from the open,
    :class:`InputError` when the file is another or has changed."""
    fd = open_inside(path)
    try:
        _check_opened(fd, path, identity)
    except BaseException:
        os.close(fd)
        raise
    return fd


class HeldShards:
    """Shards kept open across many small reads, each opened once rather than once per tensor: planning reads every
    layer's g_idx and qzeros, 24,704 tensors of 4 shards for 16 layers of 256 experts, and one checked open costs
    more than such a read; each conversion worker holds its own for a batch of jobs (opened after the fork). At most
    ``limit`` descriptors at a time (the one read least recently is closed first, and opened again if it is needed
    again; fewer where the process runs out of descriptors); a context manager that closes them all.

    The checks stay those of a fresh open: each shard is opened by :func:`open_as_read` (a regular file inside its
    directory, the one whose header was read), and before every read the open file is held to that header's
    identity again (``fstat``: size, modification and status-change times), so a shard written to while held is
    refused at its next read. A shard renamed over, moved away or unlinked is refused too: its status-change time
    moves with the rename or unlink, and the error then says what is at the path now. The check before publishing
    (:func:`changed_since_read`) looks at the path once more after the last read."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._fds: dict[tuple, int] = {}  # (path, identity) -> descriptor, least recently read first

    def descriptor(self, file: SafetensorsFile) -> int:
        """A descriptor of ``file``'s shard, checked as :func:`open_as_read` checks a fresh one. Raises OSError from
        the open, :class:`InputError` when the file is another or has changed."""
        key = (file.path, file.identity)
        fd = self._fds.pop(key, None)
        if fd is None:
            fd = self.open_beside(file.path, file.identity)
        else:
            try:
                _check_opened(fd, file.path, file.identity, held=True)
            except BaseException:
                os.close(fd)
                raise
        self._fds[key] = fd  # (re-inserted: now the most recently read)
        return fd

    def open_beside(self, path: Path, identity: tuple | None) -> int:
        """:func:`open_as_read` of ``path``, for this object to hold or for a caller's own use beside it (a copy
        job's). Where the process's descriptors run out (EMFILE, ENFILE: a low ``ulimit -n``), the held ones give
        way, least recently read first, and the limit comes down to what fits: planning and a conversion worker's
        batch then need no more descriptors than one open per read did."""
        while True:
            while len(self._fds) >= self.limit:
                os.close(self._fds.pop(next(iter(self._fds))))
            try:
                return open_as_read(path, identity)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._fds:
                    raise
                # one fewer than were held when the open failed, with the new one: a descriptor to spare
                self.limit = max(1, len(self._fds) - 1)

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> HeldShards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_count(value: object) -> bool:
    """A JSON integer >= 0 that fits 64 bits (bool and float are not integers here)."""
    return type(value) is int and 0 <= value < 1 << 64


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    def corrupt(reason: str) -> InputError:
        return InputError(f"{path}: corrupt safetensors header: tensor '{name}' {reason}")

    if not isinstance(entry, dict):
        raise corrupt(f"is described by a JSON {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise corrupt("has no dtype" if dtype is None else
                      f"has dtype {json.dumps(dtype)}, not a safetensors dtype ({', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise corrupt(f"has shape {json.dumps(shape)}: expected a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise corrupt(f"has data_offsets {json.dumps(offsets)}: expected two non-negative integers")
    elements = 1
    for dim in shape:
        elements *= dim
        if elements >= 1 << 64:
            raise corrupt(f"has shape {shape}: more elements than 64 bits count")
    begin, end = offsets
    if elements * DTYPE_BITS[dtype] % 8:
        raise corrupt(f"{dtype}{shape} has {elements} elements of {DTYPE_BITS[dtype]} bits: not a whole number of "
                      "bytes")
    expected = elements * DTYPE_BITS[dtype] // 8
    if end < begin or end - begin != expected:
        raise corrupt(f"{dtype}{shape} needs {expected} bytes but its offsets [{begin}, {end}] span {end - begin}")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_data_layout(path: Path, tensors: list[TensorInfo], data_start: int, size: int) -> None:
    """``tensors`` (sorted by offset) must tile the data section exactly: no gap, no overlap, nothing after."""
    position, previous = data_start, None
    for info in tensors:
        if info.begin < position:
            raise InputError(f"{path}: corrupt safetensors header: tensor '{info.name}' overlaps tensor "
                             f"'{previous}' (bytes {info.begin - data_start}..{position - data_start} of the data)")
        if info.begin > position:
            raise InputError(f"{path}: corrupt safetensors header: {info.begin - position} bytes before tensor "
                             f"'{info.name}' belong to no tensor")
        position, previous = info.end, info.name
    if position > size:
        raise InputError(
            f"{path}: truncated: tensor '{previous}' ends at byte {position} but the file has {size} bytes",
            hint="re-download or re-copy this shard",
        )
    if position < size:
        raise InputError(f"{path}: corrupt safetensors file: {size - position} bytes after the last tensor belong "
                         "to no tensor")


def read_tensor(file: SafetensorsFile, name: str, index: int | None = None,
                held: HeldShards | None = None) -> np.ndarray:
    """Read tensor ``name`` of ``file`` into a new numpy array (bfloat16 as uint16 bits).

    With ``index``, read only the slice ``tensor[index]`` along the leading dimension (one expert of a
    stacked tensor), so memory holds one slice rather than the whole tensor. With ``held``, through its descriptor of
    the shard (opened once for many reads), else through a fresh :func:`open_as_read`.
    """
    info = file.tensors[name]
    if info.dtype not in NUMPY_DTYPES:  # (callers check a tensor's dtype before they read it)
        raise InputError(f"{file.path}: tensor '{name}' has dtype {info.dtype}, which marlin-convert copies but does "
                         "not read")
    shape, begin, nbytes = info.shape, info.begin, info.nbytes
    if index is not None:
        if not 0 <= index < shape[0]:
            raise IndexError(f"tensor '{name}' has {shape[0]} slices, asked for {index}")
        nbytes //= shape[0]
        shape, begin = shape[1:], begin + index * nbytes
    out = np.empty(shape, dtype=NUMPY_DTYPES[info.dtype])
    buffer = memoryview(out.reshape(-1).view(np.uint8))
    try:
        if held is not None:
            _read_exactly(held.descriptor(file), buffer, begin, file.path, name)
        else:
            with open(open_as_read(file.path, file.identity), "rb", buffering=0) as f:
                _read_exactly(f.fileno(), buffer, begin, file.path, name)
    except OSError as exc:
        raise InputError(f"{file.path}: cannot read tensor '{name}': {exc.strerror or exc}") from exc
    return out


def _read_exactly(fd: int, buffer: memoryview, begin: int, path: Path, name: str) -> None:
    """Fill ``buffer`` from ``fd`` at offset ``begin`` (positioned reads). Raises OSError, :class:`InputError` where
    the file ends first."""
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], begin + done)
        if got == 0:
            raise InputError(f"{path}: truncated while reading tensor '{name}'")
        done += got


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor a writer will hold: safetensors ``dtype`` name and ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


def _os_error(path: Path, exc: OSError) -> OutputError:
    if exc.errno == 28:  # ENOSPC
        return OutputError(f"{path}: no space left on device", hint="free disk space or choose another OUT_DIR")
    return OutputError(f"{path}: cannot write: {exc.strerror or exc}")


class ShardWriter:
    """Write one safetensors file whose tensors are all declared up front.

    ``ShardWriter(path, planned, metadata)`` writes the header immediately; then :meth:`write_array` and
    :meth:`copy_range` fill the declared tensors with positioned writes, in any order, from any thread or
    forked worker process (which inherits the open file). Both return the bytes they wrote; whoever drives
    the writer passes those counts to :meth:`record`, and :meth:`close` checks that every declared tensor
    was written completely. Nothing is buffered in memory.
    """

    def __init__(self, path: Path, planned: list[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for tensor in planned:
            if tensor.name in self.offsets:
                raise ValueError(f"tensor '{tensor.name}' declared twice for {self.path}")
            header[tensor.name] = {
                "dtype": tensor.dtype,
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + tensor.nbytes],
            }
            self.offsets[tensor.name] = (offset, offset + tensor.nbytes)
            offset += tensor.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        self.data_start = 8 + len(raw)
        self.total_bytes = self.data_start + offset
        self._remaining = {name: end - begin for name, (begin, end) in self.offsets.items()}
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        except OSError as exc:
            raise _os_error(self.path, exc) from exc

    def _position(self, name: str, at: int, nbytes: int) -> int:
        begin, end = self.offsets[name]
        if at < 0 or begin + at + nbytes > end:
            raise ValueError(f"{self.path}: {nbytes} bytes at {at} do not fit tensor '{name}' ({end - begin} bytes)")
        return self.data_start + begin + at

    def record(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` written into tensor ``name`` (returned by :meth:`write_array` / :meth:`copy_range`)."""
        self._remaining[name] -= nbytes

    def write_array(self, name: str, array: np.ndarray, at: int = 0) -> int:
        """Write a numpy array's raw bytes (C order) into declared tensor ``name``, ``at`` bytes into it.

        A tensor may be written in several pieces (one expert slice at a time). Returns the bytes written.
        """
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        position = self._position(name, at, data.nbytes)
        try:
            done = 0
            while done < data.nbytes:
                done += os.pwrite(self._fd, data[done:], position + done)
        except OSError as exc:
            raise _os_error(self.path, exc) from exc
        return data.nbytes

    def copy_range(self, name: str, source: Path, begin: int, nbytes: int,
                   identity: tuple | None = None, held: HeldShards | None = None) -> tuple[int, str]:
        """Copy ``nbytes`` at absolute offset ``begin`` of file ``source`` (the file whose header had ``identity``:
        :func:`open_as_read`) into declared tensor ``name``, hashing them on the way. Returns the bytes written and
        their ``"sha256:..."`` digest. ``held``: the shards this process holds open, which give way to this open
        where descriptors run out (:meth:`HeldShards.open_beside`)."""
        position = self._position(name, 0, nbytes)
        digest = hashlib.sha256()
        try:
            src = open(open_as_read(source, identity) if held is None else held.open_beside(source, identity), "rb",
                       buffering=0)
        except OSError as exc:
            raise InputError(f"{source}: cannot read: {exc.strerror or exc}") from exc
        with src:
            try:
                copy_hashing(src.fileno(), begin, self._fd, position, nbytes, digest)
            except SourceReadError as exc:
                raise InputError(f"{source}: cannot read tensor {name!r}: {exc.strerror or exc}") from exc
            except OSError as exc:
                raise _os_error(self.path, exc) from exc
        return nbytes, digest_text(digest)

    def close(self) -> None:
        """Flush and close; raise if a declared tensor was never written."""
        try:
            os.close(self._fd)
        except OSError as exc:
            raise _os_error(self.path, exc) from exc
        missing = sorted(name for name, left in self._remaining.items() if left)
        if missing:
            raise OutputError(f"{self.path}: {len(missing)} declared tensors were not completely written "
                              f"({', '.join(missing[:5])})")

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass

