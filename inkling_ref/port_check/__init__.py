"""The port checker: feed it what an engine's MTP depths computed (a dump), get back which depth is
wrong, where it first diverges and which known porting mistake reproduces it (docs/port_checker.md).

    dump.py         the dump format: DumpRecorder (what a port adds to its draft loop), read_dump
    schedule.py     the steps of a dump and the rules its fields obey
    head_loader.py  load_head: only the MTP head, the embedding, its norm, the final norm and the LM head
    recompute.py    every dump row recomputed by the reference (correct), or along the engine's schedule
    pitfalls.py     the known mistakes of docs/pitfalls.md as variants of that recomputation
    check.py        check_dump -> report.Report (pass/fail, per depth, first divergence, diagnosis)
    capture.py      capture_reference: a dump written by the reference cycle (or a mutant of it)

    head = load_head(checkpoint_dir, num_depths=k)
    report = check_dump(head, read_dump("dump.safetensors"))
    print(report.render())
"""

from .capture import capture_reference
from .check import TOLERANCE, check_dump
from .dump import DumpError, DumpRecorder, PortDump, read_dump
from .head_loader import MTPHeadModel, load_head
from .pitfalls import KNOWN_MISTAKES
from .report import Report

__all__ = ["DumpError", "DumpRecorder", "KNOWN_MISTAKES", "MTPHeadModel", "PortDump", "Report", "TOLERANCE",
           "capture_reference", "check_dump", "load_head", "read_dump"]
