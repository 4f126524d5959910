"""scripts/racecheck_triage.py on racecheck logs in the tool's format (lines as CUDA 13.0's compute-sanitizer wrote
them on an H200): only races between cp_async16 and st_cluster_f2 writes pass, only while the control shows the
tool's behaviour, and every count must add up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import racecheck_triage  # noqa: E402

CP_ASYNC = ("void marlin_convert::detail::cp_async16<(bool)0>(void *, const void *, bool)+0x{pc:x} in "
            "marlin_gemm_impl.cuh:109")
PUSH = "marlin_convert::detail::st_cluster_f2(unsigned int, unsigned int, float2)+0x{pc:x} in marlin_gemm_impl.cuh:235"
OTHER_SITE = "void marlin_convert::detail::marlin_gemm_kernel<...>(...)+0x{pc:x} in marlin_gemm_impl.cuh:1380"


def race(first: tuple[str, str], *rest: tuple[str, str], level: str = "Error", pc: int = 0x1620) -> str:
    """A report in racecheck's analysis form: (access, site) pairs, a host backtrace, a blank line."""
    lines = [f"========= {level}: Race reported between {first[0]} access at {first[1].format(pc=pc)}"]
    lines += [f"=========     and {access} access at {site.format(pc=pc + 16 * i)} [512 hazards]"
              for i, (access, site) in enumerate(rest)]
    lines += ["=========     Saved host backtrace up to driver entry point at kernel launch time",
              "=========         Host Frame:  [0x13a51] in libcudart.so.13", "========= "]
    return "\n".join(lines)


def log(*reports: str, errors: int | None = None, warnings: int = 0, summary: bool = True) -> str:
    count = len(reports)
    errors = count - warnings if errors is None else errors
    tail = [f"========= RACECHECK SUMMARY: {count} hazard{'s' if count != 1 else ''} displayed ({errors} error"
            f"{'s' if errors != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''})"] if summary else []
    return "\n".join(["========= COMPUTE-SANITIZER", *reports, "sanitize_kernel: 40 calls, 0 wrong", *tail]) + "\n"


TOOLS = race(("Write", CP_ASYNC), ("Write", PUSH))
SHOWN = {"cp_async": 65, "plain": 0}


def never():
    raise AssertionError("the control ran although the log needs none")


def test_only_the_tools_reports_pass_and_only_while_the_control_shows_them():
    text = log(TOOLS, race(("Write", CP_ASYNC), ("Write", PUSH), ("Write", PUSH), pc=0x1680))
    result = racecheck_triage.triage(text, lambda: dict(SHOWN))
    assert result["ok"] and result["tools"] == 2 and result["other"] == [] and result["displayed"] == 2
    assert racecheck_triage.describe(result) == \
        "2 reports: 2 the tool's cluster cp.async report (control: cp_async form 65, plain form 0 reports), 0 other"
    one = racecheck_triage.triage(log(TOOLS), lambda: dict(SHOWN))
    assert racecheck_triage.describe(one).startswith("1 report: 1 the tool's")
    for control in ({"cp_async": 0, "plain": 0}, {"cp_async": 65, "plain": 3}, {"error": "nvcc is not on PATH"}):
        result = racecheck_triage.triage(text, lambda control=control: control)
        assert not result["ok"], control
        assert "FAILED" in racecheck_triage.describe(result)


@pytest.mark.parametrize("report", [
    race(("Write", CP_ASYNC), ("Write", OTHER_SITE)),           # a cp.async against an ordinary store
    race(("Read", PUSH.replace("st_cluster_f2", "ld_shared")), ("Write", PUSH)),
    race(("Write", CP_ASYNC), ("Write", CP_ASYNC)),              # two copies: no cluster store in it
    race(("Write", PUSH), ("Write", PUSH)),
    race(("Read", CP_ASYNC), ("Write", PUSH)),                   # not write against write
    race(("Write", CP_ASYNC), ("Write", PUSH), ("Read", OTHER_SITE)),
    "========= Error: Potential WAW hazard detected (invalid memcpy_async synchronization) at __shared__ 0x9000 in "
    "block (4,0,0) :",                                            # the per-hazard form: not read as the tool's
])
def test_any_other_report_fails_and_is_named_even_beside_the_tools(report):
    result = racecheck_triage.triage(log(TOOLS, report), lambda: dict(SHOWN))
    assert not result["ok"] and len(result["other"]) == 1
    assert result["other"][0] == report.splitlines()[0].removeprefix("========= ")
    assert "not of the tool's kind" in result["reason"]


