"""Heartbeats from a rank to its node agent, for hung-rank detection (`dsrun --hang_timeout`).

[Note: heartbeats]
A rank hung in a collective that never completes, or in a deadlocked data
loader, neither exits nor prints; without help it waits for the process
group's timeout (30 min) or for ever. So under dsrun's launcher each rank
tells its node agent that it makes progress, and the agent
(dsrun/launcher/hang.py) fails the job when a rank stops.

The channel is one small file per rank, made by the agent in a directory it
owns and named by DSRUN_HEARTBEAT_FILE. The rank maps it (mmap) and writes
into it with plain memory stores, no system call: a beat is a lock, a
clock read and one struct.pack_into (2.7 us measured on 2 cores under a
load of 34, where an empty Python call took 0.15 us), and a collective
records two, so every collective can beat. The file holds (little-endian;
`HEADER`, `BEAT` and `COLLECTIVE` below):

    header      magic b"DSHB", format version, pid of the rank (0 until it
                registered its stack dump handler), flags (1: exiting, 2: setting up)
    beat        number of beats, last engine step (-1: none), wall time of
                the last beat
    collective  the last collective the rank entered: sequence number (1 for
                the first), op name, group size, message bytes, wall time it
                was entered, wall time it finished (0 while inside)

Beats come from the training's own progress, on the thread that trains:
entering and leaving each of dsrun's collectives (dsrun/runtime/comm/
collectives.py, whose `wait()` counts as leaving an async one), and each
engine forward and step. Never from a timer thread: a thread would go on
beating while the main thread is stuck. The agent reads only whether the
beat count changed; torn reads of the other fields (the writer takes no
lock the reader sees) are retried by `read_heartbeat`.

The first beat is the first collective to *finish*, or the first engine
forward or step; entering a collective beats only after that. A collective
finishes only once every rank of its group reached it, so by the first
beat no rank of the group is still starting up; before it a rank is never
declared hung, however long its own or a peer's start-up (imports, data
set preparation, compilation): the agent cannot tell slow from stuck
there, and the rendezvous has its own timeout. A script that uses neither
dsrun's collectives nor its engine never beats and is never watched. A
phase after the first beat that legitimately runs longer than the timeout
without either (a long evaluation outside the engine, a data set built
after `deepspeed.initialize`, during which the other ranks wait in the
first gradient all-reduce) should call `beat()` now and then, or run with
a larger `--hang_timeout`.

While `deepspeed.initialize` runs (`setting_up`, header flag 2) a rank is
not watched either, even after its first beat: initialize's first
collectives would arm the watch, and what follows them (building the
optimizer, loading a checkpoint on auto-resume) is local work that may
outlast a small timeout while a peer waits in the next collective; a run
on this machine was reported hung so at --hang_timeout 4. The watch starts
again, with a fresh timeout, when initialize returns.

From its exit on (Python's atexit; `start()` registers the hook after
init_distributed's own, so it runs before them) a rank is no longer
watched: its training is over, the interpreter's teardown (torch's
destructors, the process group's) takes seconds on a loaded machine, and
failing a rank then would have `--max_restarts` repeat a finished job. A
rank stuck in its own teardown is therefore not detected.

Stacks: `start()` registers faulthandler for `DUMP_SIGNAL` with
all_threads=True, writing to the file DSRUN_HEARTBEAT_FILE + ".stacks", and
then writes its pid into the header: the agent signals only ranks that did,
since the signal's default action would kill the others. faulthandler
writes from the signal handler in C, so it reports a main thread stuck in
native code (a gloo or NCCL wait) as well. The signal is a real-time one,
not SIGUSR1/SIGUSR2, which Slurm's `--signal`, Lightning and submitit use.

This module must not import torch: the agent reads the files through it.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import mmap
import os
import signal
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from dsrun.env import HEARTBEAT_FILE

MAGIC = b"DSHB"
VERSION = 1
HEADER = struct.Struct("<4sIiI")  # magic, version, pid, flags                        bytes 0-15
BEAT = struct.Struct("<Qqd")  # beats, step, last beat (wall seconds)               bytes 16-39
COLLECTIVE = struct.Struct("<Q32sI4xQdd")  # seq, op, group size, bytes, entered, finished  bytes 40-111
_BEAT_AT = HEADER.size
_COLLECTIVE_AT = _BEAT_AT + BEAT.size
FILE_SIZE = 128
# Signal that makes a rank write every thread's Python stack (see [Note: heartbeats]).
DUMP_SIGNAL = signal.SIGRTMIN + 5
STACKS_SUFFIX = ".stacks"
_OP_BYTES = 32
EXITING = 1  # header flag: the rank has begun to exit
SETTING_UP = 2  # header flag: the rank is inside deepspeed.initialize (see [Note: heartbeats])


def stacks_path(heartbeat_path: str | Path) -> Path:
    """Where the rank owning `heartbeat_path` writes its stacks on `DUMP_SIGNAL`."""
    return Path(str(heartbeat_path) + STACKS_SUFFIX)


def create_heartbeat_file(path: str | Path) -> None:
    """Create an empty channel at `path` (the agent does, before starting the rank): header, zero beats.

    Raises OSError when the file cannot be written.
    """
    data = bytearray(FILE_SIZE)
    HEADER.pack_into(data, 0, MAGIC, VERSION, 0, 0)
    BEAT.pack_into(data, _BEAT_AT, 0, -1, 0.0)
    Path(path).write_bytes(bytes(data))
    stacks_path(path).write_bytes(b"")


@dataclass(frozen=True)
class CollectiveState:
    """The last collective a rank entered.

    Attributes:
        seq: how many collectives the rank had entered, this one included.
        op: op name as dsrun's comms logger counts it (e.g. "all_reduce").
        group_size: ranks in its process group.
        nbytes: message bytes (the comms logger's accounting).
        entered: wall time (time.time(), seconds) the rank entered it.
        finished: wall time it returned (or its async handle's wait did); None while inside.
    """

    seq: int
    op: str
    group_size: int
    nbytes: int
    entered: float
    finished: float | None


@dataclass(frozen=True)
class HeartbeatState:
    """What a rank's heartbeat file says.

    Attributes:
        pid: process that registered the stack dump handler; 0 while none did.
        exiting: the rank has begun to exit (atexit); it is no longer watched.
        setting_up: the rank is inside initialize; not watched until it returns.
        beats: beats so far (0: the rank has not begun to beat).
        step: last engine step the rank reported, None if none.
        last_beat: wall time of the last beat (time.time(), seconds); 0.0 before the first.
        collective: the last collective it entered, None before the first.
    """

    pid: int
    exiting: bool
    setting_up: bool
    beats: int
    step: int | None
    last_beat: float
    collective: CollectiveState | None


def _decode(data: bytes) -> HeartbeatState:
    magic, version, pid, flags = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a dsrun heartbeat file of version {VERSION} (magic {magic!r}, version {version})")
    beats, step, last_beat = BEAT.unpack_from(data, _BEAT_AT)
    seq, op, group, nbytes, entered, finished = COLLECTIVE.unpack_from(data, _COLLECTIVE_AT)
    collective = None
    if seq:
        collective = CollectiveState(seq, op.rstrip(b"\0").decode(errors="replace"), group, nbytes, entered,
                                     finished or None)
    return HeartbeatState(pid, bool(flags & EXITING), bool(flags & SETTING_UP), beats, None if step < 0 else step,
                          last_beat, collective)


def read_heartbeat(path: str | Path, tries: int = 5) -> HeartbeatState:
    """Read a heartbeat file, retrying while a write seems to be under way (two reads differ).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a heartbeat file of this version.
    """
    path = Path(path)
    data = path.read_bytes()
    for _ in range(tries):
        again = path.read_bytes()
        if again == data:
            break
        data = again
    if len(data) != FILE_SIZE:
        raise ValueError(f"{path} holds {len(data)} bytes; a heartbeat file holds {FILE_SIZE}")
    return _decode(data)


class HeartbeatWriter:
    """The rank's side of one heartbeat file: beats and collectives written into a shared mapping.

    Thread-safe (one lock; collectives may be issued from several threads).

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError: the file is not a heartbeat file made by `create_heartbeat_file`.
    """

    def __init__(self, path: str | Path) -> None:
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_size != FILE_SIZE:
                raise ValueError(f"{path} is not a dsrun heartbeat file (size {os.fstat(f.fileno()).st_size}, "
                                 f"expected {FILE_SIZE})")
            self._map = mmap.mmap(f.fileno(), FILE_SIZE)
        _decode(self._map[:FILE_SIZE])  # raises ValueError on a foreign file
        self.path = Path(path)
        self._lock = threading.Lock()
        self._beats, self._step, self._seq = 0, -1, 0
        self._flags = 0

    @property
    def owner(self) -> int:
        """The pid in the header (0: no process claimed the file yet)."""
        return HEADER.unpack_from(self._map, 0)[2]

    def claim(self, pid: int) -> None:
        """Write `pid` into the header: its stack dump handler is registered."""
        with self._lock:
            HEADER.pack_into(self._map, 0, MAGIC, VERSION, pid, self._flags)

    def _set_flag(self, flag: int, on: bool) -> None:
        with self._lock:
            self._flags = self._flags | flag if on else self._flags & ~flag
            HEADER.pack_into(self._map, 0, MAGIC, VERSION, self.owner, self._flags)

    def exiting(self) -> None:
        """Mark the rank as exiting: the agent stops watching it."""
        self._set_flag(EXITING, True)

    def setting_up(self, on: bool) -> None:
        """Mark the rank as inside initialize (`on`), or out of it: not watched meanwhile."""
        self._set_flag(SETTING_UP, on)

    def beat(self, step: int | None = None) -> None:
        """One beat; `step` (engine step >= 0) replaces the reported step when given."""
        with self._lock:
            self._beat(step)

    def _beat(self, step: int | None = None) -> None:
        self._beats += 1
        if step is not None:
            self._step = step
        BEAT.pack_into(self._map, _BEAT_AT, self._beats, self._step, time.time())

    def entered(self, op: str, group_size: int, nbytes: int) -> int:
        """Record entering collective `op`, and beat unless this rank has not beaten yet (the first beat
        is a finished collective or an engine call, see [Note: heartbeats]); returns its sequence number
        for `finished`."""
        with self._lock:
            self._seq += 1
            COLLECTIVE.pack_into(self._map, _COLLECTIVE_AT, self._seq, op.encode()[:_OP_BYTES], group_size,
                                 nbytes, time.time(), 0.0)
            if self._beats:
                self._beat()
            return self._seq

    def finished(self, seq: int) -> None:
        """Record that collective `seq` returned (and beat); a later one's record is left as it is."""
        with self._lock:
            if seq == self._seq:
                struct.pack_into("<d", self._map, _COLLECTIVE_AT + COLLECTIVE.size - 8, time.time())
            self._beat()

    def close(self) -> None:
        """Unmap the file."""
        self._map.close()


class _Channel:
    """This process's heartbeat channel, opened by `start`."""

    writer: HeartbeatWriter | None = None
    started = False  # start() ran (whether or not it opened a channel)
    stacks = None  # the open stacks file faulthandler writes to


def start() -> bool:
    """Open the heartbeat channel named by DSRUN_HEARTBEAT_FILE and register the stack dump handler.

    Called by init_distributed, and on the first beat otherwise; later calls
    do nothing. Returns whether this process beats. Nothing happens when the
    variable is unset (not under dsrun's launcher, or --hang_timeout 0), or
    when another process (the rank itself, if this is a process the rank
    spawned) already claimed the file. A file that cannot be used is
    reported as a warning, never an error: training goes on unwatched.
    """
    if _Channel.started:
        return _Channel.writer is not None
    _Channel.started = True
    path = HEARTBEAT_FILE.read()
    if path is None:
        return False
    try:
        writer = HeartbeatWriter(path)
        if writer.owner != 0:
            writer.close()
            return False
        _Channel.stacks = open(stacks_path(path), "a")
        faulthandler.register(DUMP_SIGNAL, file=_Channel.stacks, all_threads=True)
    except (OSError, ValueError) as exc:
        warnings.warn(f"dsrun: no heartbeat to the launcher's agent ({exc}); a hang of this rank will not be "
                      "detected", RuntimeWarning, stacklevel=2)
        return False
    writer.claim(os.getpid())
    _Channel.writer = writer
    atexit.register(_exiting)
    return True


def _exiting() -> None:
    """At interpreter exit: stop being watched (see [Note: heartbeats])."""
    writer = _Channel.writer
    if writer is not None:
        writer.exiting()


def _forget_in_child() -> None:
    """After fork: the child (a data loader worker) must not beat for the rank."""
    _Channel.writer = None


os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def setting_up():
    """Context (and decorator) around `deepspeed.initialize`: the agent does not watch the rank
    inside it (see [Note: heartbeats]); nested uses keep the outermost's extent."""
    writer = _Channel.writer
    if writer is None and not _Channel.started and start():
        writer = _Channel.writer
    if writer is None or writer._flags & SETTING_UP:
        yield
        return
    writer.setting_up(True)
    try:
        yield
    finally:
        writer.setting_up(False)


def beat(step: int | None = None) -> None:
    """Tell the agent this rank makes progress; `step`: the engine step reached. Cheap when not watched."""
    writer = _Channel.writer
    if writer is None and not _Channel.started and start():
        writer = _Channel.writer
    if writer is not None:
        writer.beat(step)


def collective_entered(op: str, group_size: int, nbytes: int) -> int:
    """Record entering collective `op` over `group_size` ranks, `nbytes` message bytes (a beat).

    Returns the number to pass to `collective_finished` (0 when not watched).
    """
    writer = _Channel.writer
    if writer is None and not _Channel.started and start():
        writer = _Channel.writer
    return writer.entered(op, group_size, nbytes) if writer is not None else 0


def collective_finished(seq: int) -> None:
    """Record that the collective numbered `seq` returned (a beat)."""
    writer = _Channel.writer
    if writer is not None:
        writer.finished(seq)
