#!/usr/bin/env python3
"""Sort a racecheck log's reports into the tool's cluster cp.async report and every other one.

    python3 scripts/racecheck_triage.py bench_out/sanitizer_racecheck.log [--control-dir DIR] [--json]

compute-sanitizer's racecheck (CUDA 13.0, H200) reports a race between a block's cp.async writes and a peer's
st.shared::cluster stores into the same bytes although the two are ordered by cp.async.wait_group 0, __syncthreads and
a release / acquire cluster barrier: scripts/racecheck_cluster_control.cu, a kernel of that chain alone, gets the
report in every run, and none with plain stores in place of the copies (kernel/NOTES.md, twenty-seventh session). The
wgmma kernel's [RED] in a cluster is that chain, and racecheck reports it there now and then.

A report is the tool's when it is a race report between write accesses whose sites are all ``cp_async16`` or
``st_cluster_f2`` (both present). Such reports pass only while the control still shows the tool's behaviour (its
cp_async form reported, its plain form not): the control is built with nvcc and run under racecheck here, into DIR
(default: a ``racecheck_control`` folder beside the log), and only when the log has such reports. Anything else
fails: any other report, a "maximum number of hazards" warning (the tool stopped recording), a log whose reports do not
add up to its RACECHECK SUMMARY, a log without one, a sanitizer line of a form the triage does not read (a CUDA API
error, say), a control that does not build or run.

A limit: racecheck's report names the two functions, not the kernel. The direct kernel (marlin_gemm_direct.cuh) also
pushes with st_cluster_f2 and copies with cp_async16, so a race of those two there would pass too. Its pushes go to its
sums area, which no copy writes (it arrives at the cluster barrier before its copies and waits there before its first
push), and none has been reported in any run.

Exit status: 0 when every report is the tool's and the control shows it (or there is none, unless --expect-reports),
1 otherwise, 2 for a log that cannot be read. ``scripts/gpu_check.sh`` runs this (with --expect-reports) on its
racecheck log only when racecheck exits 3 (reports) and the log says every call's result was right
(`` calls, 0 wrong``); any other exit fails its sanitizer row as is.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CONTROL_SOURCE = Path(__file__).resolve().parent / "racecheck_cluster_control.cu"
TOOL_SITES = ("cp_async16", "st_cluster_f2")  # the two sides of the tool's report, as the log names the functions

CONTROL_TIMEOUT_S = 600  # each of the control's steps (the build, each form under racecheck): a hang is an error
TOOL_NAMESPACE = "marlin_convert::detail"  # the namespace both are defined in (kernel/marlin_gemm_impl.cuh)

_PREFIX = r"^=+\s*"
_REPORT = re.compile(_PREFIX + r"(Error|Warning): Race reported between (\w+) access at (.*?)\+0x[0-9a-fA-F]+ in ")
_AND = re.compile(_PREFIX + r"and (\w+) access at (.*?)\+0x[0-9a-fA-F]+ in ")
_AND_ANY = re.compile(_PREFIX + r"and\s")  # any further site of a race report, read by _AND or not
_OTHER = re.compile(_PREFIX + r"(Error|Warning): (.*)")
# the sanitizer's word that it failed itself, or that the program did: no verdict on races can rest on such a run
_FAILED_RUN = re.compile(_PREFIX + r"(Internal Sanitizer Error\b.*|Target application returned an error.*)")
# every other line the sanitizer writes (its '=' margin) in a racecheck log of the default (analysis) form or the
# per-hazard one; a margin line of none of these forms (a CUDA API error, a note of a newer sanitizer) is not read,
# so it fails the log rather than being passed over
_KNOWN = re.compile(_PREFIX + r"(COMPUTE-SANITIZER|RACECHECK SUMMARY: .*|(Error|Warning): .*|#.*|Saved host backtrace.*"
                    r"|Host Frame.*|Device Frame.*|(Read|Write) Thread .*|Current Value.*)?\s*$")
_SUMMARY = re.compile(_PREFIX + r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)",
                      re.MULTILINE)


@dataclass
class Report:
    """One entry of a racecheck log: its first line, and for a race report the (access, function) of every site."""

    line: str
    sites: list[tuple[str, str]] = field(default_factory=list)

    def is_tools(self) -> bool:
        """A race between writes at cp_async16 and st_cluster_f2 sites only, both present."""
        if not self.sites or any(access != "Write" for access, _ in self.sites):
            return False
        kinds = [next((name for name in TOOL_SITES if _function_name(function) == f"{TOOL_NAMESPACE}::{name}"), None)
                 for _, function in self.sites]
        return None not in kinds and set(kinds) == set(TOOL_SITES)


def _function_name(signature: str) -> str:
    """The qualified name of the function a site's signature names: 'void a::b<(bool)0>(int)' -> 'a::b' (text before
    its template arguments or parameters, less a return type). Not a substring test: 'a::cp_async16_zfill',
    'a::not_cp_async16' or a kernel with cp_async16 among its template arguments are other functions."""
    head = re.split(r"[<(]", signature, maxsplit=1)[0].strip()
    return head.split()[-1] if head else ""


def _bare(line: str) -> str:
    """A log line without the tool's '=========' margin."""
    return re.sub(_PREFIX, "", line).strip()


