"""The output directory's life: checked up front, written as a hidden locked sibling, moved into place atomically.

A conversion writes into ``.OUT.partial-PID`` beside OUT_DIR (same file system, so the final move is a rename).
That directory is locked (``flock`` on its directory descriptor) for as long as the converter or one of its
worker processes lives, which is how a later run tells a partial directory that is still being written from a
stale one left by a killed run: stale ones are removed, live ones make the later run stop (two converters on
one OUT_DIR). The final move never replaces what another process put at OUT_DIR in the meantime:

- without ``--overwrite``: ``rename`` onto OUT_DIR, which the kernel refuses (atomically) when OUT_DIR is
  anything but absent or an empty directory;
- with ``--overwrite``: ``renameat2(RENAME_EXCHANGE)`` swaps the finished directory with OUT_DIR in one step,
  then the old contents (now at the partial name) are removed; where the call is missing (not Linux, old
  kernel, a file system without it) the old OUT_DIR is first renamed aside to ``.OUT.old-PID``.

OUT_DIR itself must not be a symbolic link (it is refused: writing through a link would replace the link, not
fill its target); links among OUT_DIR's parents are fine. ``--overwrite`` replaces only an empty directory or a
previous output (its manifest, and only the files that manifest lists), and OUT_DIR must not hold the current directory or a file that an entry
of IN_DIR links to (:func:`check_out_dir`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import re
import shutil
import sys
from pathlib import Path

from .errors import ManifestError, OutputError
from .manifest import MANIFEST_FILE, load_manifest

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _refuse_links_into(in_dir: Path, out_dir: Path, dst: Path) -> None:
    """Refuse where an entry of IN_DIR is, or links to, something inside OUT_DIR (resolved): a Hugging Face snapshot
    converted into its own ``blobs`` directory, say. Replacing OUT_DIR would delete the source (with --overwrite),
    and the source would change under the conversion."""
    try:
        entries = list(os.scandir(in_dir))
    except OSError:
        return  # (an unreadable IN_DIR is named when the checkpoint is opened)
    for entry in entries:
        target = Path(os.path.realpath(entry.path))
        if target == dst or dst in target.parents:
            raise OutputError(f"IN_DIR's {entry.name} is a link to {target}, inside OUT_DIR {out_dir}: writing OUT_DIR "
                              "would destroy the source", hint="choose an OUT_DIR that holds none of IN_DIR's files")


def _mount_points() -> set[str]:
    """The mount points of this process's mount namespace (Linux: /proc/self/mountinfo, field 5, octal escapes
    decoded; a bind mount on the same file system is one, which os.path.ismount cannot tell); empty elsewhere."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            fields = [line.split(" ") for line in f]
    except OSError:
        return set()
    return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4]) for parts in fields if len(parts) > 4}


def _is_mount_point(path: Path) -> bool:
    return os.path.ismount(path) or str(path) in _mount_points()


def _unwritable(directory: Path) -> str | None:
    """Why no new directory can be made in existing directory ``directory`` (what follows "it is"), or None."""
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "on a read-only file system"
    except OSError:
        pass
    if not os.access(directory, os.W_OK | os.X_OK):
        return "not writable by this user"
    return None


def check_free_space(out_dir: Path, needed: int) -> None:
    """Refuse the conversion when the file system that takes ``out_dir`` (absolute; it and its parent need not
    exist: the nearest existing directory above it is asked) has fewer than ``needed`` bytes free. The real run and
    ``--dry-run`` ask the same; one of size 0 (proc, sysfs) is named as such. Where the free space cannot be read,
    nothing is refused. Raises
    :class:`OutputError`; reads only."""
    probe = out_dir.parent
    while not os.path.isdir(probe) and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return
    free = usage.free
    if free < needed and usage.total == 0:  # (proc, sysfs: "0 are free" would send one after space to free)
        raise OutputError(f"{out_dir.parent} is on a file system that stores no files (its size is 0, as /proc's and "
                          "/sys's are)", hint="choose an OUT_DIR on a disk")
    if free < needed:
        raise OutputError(f"{out_dir.parent}: not enough disk space: the conversion writes {needed} bytes, "
                          f"{free} are free", hint="free disk space or choose another OUT_DIR")


