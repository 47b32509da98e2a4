"""Live training progress on the launcher's terminal, fed by rank 0.

[Note: progress records]
Under dsrun's launcher every rank gets DSRUN_PROGRESS=1. The engine on
global rank 0 then prints, at most twice a second, one *progress record* on
its stdout: a line that starts with `RECORD_MARK` followed by a JSON object
(step, total, loss, lr, samples_per_s, tokens_per_s; absent fields are
unknown). Records travel with the rank's other output (agent, SSH channel)
and the head takes them out of the stream: they are never printed as
text. On a terminal the head keeps a rich progress bar at the bottom of the
screen and prints every other rank line above it, so prefixed lines stay
whole; when its stdout is not a terminal (a log file, CI) it prints a plain
`dsrun: progress ...` line at most every `plain_interval` seconds instead.
Run without dsrun's launcher (torchrun, a single process), DSRUN_PROGRESS
is unset and the engine prints no records.

This module must not import torch: the head and the agents import it.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, BinaryIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from dsrun.env import PROGRESS, PROGRESS_INTERVAL

PROGRESS_ENV = PROGRESS.name  # set to "1" by the launcher (dsrun/launcher/env.py)
# Printable on purpose: Python's str.splitlines() breaks lines at control characters such as \x1e.
RECORD_MARK = "@@dsrun-progress@@ "
_MARK_BYTES = RECORD_MARK.encode()


def progress_enabled() -> bool:
    """True in a rank started by dsrun's launcher (DSRUN_PROGRESS=1)."""
    return PROGRESS.read()


def encode_record(record: dict[str, Any]) -> str:
    """One progress record as a line (no newline): RECORD_MARK + compact JSON."""
    return RECORD_MARK + json.dumps(record, separators=(",", ":"))


def decode_record(line: bytes) -> dict[str, Any] | None:
    """The record in a relayed rank-0 output line (`[rank 0] <record>`), else None.

    Lines of other ranks and malformed records are None (then printed as
    ordinary output)."""
    at = line.find(_MARK_BYTES)
    if at < 0 or not line.startswith(b"[rank 0] "):
        return None
    try:
        record = json.loads(line[at + len(_MARK_BYTES):])
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def format_record(record: dict[str, Any]) -> str:
    """The plain one-line form: "step 120/400 (30%)  loss 2.3456  lr 3.00e-03  1,234 samples/s ..."."""
    step, total = record.get("step", 0), record.get("total")
    head = f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"
    return "  ".join([head, *_metrics(record)])


def _metrics(record: dict[str, Any]) -> list[str]:
    """The figures of a record other than the step, as short texts."""
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.2e}")
    if record.get("samples_per_s") is not None:
        parts.append(f"{record['samples_per_s']:,.1f} samples/s")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    return parts


class ProgressDisplay:
    """The head's view of rank 0's progress records (see [Note: progress records]).

    Args:
        out: the head's stdout (binary); live display when it is a terminal.
        console: where the live bar is drawn (default: a Console on `out`).
        plain_interval: seconds between plain lines when not live
            (default DSRUN_PROGRESS_INTERVAL or 10).

    Thread-safe: the head's output pumps call `consume` and `write` from
    several threads.
    """

    def __init__(self, out: BinaryIO, console: Console | None = None,
                 plain_interval: float | None = None) -> None:
        self._out = out
        self._console = console
        self.live = console.is_terminal if console is not None else _isatty(out)
        if plain_interval is None:
            plain_interval = PROGRESS_INTERVAL.read()
        self._interval = plain_interval
        self._lock = threading.RLock()
        self._progress: Progress | None = None
        self._task = None
        self._last_plain = float("-inf")
        self.last: dict[str, Any] | None = None

    def consume(self, line: bytes) -> bool:
        """Take `line` if it is a progress record (True: do not print it)."""
        if _MARK_BYTES not in line:
            return False
        record = decode_record(line)
        if record is None:
            return False
        with self._lock:
            self.last = record
            if self.live:
                self._update_bar(record)
            elif time.monotonic() - self._last_plain >= self._interval:
                self._last_plain = time.monotonic()
                self._write_raw(self._out, f"dsrun: progress {format_record(record)}\n".encode())
        return True

    def write(self, sink: BinaryIO, data: bytes) -> None:
        """Write relayed output to `sink`: above the live bar when one is drawn
        and `sink` is the terminal (stdout, or stderr on a terminal), else as is."""
        with self._lock:
            if self._progress is not None and (sink is self._out or _isatty(sink)):
                self._progress.console.print(data.decode(errors="replace").rstrip("\r\n"),
                                             markup=False, highlight=False, soft_wrap=True)
            else:
                self._write_raw(sink, data)

    def stop(self) -> None:
        """Remove the live bar (its last state stays on screen) and print the last record."""
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None

    def _update_bar(self, record: dict[str, Any]) -> None:
        if self._progress is None:
            console = self._console or Console(file=_TextOut(self._out), force_terminal=True)
            self._progress = Progress(
                TextColumn("[bold]rank 0"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[text]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=console, transient=False, redirect_stdout=False, redirect_stderr=False)
            self._task = self._progress.add_task("train", total=record.get("total"), text="")
            self._progress.start()
        self._progress.update(self._task, completed=record.get("step", 0), total=record.get("total"),
                              text="  ".join(_metrics(record)))

    @staticmethod
    def _write_raw(sink: BinaryIO, data: bytes) -> None:
        try:
            sink.write(data)
            sink.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # whoever reads dsrun's output went away


def _isatty(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class _TextOut:
    """A text file over the head's binary stdout, for rich."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out

    def write(self, text: str) -> int:
        self._out.write(text.encode())
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def isatty(self) -> bool:
        return True