@pytest.mark.parametrize("site", [
    "void marlin_convert::detail::marlin_gemm_kernel<...>(...)+0x5a0 [12 hazards]",  # a function without line info
    "0x5a0 in marlin_gemm_impl.cuh:1380 [12 hazards]",                                # no function
])
@pytest.mark.parametrize("access", ["Read", "Write"])
def test_a_further_site_the_parser_cannot_read_is_not_dropped(site, access):
    # the tool's two sites and a third one _AND does not read: the report must not pass as the tool's
    lines = TOOLS.splitlines()
    lines.insert(2, f"=========     and {access} access at {site}")
    result = racecheck_triage.triage(log("\n".join(lines)), lambda: dict(SHOWN))
    assert not result["ok"] and result["tools"] == 0 and len(result["other"]) == 1
    assert "not of the tool's kind" in result["reason"]


@pytest.mark.parametrize("first, second", [
    (CP_ASYNC.replace("cp_async16<", "cp_async16_zfill<"), PUSH),               # another function, a longer name
    (CP_ASYNC.replace("detail::cp_async16", "detail::not_cp_async16"), PUSH),
    (CP_ASYNC, PUSH.replace("st_cluster_f2(", "st_cluster_f2x4(")),
    ("void marlin_convert::detail::marlin_gemm_kernel<&marlin_convert::detail::cp_async16<(bool)0>>(int)+0x{pc:x} in "
     "marlin_gemm_impl.cuh:1380", PUSH),                                         # the name among template arguments
    (CP_ASYNC.replace("marlin_convert::detail::", "other::"), PUSH),             # another namespace's cp_async16
])
def test_a_site_in_a_function_that_only_mentions_the_names_is_not_the_tools(first, second):
    result = racecheck_triage.triage(log(race(("Write", first), ("Write", second))), lambda: dict(SHOWN))
    assert not result["ok"] and result["tools"] == 0 and len(result["other"]) == 1


def test_a_clean_log_passes_without_the_control():
    result = racecheck_triage.triage(log(), never)
    assert result["ok"] and result["tools"] == 0 and result["control"] is None


def test_counts_that_do_not_add_up_fail():
    max_reached = ("========= Warning: Maximum number of hazards reached. Environment variable "
                   "NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS can be used to increase this count.")
    # the tool stopped recording: a warning that is no race report (and so counts as another report)
    assert not racecheck_triage.triage(log(TOOLS, max_reached, warnings=1), lambda: dict(SHOWN))["ok"]
    # 100 displayed of 1026 errors (racecheck's per-hazard form): the displayed ones are not all there were
    assert not racecheck_triage.triage(log(TOOLS, errors=1026), lambda: dict(SHOWN))["ok"]
    # a report the parser missed (a summary of 2 over one report read)
    text = log(TOOLS).replace("1 hazard displayed (1 error", "2 hazards displayed (2 errors")
    assert "2 reports" in racecheck_triage.triage(text, lambda: dict(SHOWN))["reason"]
    # a run that never finished
    assert "no RACECHECK SUMMARY" in racecheck_triage.triage(log(TOOLS, summary=False), never)["reason"]


