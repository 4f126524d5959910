"""What an output directory contains besides the tensors, and the digest of every file in it.

OUT_DIR holds, all at its top level: the converted shards (same names as IN_DIR's), the rewritten index,
``config.json`` and ``quantize_config.json``, ``marlin_manifest.json``, and a copy of every other *regular file*
at IN_DIR's top level (tokenizer files, ``generation_config.json``, chat templates, custom code, README, license,
...). Left out, each named in the report's notes (:func:`select_extra_files`):

- hidden entries (``.git``, ``.gitattributes``, ``.cache``, ...): repository and tool state, not the model;
- subdirectories, and links to directories: not followed (so a link loop cannot copy IN_DIR into itself);
- weight files of other formats, and ``.safetensors`` files the checkpoint does not use (``*.bin``, ``*.pt``,
  ``*.pth``, ``*.ckpt``, ``*.gguf``, ``*.h5``, ``*.msgpack``, ``*.onnx``, ``*.index.json`` of those): they are not
  the converted model, and a loader could pick them up instead of it;
- links to files outside IN_DIR (other than the Hugging Face cache's ``models--*/blobs/<hash>``, which snapshot
  files link to), so that a link such as ``tokenizer.json -> ~/.ssh/id_rsa`` is never copied as content;
- anything that is not a regular file (sockets, FIFOs, devices).

A link whose target is missing, or a file that cannot be read, is an input error before anything is written.
Copies hold the content (never a link). :func:`output_file_digests` then hashes every file (or copies and hashes
it in one pass) in worker processes: the manifest's ``files``.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError
from .fileio import (SourceReadError, copy_file_hashing, dead_link, hash_file, name_text, open_inside,
                     outside_link)
from .workers import run_parallel

#: file names ending so hold weights in another format (or a checkpoint's index of them)
OTHER_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx",
                         ".index.json")


@dataclass
class ExtraFiles:
    """IN_DIR's other top-level files: ``copy`` maps each output name to the regular file to read;
    ``skipped`` says, one line per entry, what was left out and why."""

    copy: dict[str, Path] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def _check_readable(path: Path, shown: Path) -> None:
    try:
        os.close(open_inside(path))
    except OSError as exc:
        raise InputError(f"{shown}: cannot read: {exc.strerror or exc}",
                         hint="fix its permissions, or move it out of IN_DIR if it is not part of the model") from exc


def select_extra_files(in_dir: Path, produced: set[str]) -> ExtraFiles:
    """Decide what of ``in_dir``'s top level is copied (see the module docstring). ``produced``: the names the
    converter writes itself (shards, index, configs, manifest). Raises :class:`InputError` for a broken link or
    an unreadable file; reads nothing but directory entries and permissions."""
    extra = ExtraFiles()
    for entry in sorted(os.scandir(in_dir), key=lambda e: e.name):
        name, path = entry.name, Path(entry.path)
        if name in produced:
            continue
        if name.startswith("."):
            extra.skipped.append(f"{name}: hidden")
            continue
        if name_text(name) != name:  # not UTF-8: the manifest (JSON text) could not list it
            extra.skipped.append(f"{name_text(name)}: a name that is not UTF-8")
            continue
        if entry.is_symlink():
            target = Path(os.path.realpath(path))  # a link loop resolves to a path that does not exist
            if not target.exists():
                raise InputError(f"{path}: {dead_link(path)}",
                                 hint="restore its target, or remove the link")
            if target.is_dir():
                extra.skipped.append(f"{name}: a link to a directory, not followed")
                continue
            if outside_link(path, in_dir) is not None:
                extra.skipped.append(f"{name}: a link to {target}, outside IN_DIR, not copied")
                continue
        if entry.is_dir():
            extra.skipped.append(f"{name}/: a directory")
        elif not path.is_file():
            extra.skipped.append(f"{name}: not a regular file")
        elif name.endswith(OTHER_WEIGHT_SUFFIXES):
            extra.skipped.append(f"{name}: weights the checkpoint does not use, or in another format")
        else:
            _check_readable(path, path)
            extra.copy[name] = path
    return extra


def _describe(task: tuple[Path, Path | None]) -> tuple[str, int, str]:
    destination, source = task
    if source is None:
        return destination.name, *hash_file(destination)
    try:
        return destination.name, *copy_file_hashing(source, destination)
    except OSError as exc:
        if exc.errno == errno.ENOSPC and not isinstance(exc, SourceReadError):
            raise
        raise InputError(f"{source}: cannot copy it into OUT_DIR: {exc.strerror or exc}") from exc


def output_file_digests(directory: Path, copies: dict[str, Path], workers: int) -> dict[str, dict]:
    """Copy ``copies`` (output name -> source file) into ``directory`` and hash every file there, in ``workers``
    processes, largest first. Returns the manifest's ``files``: ``{name: {"bytes", "sha256"}}``, sorted by
    name. Raises OSError."""
    tasks = [(directory / name, source) for name, source in copies.items()]
    tasks += [(path, None) for path in directory.iterdir() if path.name not in copies]
    tasks.sort(key=lambda task: -(task[1] or task[0]).stat().st_size)
    found = {name: {"bytes": size, "sha256": digest} for name, size, digest in run_parallel(_describe, tasks, workers)}
    return dict(sorted(found.items()))
