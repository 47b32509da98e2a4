"""How the ranks of one checkpoint call agree, through the rendezvous store, never a collective.

`Rendezvous` (arrival and per-phase agreement, see [Note: arrival check]),
`raise_unless_all` (one failure fails every rank) and `agree_on_location`
(one directory and tag for every rank, see [Note: agreed location]).
"""
from __future__ import annotations

import json
import logging
import os
import time

from dsrun.env import CKPT_BARRIER_TIMEOUT, CKPT_TIMEOUT, STRICT_CONFIG
from dsrun.runtime import comm
from dsrun.runtime.checkpoint.store import CheckpointError
from dsrun.runtime.config import STRICT_ENV, DsConfig
from dsrun.runtime.distributed.dist import Topology

log = logging.getLogger("dsrun.checkpoint")

# Seconds a save/load waits for every rank to arrive before it fails (instead
# of hanging when called on some ranks only). DSRUN_CKPT_BARRIER_TIMEOUT overrides.
ARRIVAL_TIMEOUT_S = CKPT_BARRIER_TIMEOUT.read()
# Seconds a rank waits for the others to finish writing (a dead rank makes the
# others fail after this). DSRUN_CKPT_TIMEOUT overrides.
COMMIT_TIMEOUT_S = CKPT_TIMEOUT.read()

_generations: dict[str, int] = {}


class _Backoff:
    """Sleeps between polls of the store: 0.1 ms at first, doubling to 5 ms,
    so that ranks arriving together agree in well under a millisecond (an
    asynchronous save's call waits on two agreements) without a busy loop
    when one rank is slow."""

    def __init__(self):
        self.delay = 1e-4

    def __call__(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.005)