def test_a_log_of_several_processes_adds_up_their_summaries():
    # two processes under one sanitizer, each with its report and its summary: the tool's both, the log passes
    assert racecheck_triage.triage(log(TOOLS) + log(TOOLS), lambda: dict(SHOWN))["ok"]
    # the first process's summary counts a report no line shows: the sum is not the reports read
    text = log(TOOLS).replace("1 hazard displayed (1 error", "2 hazards displayed (2 errors") + log(TOOLS, TOOLS)
    assert not racecheck_triage.triage(text, lambda: dict(SHOWN))["ok"]


def test_a_summary_quoted_by_the_program_is_not_the_sanitizers():
    # the run stopped before the sanitizer's summary; the program's output quotes an earlier run's
    text = log(TOOLS, summary=False) + "earlier run: RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n"
    assert "no RACECHECK SUMMARY" in racecheck_triage.triage(text, never)["reason"]


@pytest.mark.parametrize("line", [
    "========= Internal Sanitizer Error: The Sanitizer encountered an error while tracking shared memory accesses",
    "========= Target application returned an error",
])
def test_a_run_in_which_the_sanitizer_or_the_program_failed_does_not_pass(line):
    # neither is a hazard (the summary does not count it), so read as a report it could not be: it was skipped
    result = racecheck_triage.triage(log(TOOLS, line).replace("2 hazards displayed (2 errors", "1 hazard displayed "
                                                                "(1 error"), lambda: dict(SHOWN))
    assert not result["ok"] and line.removeprefix("========= ") in result["reason"]


def test_the_command_line_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "good.log", tmp_path / "bad.log"
    good.write_text(log(TOOLS))
    bad.write_text(log(race(("Write", CP_ASYNC), ("Write", OTHER_SITE))))
    assert racecheck_triage.main([str(good)], control=lambda: dict(SHOWN)) == 0
    assert racecheck_triage.main([str(bad)], control=lambda: dict(SHOWN)) == 1
    assert racecheck_triage.main([str(good), "--json"], control=lambda: {"cp_async": 0, "plain": 0}) == 1
    assert '"ok": false' in capsys.readouterr().out
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "racecheck_triage.py"), str(tmp_path / "missing")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "cannot read" in done.stderr


def test_without_the_tools_the_control_is_an_error_not_a_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither nvcc nor compute-sanitizer
    assert racecheck_triage.run_control(tmp_path / "control") == {"error": "nvcc is not on PATH"}
    assert not (tmp_path / "control").exists()  # (no empty folder left beside the log)
    path = tmp_path / "r.log"
    path.write_text(log(TOOLS))
    assert racecheck_triage.main([str(path), "--control-dir", str(tmp_path / "c")]) == 1


def _fake_tools(tmp_path, logs: dict) -> None:
    """nvcc that 'builds' an empty file and a compute-sanitizer that prints logs[form] and the control's last line."""
    for form, text in logs.items():
        (tmp_path / f"{form}.txt").write_text(text)
    (tmp_path / "nvcc").write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done; : > "$2"\n')
    (tmp_path / "compute-sanitizer").write_text(
        f'#!/bin/sh\nform=$4\ncat "{tmp_path}/$form.txt"\necho "racecheck_cluster_control $form: no error"\n')
    for tool in ("nvcc", "compute-sanitizer"):
        (tmp_path / tool).chmod(0o755)


@pytest.mark.parametrize("plain", [
    # racecheck's per-hazard form: no 'Race reported' line, so no sites
    "========= Error: Potential WAW hazard detected at __shared__ 0x9000 in block (4,0,0) :\n"
    "=========     Write Thread (0,0,0) at fill_then_push(const int4 *, float *, int)+0x1680 in c.cu:60\n"
    "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n",
    # hazards counted in the summary that no line shows
    "========= RACECHECK SUMMARY: 0 hazards displayed (3 errors, 0 warnings)\n",
    # no summary: the run did not finish
    "========= COMPUTE-SANITIZER\n",
])
def test_a_plain_control_form_with_hazards_of_any_shape_is_not_clean(tmp_path, monkeypatch, plain):
    shown = "\n".join(race(("Write", "fill_then_push(const int4 *, float *, int)+0x{pc:x} in c.cu:60"),
                             ("Write", "fill_then_push(const int4 *, float *, int)+0x{pc:x} in c.cu:80"))
                        for _ in range(3)) + "\n========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)\n"
    _fake_tools(tmp_path, {"cp_async": shown, "plain": plain})
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    control = racecheck_triage.run_control(tmp_path / "control")
    assert "error" in control or control["plain"] != 0, control
    assert not racecheck_triage.triage(log(TOOLS), lambda: control)["ok"]