#: lines that continue a report (its host backtrace, blank margin lines): they neither open nor close one
_CONTINUATION = re.compile(_PREFIX + r"(#|Host Frame|Saved host|\s*$)")


@dataclass
class ParsedLog:
    """What :func:`parse` reads of a racecheck log: its reports in order; its RACECHECK SUMMARY lines' (displayed,
    errors, warnings) added up (None if it has none); the sanitizer's lines (its '=' margin) it cannot read; and the
    first line saying the sanitizer or the program failed (None if none)."""

    reports: list[Report]
    summary: tuple[int, int, int] | None
    unread: list[str]
    failed_run: str | None


def parse(text: str) -> ParsedLog:
    """Read a racecheck log in one pass. A line the parser cannot read is one of no form it knows, or a race report's
    further site ('and ... access at') where no race report is open (a line of the program's output came between:
    the site would otherwise be dropped, and the report's other sites alone could pass as the tool's)."""
    reports: list[Report] = []
    unread: list[str] = []
    failed: list[str] = []
    in_race = False
    for line in text.splitlines():
        if m := _REPORT.match(line):
            reports.append(Report(_bare(line), [(m.group(2), m.group(3))]))
            in_race = True
        elif _AND_ANY.match(line):
            if not in_race:
                unread.append(_bare(line))
            elif m := _AND.match(line):
                reports[-1].sites.append((m.group(1), m.group(2)))
            else:
                # a site _AND cannot read (no line info, an unknown function, another access kind): kept as a site
                # that is never the tool's, not dropped (dropped, the report's other sites alone could pass)
                reports[-1].sites.append(("?", _bare(line)))
        elif _OTHER.match(line):
            reports.append(Report(_bare(line)))
            in_race = False
        elif not _CONTINUATION.match(line):
            in_race = False
            if m := _FAILED_RUN.match(line):
                failed.append(m.group(1).strip())
            elif re.match(_PREFIX, line) and not _KNOWN.match(line):
                unread.append(_bare(line))
    # the sanitizer's own summary lines only (not a program's output quoting one), added up: a log of several
    # processes (or runs) has one per process, and its reports are those of all of them
    summaries = [tuple(int(x) for x in found) for found in _SUMMARY.findall(text)]
    summary = tuple(sum(column) for column in zip(*summaries)) if summaries else None
    return ParsedLog(reports, summary, unread, failed[0] if failed else None)


def run_control(directory: Path) -> dict:
    """Build the control and run both of its forms under racecheck: {"cp_async": reports, "plain": reports}, or
    {"error": why} where it could not be built or run (each step's output is kept in ``directory``)."""
    for tool in ("nvcc", "compute-sanitizer"):
        if shutil.which(tool) is None:
            return {"error": f"{tool} is not on PATH"}
    directory.mkdir(parents=True, exist_ok=True)
    binary = directory / "racecheck_cluster_control"
    try:
        return _run_control(directory, binary)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"the control's step {exc.cmd[0]} {exc.cmd[-1]} ran past {CONTROL_TIMEOUT_S} s"}


def _run_control(directory: Path, binary: Path) -> dict:
    build = subprocess.run(["nvcc", "-O2", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-o",
                            str(binary), str(CONTROL_SOURCE)], capture_output=True, text=True,
                           timeout=CONTROL_TIMEOUT_S)
    (directory / "build.log").write_text(build.stdout + build.stderr)
    if build.returncode != 0:
        return {"error": f"the control did not build (nvcc exit {build.returncode}; {directory / 'build.log'})"}
    counts: dict = {}
    for form in ("cp_async", "plain"):
        done = subprocess.run(["compute-sanitizer", "--tool", "racecheck", str(binary), form],
                              capture_output=True, text=True, timeout=CONTROL_TIMEOUT_S)
        log = directory / f"{form}.log"
        log.write_text(done.stdout + done.stderr)
        if f"racecheck_cluster_control {form}: no error" not in done.stdout:
            return {"error": f"the control's {form} form did not run ({log})"}
        read = parse(done.stdout + done.stderr)
        reports, summary = read.reports, read.summary
        if summary is None:
            return {"error": f"the control's {form} form left no RACECHECK SUMMARY ({log})"}
        # the cp_async form's count is its race reports (the behaviour shown); the plain form's is every report and
        # hazard it had, of any shape: a hazard report in another form, a warning or a report the parser cannot
        # read there is no clean plain form
        counts[form] = (sum(1 for report in reports if report.sites) if form == "cp_async"
                        else max(len(reports), summary[0], summary[1] + summary[2]))
    return counts


