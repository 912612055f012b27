"""Argument types of the command line: each parses one flag's text or says, in one line, what would
be valid (argparse turns that into `inkling-mtp COMMAND: error: argument --flag: ...`, exit 2)."""

from __future__ import annotations

import argparse
import math
import os
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte (examples: 5GB, 512MiB, 1000000)")
    return size


def integer(lo: int):
    """argparse type: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return v
    return parse


def depth_count(text: str):
    """argparse type of --k: "auto" or an integer >= 0."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 or auto, got {text!r}")
    return v


def max_threads() -> int:
    """The most CPU threads `--threads` accepts: the CPUs this process may run on. More threads than
    CPUs only make torch's workers wait for each other (and thousands of them exhaust the machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads(text: str) -> int:
    """argparse type of --threads: an integer from 1 to max_threads()."""
    hi = max_threads()
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not 1 <= v <= hi:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {hi} (the CPUs of this machine), "
                                         f"got {text!r}")
    return v


def path(text: str) -> str:
    """argparse type of a file or directory: any non-empty text (an empty one would silently mean the
    current directory, or the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"an empty path ({text!r}): give a directory")
    return text


def utf8_text(text: str) -> str:
    """argparse type of text that is tokenized: it must be valid UTF-8. Python hands over the bytes of
    an argument that is not as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text (byte 0x{bad.hex()} at character {e.start}): "
                                         "pass text in UTF-8, or token ids with --prompt-ids") from None
    return text


def number(lo: float, hi: float = math.inf, lo_open: bool = False):
    """argparse type: a finite number in [lo, hi] ((lo, hi] with lo_open). NaN and infinity are refused:
    they would pass no check downstream and sample garbage."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi < math.inf else f">= {lo:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {'in ' if hi < math.inf else ''}"
                                             f"{interval}, got {text!r}")
        return v
    return parse