def check_out_dir(in_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """Refuse an OUT_DIR that would overlap IN_DIR (also through a link of IN_DIR's into it), is a symbolic link, is
    not a directory, is or holds the current directory, is not empty (without ``overwrite``; with it, not empty and
    not a previous output: :func:`replace_refusal`), is a mount point, or whose output could not be built: the
    conversion writes into a new directory beside OUT_DIR (:class:`OutputDir`), so the nearest existing directory
    above OUT_DIR must take one. ``out_dir`` is absolute. Raises :class:`OutputError`; reads only."""
    if not out_dir.name:
        raise OutputError(f"OUT_DIR {out_dir} is a file system root", hint="choose a directory to create")
    if out_dir.is_symlink():
        raise OutputError(f"OUT_DIR {out_dir} is a symbolic link (to {os.readlink(out_dir)}): the conversion would "
                          "replace the link, not write into its target",
                          hint="give the directory the link points to, or another path")
    src, dst = Path(os.path.realpath(in_dir)), Path(os.path.realpath(out_dir))  # realpath: no error on link loops
    if dst == src or src in dst.parents:
        raise OutputError(f"OUT_DIR {out_dir} is inside (or equal to) IN_DIR {in_dir}", hint="choose a separate directory")
    if dst in src.parents:
        raise OutputError(f"IN_DIR {in_dir} is inside OUT_DIR {out_dir}", hint="choose a separate directory")
    _refuse_links_into(in_dir, out_dir, dst)
    if dst.exists():
        if not dst.is_dir():
            raise OutputError(f"OUT_DIR {out_dir} exists and is not a directory")
        refusal = replace_refusal(dst)
        if refusal is not None:  # (with or without --overwrite: it is not the tool's to replace)
            raise OutputError(f"OUT_DIR {out_dir} is not empty and not a previous marlin-convert output: it {refusal}",
                              hint="empty it, or choose another OUT_DIR (--overwrite replaces only an empty directory "
                                   "or a previous output with nothing added)")
        if not overwrite and any(dst.iterdir()):
            raise OutputError(f"OUT_DIR {out_dir} is not empty (a previous output)",
                              hint="pass --overwrite to replace it")
        if _is_mount_point(dst):
            raise OutputError(f"OUT_DIR {out_dir} is a mount point: the output is built in a new directory beside it "
                              "and renamed into place, which cannot replace a mount point",
                              hint=f"give a directory inside it, e.g. {out_dir / 'model-marlin'}")
    else:
        existing = next(p for p in dst.parents if p.exists())  # (the root exists)
        if not existing.is_dir():
            raise OutputError(f"OUT_DIR {out_dir} cannot be created: {existing} is a file, not a directory",
                              hint="choose another OUT_DIR")
    above = next(p for p in dst.parents if p.exists())  # where the working directory (or its parents) is made
    reason = _unwritable(above) if above.is_dir() else None
    if reason is not None:
        raise OutputError(f"OUT_DIR {out_dir} cannot be written: the output is built in a new directory "
                          f"{dst.parent / ('.' + dst.name + '.partial-PID')} and renamed into place, and {above} "
                          f"is {reason}", hint="choose an OUT_DIR in a directory you can write")
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except OSError:  # the current directory was removed: it cannot be OUT_DIR
        cwd = None
    if cwd is not None and (cwd == dst or dst in cwd.parents):
        raise OutputError(f"OUT_DIR {out_dir} is (or holds) the current directory, which the output would replace",
                          hint="run from another directory, or choose another OUT_DIR")


def replace_refusal(directory: Path) -> str | None:
    """Why --overwrite may not replace ``directory`` (what follows "it"), or None where it may: empty, or a previous
    output with nothing added, that is a manifest this tool reads and beside it only files the manifest lists (a
    conversion writes no subdirectory and lists every file it writes). A file that merely has the manifest's name
    does not make a directory of someone's work replaceable."""
    entries = sorted(os.listdir(directory))
    if not entries:
        return None
    if MANIFEST_FILE not in entries:
        return f"holds no {MANIFEST_FILE}"
    try:
        manifest = load_manifest(directory)
    except ManifestError as exc:
        return f"holds a {MANIFEST_FILE} that is not this tool's ({exc.message})"
    listed = set(manifest["files"]) | {MANIFEST_FILE}
    foreign = [name for name in entries
               if name not in listed or (os.path.isdir(directory / name) and not os.path.islink(directory / name))]
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        return f"holds what its manifest does not list: {', '.join(foreign[:3])}{more}"
    return None


def _lock(path: Path) -> int | None:
    """Open directory ``path`` and take its exclusive lock without waiting: the descriptor, or None if another
    process holds the lock. Raises OSError when the directory cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_partials(out_dir: Path) -> list[str]:
    """Deal with what earlier runs left beside ``out_dir``; return one note per thing found.

    ``.OUT.partial-PID`` directories that nobody holds locked and whose process is gone are removed. One that is
    locked belongs to a converter still running: :class:`OutputError` (two converters on one OUT_DIR). One that
    is unlocked but whose process exists is reported, not touched. ``.OUT.old-PID`` (an OUT_DIR moved aside by
    an ``--overwrite`` run that was killed before it removed it, or could not remove it) is reported, not removed.
    """
    notes = []
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(partial|old)-(\d+)")
    for path in sorted(out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*")):
        match = pattern.fullmatch(path.name)
        if match is None or path.is_symlink() or not path.is_dir():
            continue
        kind, pid = match.group(1), int(match.group(2))
        if kind == "old":
            notes.append(f"{path} holds an earlier OUT_DIR that an --overwrite run (process {pid}) moved aside and "
                         "did not remove (interrupted, or it could not); remove it when you no longer need it")
            continue
        try:
            fd = _lock(path)
        except OSError as exc:
            notes.append(f"{path}: partial output of an earlier run (process {pid}) left in place: cannot open it: "
                         f"{exc.strerror or exc}")
            continue
        if fd is None:
            raise OutputError(f"another marlin-convert (process {pid}) is writing {out_dir} (into {path})",
                              hint="wait for it to finish, or choose another OUT_DIR")
        try:
            if pid != os.getpid() and _process_exists(pid):  # our own pid: a dead process's, reused
                notes.append(f"{path}: partial output of process {pid}, which is still running but does not hold "
                             "the directory's lock (an older marlin-convert?): left in place")
            else:
                reason = _remove_tree(path)
                notes.append(f"removed {path}, left by an earlier run (process {pid}): a killed run's partial output, "
                             "or an OUT_DIR an --overwrite run could not remove" if reason is None else
                             f"{path}, left by an earlier run (process {pid}), could not all be removed ({reason}); "
                             "remove it by hand")
        finally:
            os.close(fd)
    return notes


class PartialDir:
    """The hidden, locked directory a conversion writes into; :meth:`finalize` moves it to OUT_DIR.

    Created on construction (``.OUT.partial-PID`` beside OUT_DIR, never an existing directory; with the directories
    above it that do not exist yet); the lock is held until :meth:`finalize` or :meth:`discard`. Raises
    :class:`OutputError` when it cannot be created.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
        # the directories above OUT_DIR this run creates, deepest first: a run that fails removes them again (where
        # still empty), so that nothing of it is left behind. Only those its own mkdir made: one that another process
        # (a second run, the user) created between the look and the mkdir is not this run's to remove
        self._created_parents: list[Path] = []
        missing = []
        parent = out_dir.parent
        while not parent.exists() and parent != parent.parent:
            missing.append(parent)
            parent = parent.parent
        try:
            for directory in reversed(missing):
                try:
                    os.mkdir(directory)
                except FileExistsError:
                    if not directory.is_dir():
                        raise
                    continue
                self._created_parents.insert(0, directory)
            self.path.mkdir()
        except OSError as exc:
            self._remove_created_parents()
            raise OutputError(f"{out_dir.parent}: cannot create the output's working directory {self.path.name} there "
                              f"(renamed to {out_dir.name} when complete): {exc.strerror or exc}") from exc
        try:
            self._fd = _lock(self.path)
        except OSError as exc:  # (a file system without flock: Lustre mounted noflock, NFS without its lock daemon)
            self._fd = None
            shutil.rmtree(self.path, ignore_errors=True)
            self._remove_created_parents()
            raise OutputError(f"{out_dir.parent}: cannot lock the output's working directory {self.path.name} there "
                              f"(the lock tells a running conversion from a killed one's leftovers): "
                              f"{exc.strerror or exc}",
                              hint="choose an OUT_DIR on a file system that supports flock (a local disk)") from exc

    def _unlock(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _remove_created_parents(self) -> None:
        """Remove the directories above OUT_DIR that this run created, deepest first, each only while empty (another
        run, or the user, may have put something there meanwhile: then it and those above it stay)."""
        for parent in self._created_parents:
            try:
                parent.rmdir()
            except OSError:
                return

    def discard(self) -> None:
        """Remove the partial directory (after a failure or an interrupt), where it is now: a directory above it renamed
        meanwhile moved it (Linux: its path is read from the lock's descriptor)."""
        path = self.path
        if self._fd is not None and not path.is_dir():
            try:
                now = os.readlink(f"/proc/self/fd/{self._fd}")
            except OSError:
                now = ""
            if now.startswith("/") and not now.endswith(" (deleted)") and \
                    Path(now).name == self.path.name:
                path = Path(now)
        shutil.rmtree(path, ignore_errors=True)
        self._unlock()
        self._remove_created_parents()

    def finalize(self, overwrite: bool) -> list[str]:
        """Move the finished directory to OUT_DIR: see the module docstring. Returns a note for each thing left
        behind (with ``overwrite``: the previous OUT_DIR's contents, where they could not all be removed). Raises
        :class:`OutputError` (and leaves OUT_DIR as it was) when OUT_DIR was filled by someone else while this run
        worked: without ``overwrite`` whatever it holds, with it unless it is a previous output
        (:func:`replace_refusal`)."""
        out_dir = self.out_dir
        try:
            _sync_tree(self.path)
        except OSError as exc:
            self._unlock()
            raise OutputError(f"{exc.filename or self.path}: cannot flush the output to disk: "
                              f"{exc.strerror or exc}") from exc
        try:
            if overwrite and out_dir.is_symlink():
                raise OutputError(f"OUT_DIR {out_dir} became a symbolic link while converting; left as it is")
            if overwrite and out_dir.exists() and not out_dir.is_dir():  # --overwrite replaces a directory only
                raise OutputError(f"OUT_DIR {out_dir} became a file while converting; left as it is")
            if overwrite and out_dir.exists():
                refusal = replace_refusal(out_dir)
                if refusal is not None:  # filled by someone else meanwhile: not ours to delete
                    raise OutputError(f"OUT_DIR {out_dir} was filled by another process while converting (it "
                                      f"{refusal}); it is left as it is and this run's output is discarded",
                                      hint="choose another OUT_DIR")
                if not _exchange(self.path, out_dir):
                    aside = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
                    out_dir.rename(aside)
                    self.path.rename(out_dir)
                    _sync_dir_quietly(out_dir.parent)
                    return _remove_previous(aside)
                _sync_dir_quietly(out_dir.parent)
                return _remove_previous(self.path)  # now OUT_DIR's previous contents (unlocked in the finally)
            self.path.rename(out_dir)
            _sync_dir_quietly(out_dir.parent)
            return []
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise OutputError(f"OUT_DIR {out_dir} was created by another process while converting; it is left "
                                  "as it is and this run's output is discarded",
                                  hint="pass --overwrite to replace it, or choose another OUT_DIR") from exc
            raise OutputError(f"{out_dir}: cannot move the finished output into place: {exc.strerror or exc}") from exc
        finally:
            self._unlock()


def _sync_dir(path: str | Path) -> None:
    """``fsync`` directory ``path`` (its entries: names created or renamed in it). File systems that cannot sync a
    directory (EINVAL, ENOTSUP) are passed over; other failures raise OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _sync_dir_quietly(path: Path) -> None:
    """:func:`_sync_dir` after the output was moved into place, when nothing may fail any more: a failure there
    leaves the rename to the kernel's own write-back, as before any sync."""
    try:
        _sync_dir(path)
    except OSError:
        pass


def _sync_tree(path: Path) -> None:
    """``fsync`` every regular file under ``path`` and every directory, deepest first, so that the output is on disk
    before it is moved into place: after a crash or a power loss OUT_DIR is either absent or complete, never a
    manifest beside truncated shards. Links are not followed (the output has none). Raises OSError (``filename``
    set) when a file cannot be flushed."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            file_path = os.path.join(root, name)
            try:
                fd = os.open(file_path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    continue
                raise
            try:
                os.fsync(fd)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
                    exc.filename = file_path
                    raise
            finally:
                os.close(fd)
        _sync_dir(root)


def _remove_tree(path: Path) -> str | None:
    """Remove directory tree ``path``: None once it is gone, else what stopped it (``"FILE: reason"``)."""
    failures = []

    def failed(function, name, error):  # error: the exception (onexc), or its (type, value, traceback) (onerror)
        failures.append(f"{name}: {getattr(error[1] if isinstance(error, tuple) else error, 'strerror', None)}")

    shutil.rmtree(path, **({"onexc": failed} if sys.version_info >= (3, 12) else {"onerror": failed}))
    if not os.path.lexists(path):
        return None
    return failures[0] if failures else f"{path}: still there"


def _remove_previous(path: Path) -> list[str]:
    """Remove ``path``, the previous OUT_DIR replaced by ``--overwrite``; a note if some of it stays."""
    reason = _remove_tree(path)
    if reason is None:
        return []
    return [f"the previous OUT_DIR's contents could not all be removed ({reason}): they are left in {path}; remove "
            "it by hand"]


def _exchange(a: Path, b: Path) -> bool:
    """Swap paths ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``). False where that call is not
    available for these paths; raises OSError for other failures."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