def test_the_control_of_the_tools_behaviour_passes_with_fake_tools(tmp_path, monkeypatch):
    shown = race(("Write", "fill_then_push(const int4 *, float *, int)+0x{pc:x} in c.cu:60"),
                 ("Write", "fill_then_push(const int4 *, float *, int)+0x{pc:x} in c.cu:80"))
    clean = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    _fake_tools(tmp_path, {"cp_async": log(shown), "plain": clean})
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert racecheck_triage.run_control(tmp_path / "control") == {"cp_async": 1, "plain": 0}


@pytest.mark.parametrize("line", [
    # a CUDA API error the sanitizer reports in any tool: no hazard, not in the RACECHECK SUMMARY
    "========= Program hit cudaErrorInvalidValue (error 1) due to \"invalid argument\" on CUDA API call to cudaMemcpy.",
    "========= Some line of a newer sanitizer this script has not seen",
])
def test_a_sanitizer_line_of_a_form_the_triage_does_not_read_fails(line):
    result = racecheck_triage.triage(log(TOOLS).replace("sanitize_kernel:", line + "\nsanitize_kernel:"),
                                     lambda: dict(SHOWN))
    assert not result["ok"] and line.removeprefix("========= ") in result["reason"]
    # the same log without it passes: the forms the tool writes (backtrace, frames, blank margin) are all read
    assert racecheck_triage.triage(log(TOOLS), lambda: dict(SHOWN))["ok"]


def test_a_further_site_after_a_line_of_the_programs_output_is_not_dropped():
    # stdout and stderr share the log: a program line between a report's sites closed the report, and its third site
    # (a Read in another function) was passed over, leaving the tool's two sites to pass
    lines = race(("Write", CP_ASYNC), ("Write", PUSH), ("Read", OTHER_SITE)).splitlines()
    lines.insert(2, "   12 float16 b4 zp=True m=100 k=512 n=512")
    result = racecheck_triage.triage(log("\n".join(lines)), lambda: dict(SHOWN))
    assert not result["ok"] and "and Read access at" in result["reason"]


def test_a_clean_log_fails_where_the_sanitizers_exit_status_said_it_found_errors(tmp_path):
    # gpu_check asks on racecheck's exit 3: a log with no report means something the triage cannot see made that exit
    result = racecheck_triage.triage(log(), never, expect_reports=True)
    assert not result["ok"] and "exit status" in result["reason"]
    assert racecheck_triage.triage(log(TOOLS), lambda: dict(SHOWN), expect_reports=True)["ok"]
    path = tmp_path / "clean.log"
    path.write_text(log())
    assert racecheck_triage.main([str(path)], control=never) == 0
    assert racecheck_triage.main([str(path), "--expect-reports"], control=never) == 1
    assert "--expect-reports" in (REPO / "scripts" / "gpu_check.sh").read_text()


def test_a_control_that_hangs_is_an_error_not_a_wait_without_end(tmp_path, monkeypatch):
    # gpu_check has no time limit around the triage: a control stuck under racecheck (a cluster barrier that never
    # completes) would hold it for ever
    _fake_tools(tmp_path, {"cp_async": "", "plain": ""})
    (tmp_path / "compute-sanitizer").write_text("#!/bin/sh\nexec sleep 30\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(racecheck_triage, "CONTROL_TIMEOUT_S", 1)
    control = racecheck_triage.run_control(tmp_path / "control")
    assert "ran past 1 s" in control.get("error", ""), control
