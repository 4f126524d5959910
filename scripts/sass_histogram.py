#!/usr/bin/env python3
"""Static SASS instruction counts of the built kernels, by opcode, side by side (needs cuobjdump: the CUDA toolkit).

    python3 scripts/sass_histogram.py --match 'Kind<__half, 4, true>, 1, 1, 4, 2, true, 1' \\
                                      --match 'Kind<__nv_bfloat16, 4, true>, 1, 1, 4, 2, true, 1'

Builds (or loads the cached build of) the extension for GPU 0, disassembles it, and for each kernel whose demangled
name contains a --match string prints its instruction count per opcode (modifiers dropped: HMMA.16816.F32 counts as
HMMA), one column per match. Static counts: the main loop's unrolled body dominates them, but they are not executed
counts (ncu's source page gives those).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def histograms(library: Path) -> dict[str, collections.Counter]:
    """Demangled kernel name -> opcode counts, from ``cuobjdump -sass`` of ``library``."""
    sass = subprocess.run(["cuobjdump", "-sass", str(library)], capture_output=True, text=True, check=True).stdout
    counts: dict[str, collections.Counter] = {}
    current = None
    for line in sass.splitlines():
        found = _FUNCTION.match(line)
        if found:
            current = counts.setdefault(found.group(1), collections.Counter())
            continue
        op = _INSTRUCTION.match(line)
        if op and current is not None:
            current[op.group(1)] += 1
    names = list(counts)
    try:
        demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                                   text=True).stdout.split("\n")
    except FileNotFoundError:  # no binutils: match against the mangled names
        demangled = names
    return {pretty or raw: counts[raw] for raw, pretty in zip(names, demangled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--match", action="append", required=True, help="substring of a demangled kernel name")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if shutil.which("cuobjdump") is None:
        sys.exit("cuobjdump not found (it comes with the CUDA toolkit)")
    from marlin_convert.kernel import load_kernel

    library = Path(load_kernel(0).__file__)
    table = histograms(library)
    columns = []
    for pattern in args.match:
        hits = [name for name in table if pattern in name]
        if len(hits) != 1:
            print(f"--match {pattern!r}: {len(hits)} kernels" + "".join(f"\n  {h}" for h in hits[:20]))
            continue
        columns.append((pattern, table[hits[0]]))
    if not columns:
        return
    ops = sorted({op for _, c in columns for op in c}, key=lambda op: -max(c[op] for _, c in columns))
    for i, (pattern, counts) in enumerate(columns):
        print(f"[{i}] {pattern}: {sum(counts.values())} instructions")
    print(f"{'opcode':<10}" + "".join(f"{f'[{i}]':>8}" for i in range(len(columns))))
    for op in ops[:args.top]:
        print(f"{op:<10}" + "".join(f"{c[op]:>8}" for _, c in columns))


if __name__ == "__main__":
    main()