class Rendezvous:
    """Agreement among the ranks of one checkpoint call, through the rendezvous
    store, never through a collective.

    [Note: arrival check]
    A collective cannot time out on every rank (gloo's monitored_barrier
    bounds the wait on rank 0 only; NCCL has nothing), and an asynchronous
    save must not issue collectives from its thread while training issues
    its own. So ranks agree through the key-value store torch.distributed was
    initialised with (its TCPStore), under keys naming the call, the step and
    a per-process generation (repeated calls stay apart); not the tag, which
    the ranks only agree on afterwards (`agree_on_location`):

    - arrival: every rank adds 1 to a counter and polls it until it reaches
      the world size. After `arrival_timeout` seconds a rank takes its 1 back (so a
      later, matched call is not miscounted) and raises; if the count was
      complete at that moment, it proceeds.
    - `agree(step, ok, report)`: every rank publishes (success, a string:
      after writing, its file's size and checksum as JSON) and
      waits up to `commit_timeout` seconds for all the others: a rank that died (or
      hangs in I/O) makes the others raise, naming it, instead of waiting
      forever.

    A single process (world size 1, or torch.distributed not initialised)
    agrees with itself. Raises CheckpointError.
    """

    def __init__(self, topology: Topology, what: str, step: int, tag: str | None,
                 arrival_timeout: float = ARRIVAL_TIMEOUT_S, commit_timeout: float = COMMIT_TIMEOUT_S):
        self.what = what
        self.rank, self.world = topology.rank, topology.world_size
        self.arrival_timeout, self.commit_timeout = arrival_timeout, commit_timeout
        self.store = None
        if self.world == 1 or not comm.is_initialized():
            return
        from torch.distributed import distributed_c10d

        self.store = distributed_c10d._get_default_store()
        base = f"dsrun/ckpt/{what}/{step}"
        generation = _generations.get(base, 0)
        _generations[base] = generation + 1
        self.base = f"{base}/{generation}"
        self._arrive(tag, step)

    def _arrive(self, tag: str | None, step: int) -> None:
        key = f"{self.base}/arrived"
        count = self.store.add(key, 1)
        deadline = time.monotonic() + self.arrival_timeout
        pause = _Backoff()
        while count < self.world:
            if time.monotonic() > deadline:
                count = self.store.add(key, -1)
                if count + 1 >= self.world:  # the last rank arrived just now: go on
                    self.store.add(key, 1)
                    return
                raise CheckpointError(f"{self.what} must be called on every rank: only {count + 1} of "
                                      f"{self.world} ranks called it (tag {tag!r}, step {step}) within "
                                      f"{self.arrival_timeout:g} s")
            pause()
            count = self.store.add(key, 0)

    def agree(self, step: str, ok: bool, report: str = "") -> list[tuple[bool, str]]:
        """Every rank's (success, report) for `step`, in rank order."""
        if self.store is None:
            return [(ok, report)]
        keys = [f"{self.base}/{step}/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], f"{int(ok)}:{report}")
        deadline = time.monotonic() + self.commit_timeout
        pause = _Backoff()
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise CheckpointError(f"{self.what}: rank(s) {missing} did not report within "
                                      f"{self.commit_timeout:g} s ({step}); did they die?")
            pause()
        out = []
        for key in keys:
            flag, _, report = self.store.get(key).decode().partition(":")
            out.append((flag == "1", report))
        return out


def raise_unless_all(results: list[tuple[bool, str]], error: BaseException | None, what: str) -> None:
    if error is not None:
        raise error
    bad = [r for r, (ok, _) in enumerate(results) if not ok]
    if bad:
        reports = "; ".join(f"rank {r}: {results[r][1]}" for r in bad if results[r][1])
        raise CheckpointError(f"{what} failed on rank(s) {bad}" + (f": {reports}" if reports else
                                                                   " (their own error is raised there)"))


# How a rank wants a difference between ranks' directories or tags handled,
# mildest first; the strictest any rank asks for applies.
_HANDLING = ("ignore", "warn", "error")


def _handling(config: DsConfig) -> dict[str, str]:
    """This rank's handling of a differing directory ("dir") and tag: "error"
    under DSRUN_STRICT_CONFIG=1 or `checkpoint.strict_paths`; a tag also
    follows DeepSpeed's `checkpoint.tag_validation` ("Fail": error,
    "Ignore": no warning); otherwise "warn"."""
    strict = config.checkpoint.strict_paths or STRICT_CONFIG.read()
    tag = {"Fail": "error", "Ignore": "ignore"}.get(config.checkpoint.tag_validation, "warn")
    return {"dir": "error" if strict else "warn", "tag": "error" if strict else tag}


def agree_on_location(rdv: Rendezvous, config: DsConfig, dir_arg: str, directory: str | os.PathLike,
                      tag: str | None) -> tuple[str, str | None]:
    """The directory and tag every rank of one save or load uses: rank 0's
    when the ranks' differ (see [Note: agreed location]). Call it on every
    rank, right after `rdv` is made and before touching any file.

    Args:
        rdv: the call's rendezvous (its "location" agreement is used).
        config: the engine's config (its `checkpoint` section is read).
        dir_arg: the directory's argument name for messages ("save_dir",
            "load_dir").
        directory: this rank's directory, as passed.
        tag: this rank's tag (None on load: the latest).

    Returns:
        (directory, tag): this rank's own when every rank's resolve to the
        same absolute directory and tag, else rank 0's absolute directory
        and tag (the same on every rank).

    Raises:
        CheckpointError: on every rank, naming each differing rank and its
            value, when they differ and some rank asked for strictness
            (DSRUN_STRICT_CONFIG=1, `checkpoint.strict_paths`, or
            `checkpoint.tag_validation` "Fail" for the tag).

    [Note: agreed location]
    save_dir / load_dir and the tag are collective arguments, like a
    collective's shape: if ranks name different tag directories, each writes
    its shard into its own and the commit fails looking for the others'
    (DeepSpeed leaves a checkpoint that cannot be loaded). Scripts that name
    the directory after the clock (DeepSpeedExamples' bing_bert builds it
    with time.strftime on each rank) hit this whenever the ranks straddle a
    second. So each rank publishes through the store (`rdv.agree`, before
    any file is touched) its absolute directory (ranks in different working
    directories differ too), its tag, and how it wants a difference handled
    (`_handling`). Every rank reads the same records and takes the same
    branch: no difference -> each keeps its own arguments; a difference
    that the strictest handling any rank asked for makes an error -> the
    same CheckpointError on every rank; otherwise every rank uses rank 0's
    directory and tag, and rank 0 logs one warning naming each differing
    rank and its value. client_state is not compared: only rank 0's is
    saved, whatever the other ranks pass.
    """
    mine = {"dir": os.path.abspath(os.fspath(directory)), "tag": tag}
    record = json.dumps({"values": mine, "handling": _handling(config)})
    records = [json.loads(report) for _, report in rdv.agree("location", True, record)]
    first = records[0]["values"]
    differing = {key: [(r, rec["values"][key]) for r, rec in enumerate(records)
                       if rec["values"][key] != first[key]] for key in mine}
    if not any(differing.values()):
        return os.fspath(directory), tag
    how = {key: max((rec["handling"][key] for rec in records), key=_HANDLING.index) for key in mine}

    def describe(key: str, used: str) -> str:
        name = dir_arg if key == "dir" else "tag"
        ranks = ", ".join(f"rank {r} passed {name} {value!r}" for r, value in differing[key])
        return f"{ranks}, rank 0's {first[key]!r}{used}"
    errors = [key for key in mine if differing[key] and how[key] == "error"]
    if errors:
        raise CheckpointError(
            f"{rdv.what}: the ranks passed different arguments: "
            + "; ".join(describe(key, "") for key in errors)
            + f". Nothing was read or written; every rank must pass the same {dir_arg} and tag (without "
            f"{STRICT_ENV}=1, checkpoint.strict_paths or checkpoint.tag_validation \"Fail\", rank 0's are used)")
    warned = [describe(key, " is used") for key in mine if differing[key] and how[key] == "warn"]
    if warned and rdv.rank == 0:
        log.warning("%s: the ranks passed different arguments: %s", rdv.what, "; ".join(warned))
    return first["dir"], first["tag"]
