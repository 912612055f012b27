"""The page of the last GPU run, docs/benchmarks/gpu_checks.md, from the logs of scripts/gpu_checks.sh.

    python3 scripts/gpu_checks_page.py OUT_DIR COMMAND PAGE GROUP...

Each group's log OUT_DIR/<group>.log ends with the line "[<group>] rc=<rc> in <s> s" (the script
appends it). The counts come from pytest's last summary line ("364 passed, 2 skipped in 82.1s"); a
group cut by its time box (rc 124) has no summary line, so its counts are the progress characters
pytest printed before it was stopped ('.' passed, 'F' failed, 's' skipped, 'E' error). The sanitizer
group reports compute-sanitizer's "ERROR SUMMARY: <n> errors". Groups without a log were not run.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

COUNTS = ("passed", "failed", "skipped", "errors")
_SUMMARY = re.compile(r"\d+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b.* in [\d.]+s")
_PROGRESS = re.compile(r"^[.FsExX]+(\s+\[\s*\d+%\])?$")


def parse_log(text: str) -> dict:
    """{'rc', 'seconds', 'passed', 'failed', 'skipped', 'errors', 'complete', 'memcheck_errors'}."""
    res = {k: 0 for k in COUNTS} | {"rc": None, "seconds": None, "complete": False, "memcheck_errors": None}
    lines = text.splitlines()
    for line in lines:
        m = re.match(r"^\[[\w-]+\] rc=(-?\d+) in (\d+) s$", line.strip())
        if m:
            res["rc"], res["seconds"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"ERROR SUMMARY: (\d+) error", line)
        if m:
            res["memcheck_errors"] = int(m.group(1))
    summary = [line for line in lines if _SUMMARY.search(line)]
    if summary:
        res["complete"] = True
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary[-1]):
            res["errors" if word.startswith("error") else word] += int(n)
    else:
        for line in lines:
            line = line.strip()
            if line and _PROGRESS.match(line):
                chars = line.split()[0]
                res["passed"] += chars.count(".")
                res["failed"] += chars.count("F")
                res["skipped"] += chars.count("s")
                res["errors"] += chars.count("E")
    return res


def verdict(r: dict) -> str:
    if r["rc"] is None:
        return "no exit line (the script was stopped?)"
    if r["rc"] in (124, 137):
        return f"time box hit (rc {r['rc']}): counts so far"
    if r["memcheck_errors"] is not None:
        return "ok, 0 memcheck errors" if r["rc"] == 0 and r["memcheck_errors"] == 0 else \
            f"FAILED: {r['memcheck_errors']} memcheck errors (rc {r['rc']})"
    if r["rc"] == 0:
        return "ok"
    return f"FAILED (rc {r['rc']})"


def commit() -> str:
    if os.environ.get("INKLING_COMMIT"):
        return os.environ["INKLING_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no .git; set INKLING_COMMIT)"


def machine() -> str:
    try:
        import torch
        import triton
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        return f"{gpu}; torch {torch.__version__}, triton {triton.__version__}"
    except Exception as e:  # the page is still written, with the reason
        return f"unknown ({type(e).__name__}: {e})"


def page(out_dir: Path, command: str, groups: list[str], when: str, where: str, rev: str) -> str:
    rows = ["| group | result | passed | failed | skipped | errors | seconds |", "|---|---|---:|---:|---:|---:|---:|"]
    for g in groups:
        log = out_dir / f"{g}.log"
        if not log.exists():
            rows.append(f"| {g} | not run | - | - | - | - | - |")
            continue
        r = parse_log(log.read_text(errors="replace"))
        counts = " | ".join(str(r[k]) for k in COUNTS) if r["memcheck_errors"] is None else "- | - | - | -"
        rows.append(f"| {g} | {verdict(r)} | {counts} | {r['seconds'] if r['seconds'] is not None else '-'} |")
    return "\n".join([
        "# GPU checks: the last run", "",
        "Written by `scripts/gpu_checks.sh` (through `scripts/gpu_checks_page.py`); each run replaces this page.",
        "The groups and the tests in each are listed at the top of `scripts/gpu_checks.sh`.", "",
        f"Date: {when}. GPU: {where}. Commit: {rev}. Command: `{command}`.", "", *rows, ""])


def main(argv: list[str]) -> None:
    if len(argv) < 4:
        raise SystemExit("usage: gpu_checks_page.py OUT_DIR COMMAND PAGE GROUP...")
    out_dir, command, path, groups = Path(argv[0]), argv[1], Path(argv[2]), argv[3:]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = page(out_dir, command, groups, when, machine(), commit())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
