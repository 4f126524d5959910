"""Run a command and report its wall time and peak resident set size, as the OS accounted them.

Linux carries a process's peak RSS across fork and exec: a child forked from a large parent (say, one that
just generated a checkpoint, or a pytest run) starts with the parent's RSS as its "peak". So the command is
started from a small Python launcher, itself started fresh, and the launcher reports its child's ru_maxrss
from wait4. Used by scripts/bench_convert.py and tests/test_streaming.py.

    python scripts/peak_rss.py -- marlin-convert IN OUT -q     # prints "<seconds> <peak bytes>"
"""

from __future__ import annotations

import subprocess
import sys

_LAUNCHER = (
    "import os, subprocess, sys, time\n"
    "start = time.perf_counter()\n"
    "try:\n"
    "    child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "except OSError as exc:\n"
    "    sys.exit(f'cannot start {sys.argv[1]}: {exc.strerror}')\n"
    "_, status, usage = os.wait4(child.pid, 0)\n"
    "print(time.perf_counter() - start, usage.ru_maxrss * 1024)\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def measure(argv: list[str]) -> tuple[float, int]:
    """Run ``argv`` (its stdout discarded); return (wall seconds, peak RSS in bytes). Raises on failure."""
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    seconds, peak = done.stdout.split()
    return float(seconds), int(peak)


def main(argv: list[str]) -> int:
    """The command line: ``[--] COMMAND ...``; ``-h`` / ``--help`` (before any ``--``) or nothing prints the usage.
    A command that fails or cannot start is one line on stderr and exit 2."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    elif not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        print(*measure(argv))
    except (OSError, RuntimeError) as exc:
        print(f"peak_rss: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