def triage(text: str, control=None, expect_reports: bool = False) -> dict:
    """The verdict on one racecheck log: ``control`` (no arguments -> run_control's result) is called only when the
    log has reports of the tool's kind. ``expect_reports``: the sanitizer's exit status said it found errors, so a log
    that shows none fails (what made that exit is not in a form read here). Keys: ok, reason, displayed, tools, other
    (their first lines), control."""
    read = parse(text)
    reports, summary, failed_run, unread = read.reports, read.summary, read.failed_run, read.unread
    tools = [r for r in reports if r.is_tools()]
    other = [r.line for r in reports if not r.is_tools()]
    result = {"ok": False, "reason": "", "displayed": summary[0] if summary else None, "tools": len(tools),
              "other": other, "control": None}
    if summary is None:
        result["reason"] = "no RACECHECK SUMMARY in the log (the run did not finish?)"
    elif failed_run:
        result["reason"] = f"the sanitizer or the program failed: {failed_run}"
    elif unread:
        result["reason"] = f"{len(unread)} sanitizer line(s) the triage does not read, the first: {unread[0]}"
    elif expect_reports and not reports and summary == (0, 0, 0):
        result["reason"] = "the sanitizer's exit status says it found errors, and the log shows no report"
    elif summary[0] != len(reports) or summary[1] + summary[2] != len(reports):
        result["reason"] = (f"the log's summary says {summary[0]} reports ({summary[1]} errors, {summary[2]} "
                            f"warnings), {len(reports)} were read")
    elif other:
        result["reason"] = f"{len(other)} report(s) not of the tool's kind, the first: {other[0]}"
    elif tools:
        result["control"] = control() if control is not None else {"error": "no control was run"}
        ctl = result["control"]
        if "error" in ctl:
            result["reason"] = f"{len(tools)} report(s) of the tool's kind, and no control: {ctl['error']}"
        elif ctl["cp_async"] == 0 or ctl["plain"] != 0:
            result["reason"] = (f"{len(tools)} report(s) of the tool's kind, but the control does not show the "
                                f"tool's behaviour (cp_async form {ctl['cp_async']} reports, plain form "
                                f"{ctl['plain']}): take them as the kernel's")
        else:
            result["ok"] = True
    else:
        result["ok"] = True
    return result


def describe(result: dict) -> str:
    """One line for people (gpu_check's summary row takes it)."""
    ctl = result["control"]
    control = (f" (control: cp_async form {ctl['cp_async']}, plain form {ctl['plain']} reports)"
               if ctl and "error" not in ctl else "")
    def reports(count) -> str:
        return f"{count} report{'' if count == 1 else 's'}"

    shown = "no summary" if result["displayed"] is None else reports(result["displayed"])
    head = (f"{shown}: {result['tools']} the tool's cluster cp.async report{control}, "
            f"{len(result['other'])} other")
    return head if result["ok"] else f"{head}; FAILED: {result['reason']}"


def main(argv=None, control=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="a compute-sanitizer --tool racecheck log (its default report mode)")
    parser.add_argument("--control-dir", type=Path, metavar="DIR",
                        help="where the control is built and its logs kept (default: racecheck_control beside LOG)")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON instead of one line")
    parser.add_argument("--expect-reports", action="store_true",
                        help="the sanitizer exited with its --error-exitcode: a log that shows no report fails")
    args = parser.parse_args(argv)
    try:
        text = args.log.read_text(errors="replace")
    except OSError as exc:
        print(f"racecheck_triage: cannot read {args.log}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    directory = args.control_dir or args.log.parent / "racecheck_control"
    result = triage(text, control or (lambda: run_control(directory)), expect_reports=args.expect_reports)
    print(json.dumps(result, indent=1) if args.json else f"racecheck_triage: {describe(result)}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
