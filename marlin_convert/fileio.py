"""Byte copies that hash what they move, and whole-file digests: every byte the converter copies or writes is
read once, through one reusable buffer, and its SHA-256 comes out of the same pass.

Digests are written ``"sha256:<64 hex digits>"`` everywhere (manifest, reports).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: bytes moved per read/write: large enough that system calls cost nothing, small beside a worker's memory
CHUNK_BYTES = 8 << 20


def digest_text(digest: "hashlib._Hash") -> str:
    return "sha256:" + digest.hexdigest()


def _read_into(fd: int, buffer: memoryview, position: int) -> int:
    got = os.preadv(fd, [buffer], position)
    if got == 0:
        raise OSError(5, "source ended early while copying")
    return got


def copy_hashing(src_fd: int, src_pos: int, dst_fd: int, dst_pos: int, nbytes: int, digest: "hashlib._Hash") -> None:
    """Copy ``nbytes`` from ``src_fd`` at ``src_pos`` to ``dst_fd`` at ``dst_pos`` (positioned I/O, so forked
    processes can share descriptors), feeding every byte to ``digest``. Raises OSError."""
    buffer = memoryview(bytearray(min(CHUNK_BYTES, max(nbytes, 1))))
    done = 0
    while done < nbytes:
        got = _read_into(src_fd, buffer[: min(len(buffer), nbytes - done)], src_pos + done)
        digest.update(buffer[:got])
        written = 0
        while written < got:
            written += os.pwrite(dst_fd, buffer[written:got], dst_pos + done + written)
        done += got


def copy_file_hashing(source: Path, destination: Path) -> tuple[int, str]:
    """Copy file ``source`` to the new file ``destination`` (which must not exist); returns (bytes, digest).
    Raises OSError."""
    digest = hashlib.sha256()
    with open(source, "rb", buffering=0) as src:
        size = os.fstat(src.fileno()).st_size
        fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            copy_hashing(src.fileno(), 0, fd, 0, size, digest)
        finally:
            os.close(fd)
    return size, digest_text(digest)


def hash_file(path: Path) -> tuple[int, str]:
    """(bytes, digest) of file ``path``, read once. Raises OSError."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buffer = memoryview(bytearray(CHUNK_BYTES))
        size = 0
        while got := f.readinto(buffer):
            digest.update(buffer[:got])
            size += got
    return size, digest_text(digest)
