"""Byte copies that hash what they move, and whole-file digests: every byte the converter copies or writes is
read once, through one reusable buffer, and its SHA-256 comes out of the same pass.

Digests are written ``"sha256:<64 hex digits>"`` everywhere (manifest, reports).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import tempfile
from pathlib import Path

#: bytes moved per read/write: large enough that system calls cost nothing, small beside a worker's memory
CHUNK_BYTES = 8 << 20


def digest_text(digest: "hashlib._Hash") -> str:
    return "sha256:" + digest.hexdigest()


class SourceReadError(OSError):
    """A read of the source failed, or the source ended before the bytes to copy (it shrank while we copied):
    the caller names the source, not the file being written."""


def _read_into(fd: int, buffer: memoryview, position: int) -> int:
    try:
        got = os.preadv(fd, [buffer], position)
    except OSError as exc:
        raise SourceReadError(exc.errno, exc.strerror) from exc
    if got == 0:
        raise SourceReadError(5, "it ended early (truncated while being copied?)")
    return got


def copy_hashing(src_fd: int, src_pos: int, dst_fd: int, dst_pos: int, nbytes: int, digest: "hashlib._Hash") -> None:
    """Copy ``nbytes`` from ``src_fd`` at ``src_pos`` to ``dst_fd`` at ``dst_pos`` (positioned I/O, so forked
    processes can share descriptors), feeding every byte to ``digest``. Raises SourceReadError for the source's
    reads, OSError for the writes."""
    buffer = memoryview(bytearray(min(CHUNK_BYTES, max(nbytes, 1))))
    done = 0
    while done < nbytes:
        got = _read_into(src_fd, buffer[: min(len(buffer), nbytes - done)], src_pos + done)
        digest.update(buffer[:got])
        written = 0
        while written < got:
            written += os.pwrite(dst_fd, buffer[written:got], dst_pos + done + written)
        done += got


#: a file name in the Hugging Face cache's blob store: the git (40) or SHA-256 (64 hex digits) hash of its content
_HUB_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def name_text(name: str) -> str:
    """A file name or path as read from the file system, as JSON text can hold it: bytes that are not UTF-8 (lone
    surrogates in ``name``) written as ``\\xNN``; a valid UTF-8 name is returned as it is."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def dead_link(path: Path) -> str:
    """What is wrong with the link ``path`` whose target cannot be reached: ``"a loop of links (through X)"`` where
    following it comes back round (ELOOP), else ``"broken link (to X)"``; X is the link's own text."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"a loop of links (through {os.readlink(path)})"
    return f"broken link (to {os.readlink(path)})"


def is_hub_blob(target: Path) -> bool:
    """Whether ``target`` (a resolved path) is a file of a Hugging Face cache repository's blob store:
    ``<cache>/{models,datasets,spaces}--<org>--<name>/blobs/<hash>``."""
    store = target.parent
    return (store.name == "blobs" and store.parent.name.startswith(("models--", "datasets--", "spaces--"))
            and _HUB_BLOB_NAME.fullmatch(target.name) is not None)


def outside_link(path: Path, root: Path) -> Path | None:
    """The target of ``path`` when it is a symbolic link that leads out of directory ``root``, else None.

    A checkpoint's files are read only inside its directory. The one exception is the Hugging Face cache's blob
    store (:func:`is_hub_blob`): the files of a snapshot ``<repo>/snapshots/<revision>`` (or of a subfolder of one),
    and of a ``--local-dir`` download by older huggingface_hub versions, are links to ``<repo>/blobs/<hash>``; those are
    followed. Anything else (``config.json -> /etc/passwd``, a shard linked into another tree) is not."""
    if not os.path.islink(path):
        return None
    target = Path(os.path.realpath(path))  # a link loop resolves to a path that does not exist
    real_root = Path(os.path.realpath(root))
    if target == real_root or real_root in target.parents or is_hub_blob(target):
        return None
    return target


class NotReadHere(OSError):
    """:func:`open_inside` refused a file: it is not a regular file, or what was opened lies outside the directory
    it must be read from. ``strerror`` says which (callers print it like any OSError's)."""


def _opened_path(fd: int, path: Path, opened: os.stat_result) -> Path:
    """The resolved path of the file open on ``fd`` (opened through ``path``): the kernel's name for the descriptor
    (``/proc/self/fd``) where there is one, so no later change of ``path`` can make it lie; elsewhere ``path``
    resolved, accepted only if it is still the same file as the descriptor's."""
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if name.startswith("/"):
        return Path(name.removesuffix(" (deleted)"))
    target = Path(os.path.realpath(path))
    try:
        now = os.stat(target)
    except OSError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
        raise NotReadHere(errno.ESTALE, "it was replaced while being opened; not read")
    return target


def open_inside(path: Path, root: Path | None = None) -> int:
    """Open regular file ``path`` for reading and return the descriptor, checked at the open itself: the file
    opened must be a regular file lying in directory ``root`` (default: ``path``'s parent) or a file of a Hugging
    Face cache's blob store (:func:`outside_link`). Checking the file actually opened, not the path beforehand,
    leaves no gap in which a link swapped in could make the caller read a file outside ``root``, and a FIFO
    swapped in cannot block the open (it is opened non-blocking, then refused).

    Raises :class:`NotReadHere` (an OSError: ENXIO not a regular file, EACCES outside ``root``, ESTALE replaced
    while opened), or the open's own OSError."""
    path = Path(path)
    root = path.parent if root is None else Path(root)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise NotReadHere(errno.ENXIO, "not a regular file; not read")
        target = _opened_path(fd, path, opened)
        real_root = Path(os.path.realpath(root))
        if not (real_root in target.parents or is_hub_blob(target)):
            raise NotReadHere(errno.EACCES, f"it leads to {target}, outside {root}; not read (links are followed "
                                            "only into a Hugging Face cache's blobs)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: the most bytes :func:`read_inside` reads: its files are JSON (configs, the index, the manifest); a manifest takes
#: about 1.7 KB per layer entry, 80-140 MB for a model of hundreds of experts per layer written per expert; a larger
#: file (a sparse file of gigabytes) would take several times its size in memory
MAX_WHOLE_FILE_BYTES = 256 << 20


def read_inside(path: Path, root: Path | None = None) -> bytes:
    """The whole content of regular file ``path``, opened with :func:`open_inside`, at most
    :data:`MAX_WHOLE_FILE_BYTES`. Raises OSError (:class:`NotReadHere`, EFBIG, for a larger file)."""
    with open(open_inside(path, root), "rb") as f:  # (buffered: read(n) reads on to n bytes or the end)
        size = os.fstat(f.fileno()).st_size
        if size > MAX_WHOLE_FILE_BYTES:
            raise NotReadHere(errno.EFBIG, f"{size} bytes, more than the {MAX_WHOLE_FILE_BYTES} this tool reads of a "
                                           "config, an index or a manifest")
        # the size read first: read(n) reserves n bytes before it reads, and 256 MiB for each 400-byte config failed
        # where memory is not overcommitted (a ulimit -v of 300 MB: `inspect` of a tiny checkpoint ran out of memory)
        data = f.read(size + 1)
        if len(data) > size:  # (grown since: read on, to the limit, as before)
            data += f.read(MAX_WHOLE_FILE_BYTES + 1 - len(data))
        return data


def hash_range(fd: int, begin: int, nbytes: int) -> str:
    """``"sha256:..."`` of ``nbytes`` bytes of ``fd`` from offset ``begin``, read in chunks. Raises SourceReadError."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(min(CHUNK_BYTES, max(nbytes, 1))))
    done = 0
    while done < nbytes:
        got = _read_into(fd, buffer[: min(len(buffer), nbytes - done)], begin + done)
        digest.update(buffer[:got])
        done += got
    return digest_text(digest)


def copy_file_hashing(source: Path, destination: Path) -> tuple[int, str]:
    """Copy file ``source`` (read from its own directory: :func:`open_inside`) to the new file ``destination``
    (which must not exist); returns (bytes, digest). Raises OSError."""
    digest = hashlib.sha256()
    with open(open_inside(source), "rb", buffering=0) as src:
        size = os.fstat(src.fileno()).st_size
        fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            copy_hashing(src.fileno(), 0, fd, 0, size, digest)
        finally:
            os.close(fd)
    return size, digest_text(digest)


def hash_file(path: Path) -> tuple[int, str]:
    """(bytes, digest) of file ``path`` (in its own directory: :func:`open_inside`), read once. Raises OSError."""
    digest = hashlib.sha256()
    with open(open_inside(path), "rb", buffering=0) as f:
        buffer = memoryview(bytearray(CHUNK_BYTES))
        size = 0
        while got := f.readinto(buffer):
            digest.update(buffer[:got])
            size += got
    return size, digest_text(digest)


def replace_file(target: Path, content: bytes, mode: int | None = None) -> None:
    """Put ``content`` at ``target`` as a new file (a hidden temporary beside it, renamed over it), with permissions
    ``mode`` (default: those a new file gets here); the temporary never outlives the call. Raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".marlin-report-", suffix=".tmp")
    renamed = False
    try:
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
        with open(fd, "wb", closefd=False) as stream:
            stream.write(content)
        os.replace(tmp, target)
        renamed = True
    finally:
        os.close(fd)
        if not renamed:
            try:
                os.unlink(tmp)
            except OSError:
                pass
