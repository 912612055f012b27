"""scripts/gpu_checks_page.py: the page of the last GPU run, from the logs gpu_checks.sh writes."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_checks_page.py"
spec = importlib.util.spec_from_file_location("gpu_checks_page", SCRIPT)
gcp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gcp)

DONE = "....s...F.......E..s [ 40%]\n.........................s [100%]\n" \
       "FAILED tests/x.py::test_a\n1 failed, 40 passed, 3 skipped, 1 error, 2 warnings in 82.10s (0:01:22)\n" \
       "[fast1] rc=1 in 83 s\n"
CUT = "........s.... [ 10%]\n..F.. [ 20%]\n[engine] rc=124 in 540 s\n"
SANITIZER = "========= ERROR SUMMARY: 0 errors\nOK\n[sanitizer] rc=0 in 120 s\n"


def test_parse_log_counts_the_summary_line_or_the_progress():
    r = gcp.parse_log(DONE)
    assert (r["passed"], r["failed"], r["skipped"], r["errors"], r["rc"], r["seconds"]) == (40, 1, 3, 1, 1, 83)
    assert r["complete"] and gcp.verdict(r) == "FAILED (rc 1)"
    r = gcp.parse_log(CUT)                     # cut by the time box: the progress characters so far
    assert (r["passed"], r["failed"], r["skipped"], r["complete"]) == (16, 1, 1, False)
    assert gcp.verdict(r).startswith("time box hit")
    r = gcp.parse_log(SANITIZER)
    assert r["memcheck_errors"] == 0 and gcp.verdict(r) == "ok, 0 memcheck errors"
    assert gcp.parse_log("3 passed in 1.00s\n[cli] rc=0 in 2 s\n")["passed"] == 3


def test_page_lists_every_group(tmp_path):
    (tmp_path / "fast1.log").write_text(DONE)
    (tmp_path / "sanitizer.log").write_text(SANITIZER)
    text = gcp.page(tmp_path, "bash scripts/gpu_checks.sh OUT", ["fast1", "attention", "sanitizer"],
                    "2030-01-01 00:00 UTC", "Some GPU", "abc1234")
    assert "Date: 2030-01-01 00:00 UTC. GPU: Some GPU. Commit: abc1234." in text
    assert "| fast1 | FAILED (rc 1) | 40 | 1 | 3 | 1 | 83 |" in text
    assert "| attention | not run | - | - | - | - | - |" in text
    assert "| sanitizer | ok, 0 memcheck errors | - | - | - | - | 120 |" in text
