"""Hostfile and `--include` / `--exclude` grammar.

A hostfile lists the machines of a job, one per line::

    # comment lines and blank lines are allowed
    worker-0 slots=4
    node[01-04] slots=8      # a host range expands to node01 .. node04

`parse_hostfile` turns it into an ordered list of `Host`. `select_slots`
applies `--include` / `--exclude` (`NAME[:SLOT[,SLOT|A-B...]][@NAME...]`),
`--num_nodes` and `--num_procs` and returns which slots of which host the
job uses. Every error names the file (or flag), the line and the column, what
was wrong and how to fix it: DeepSpeed accepts trailing garbage and
`slots=0`, and `-i worker-0` silently selects nothing (DeepSpeed #6671);
here each of those is either meaningful or an error.

Host patterns (`node[01-04,07]`) are shared with Slurm's node lists
(`dsrun.launcher.slurm`), so there is one expander for both.

[Note: bounded expansion]
Every count is checked before anything is expanded: a pattern may name at
most `MAX_HOSTS` hosts, a host may have at most `MAX_SLOTS` slots, and a
slot range in a filter must lie within its host's slots. So `node[0-9999999]`,
`slots=99999999999999999999` or `-i host:0-99999999999` are one-line errors,
not minutes of work and gigabytes of memory. Host names are compared
case-insensitively, as DNS does: `Worker-0` and `worker-0` are one machine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from pathlib import Path


class HostfileError(ValueError):
    """A hostfile line, host pattern or include/exclude filter is malformed.

    The message starts with `source:line:col:` (1-based) so editors can jump
    to the spot, then says what was wrong and how to fix it.
    """

    def __init__(self, source: str, line: int, col: int, message: str):
        self.source, self.line, self.col = source, line, col
        super().__init__(f"{source}:{line}:{col}: {message}")


@dataclass(frozen=True)
class Host:
    """One machine of the job: its name and how many ranks it may run."""

    name: str
    slots: int


# Most hosts one pattern (or one hostfile) may name, and most slots (ranks) one host may run.
MAX_HOSTS = 65536
MAX_SLOTS = 4096

_NAME_CHARS = r"A-Za-z0-9_.\-"
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
_LINE = re.compile(r"^(?P<host>\S+)(?P<ws>\s+)?(?P<rest>.*)$")
_SLOTS = re.compile(r"^slots=(?P<n>[+-]?\d+)$")


def expand_host_pattern(pattern: str, source: str = "<host>", line: int = 1, col: int = 1) -> list[str]:
    """Expand a host pattern with bracketed ranges into host names.

    `node[01-03,07]` -> node01, node02, node03, node07; several bracket groups
    form the cartesian product (`r[1-2]n[1-2]` -> r1n1, r1n2, r2n1, r2n2).
    A range keeps the zero padding of its first bound, as Slurm does.

    Args:
        pattern: the text to expand; `col` is the column where it starts in
            the line, so errors point inside it.

    Raises:
        HostfileError: unbalanced brackets, an empty or descending range,
            characters that cannot be in a host name, or more than
            `MAX_HOSTS` names (checked before expanding).
    """
    groups: list[tuple[str, int]] = []
    literals: list[str] = []
    pos = 0
    for m in _BRACKET.finditer(pattern):
        literals.append(_check_literal(pattern[pos:m.start()], source, line, col + pos))
        groups.append((m.group(1), col + m.start() + 1))
        pos = m.end()
    literals.append(_check_literal(pattern[pos:], source, line, col + pos))
    total = 1
    for body, body_col in groups:
        total *= sum(hi - lo + 1 for lo, hi, _ in _parse_ranges(body, source, line, body_col))
        if total > MAX_HOSTS:
            raise HostfileError(source, line, col, f"{pattern!r} names more than {MAX_HOSTS} hosts; "
                                                   "check the range bounds")
    pieces: list[list[str]] = []
    for literal, (body, body_col) in zip(literals, groups):
        pieces += [[literal], _expand_ranges(body, source, line, body_col)]
    pieces.append([literals[-1]])
    names = ["".join(parts) for parts in product(*pieces)]
    if names == [""]:
        raise HostfileError(source, line, col, "empty host name")
    return names


def _check_literal(text: str, source: str, line: int, col: int) -> str:
    bad = re.search(rf"[^{_NAME_CHARS}]", text)
    if bad:
        ch = bad.group(0)
        hint = " (unbalanced bracket: write ranges as node[01-04])" if ch in "[]" else ""
        raise HostfileError(source, line, col + bad.start(), f"character {ch!r} is not allowed in a host name{hint}")
    return text


def _parse_ranges(body: str, source: str, line: int, col: int) -> list[tuple[int, int, int]]:
    """`01-04,07` -> [(1, 4, 2), (7, 7, 2)]: (low, high, zero-padded width) per item, nothing expanded."""
    out: list[tuple[int, int, int]] = []
    offset = 0
    for item in body.split(","):
        m = _RANGE_ITEM.match(item)
        if not m:
            raise HostfileError(source, line, col + offset,
                                f"bad host range {item!r}: expected N or A-B with digits, e.g. node[01-04,07]")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if max(len(lo.lstrip("0")), len(hi.lstrip("0"))) > 12:  # int() of a huge digit string is slow, then fails
            raise HostfileError(source, line, col + offset, f"range {item!r} has a bound above 10^12")
        if int(hi) < int(lo):
            raise HostfileError(source, line, col + offset, f"host range {item!r} is descending; write {hi}-{lo}")
        out.append((int(lo), int(hi), len(lo)))
        offset += len(item) + 1
    return out


def _expand_ranges(body: str, source: str, line: int, col: int) -> list[str]:
    return [str(i).zfill(width) for lo, hi, width in _parse_ranges(body, source, line, col) for i in range(lo, hi + 1)]


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    """Parse hostfile text into hosts, in file order.

    Grammar per line: `HOST slots=N [# comment]`, where HOST may be a range
    pattern (see `expand_host_pattern`). Blank and `#` lines are ignored.

    Raises:
        HostfileError: a line without `slots=N`, slots outside 0..MAX_SLOTS
            (0: see [Note: slots=0]),
            anything after `slots=N` other than a comment, a host listed
            twice in any letter case (both lines named), more than MAX_HOSTS
            hosts, or no host at all.
    """
    hosts: list[Host] = []
    seen: dict[str, tuple[int, str]] = {}  # lower-case name -> (line, name as first written)
    for lineno, raw in enumerate(text.splitlines(), start=1):
        body = raw.split("#", 1)[0].rstrip()
        if not body.strip():
            continue
        indent = len(body) - len(body.lstrip())
        m = _LINE.match(body.lstrip())
        assert m is not None  # a non-blank line always has a first token
        host_col = indent + 1
        rest_col = host_col + len(m.group("host")) + len(m.group("ws") or "")
        names = expand_host_pattern(m.group("host"), source, lineno, host_col)
        tokens = m.group("rest").split()
        if not tokens:
            raise HostfileError(source, lineno, rest_col,
                                f"missing slots for {m.group('host')!r}; write '{m.group('host')} slots=N'")
        sm = _SLOTS.match(tokens[0])
        if not sm:
            raise HostfileError(source, lineno, rest_col,
                                f"expected 'slots=N' after the host name, got {tokens[0]!r}")
        digits = sm.group("n").lstrip("+-").lstrip("0")
        slots = int(sm.group("n")) if len(digits) <= 12 else MAX_SLOTS + 1
        if slots < 0:
            raise HostfileError(source, lineno, rest_col + len("slots="),
                                f"slots must be >= 0, got {slots}; remove the line to leave the host out")
        if slots > MAX_SLOTS:
            raise HostfileError(source, lineno, rest_col + len("slots="),
                                f"slots={sm.group('n')} is more than {MAX_SLOTS} ranks on one host; give the "
                                "number of GPUs (or ranks) of that host")
        if len(tokens) > 1:
            garbage_col = rest_col + m.group("rest").index(tokens[1], len(tokens[0]))
            raise HostfileError(source, lineno, garbage_col,
                                f"unexpected {tokens[1]!r} after 'slots={slots}'; put comments after '#'")
        for name in names:
            if name.lower() in seen:
                first_line, first_name = seen[name.lower()]
                written = "" if first_name == name else f" as {first_name!r}; host names are case-insensitive"
                raise HostfileError(source, lineno, host_col, f"host {name!r} is listed twice (first on line "
                                    f"{first_line}{written}); keep one line per host")
            seen[name.lower()] = (lineno, name)
            hosts.append(Host(name, slots))
        if len(hosts) > MAX_HOSTS:
            raise HostfileError(source, lineno, host_col, f"the hostfile lists more than {MAX_HOSTS} hosts")
    if not hosts:
        raise HostfileError(source, 1, 1, "hostfile lists no hosts; add lines like 'worker-0 slots=4'")
    return hosts


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read and parse the hostfile at `path` (see `parse_hostfile_text`).

    Raises:
        FileNotFoundError: the file does not exist. A hostfile that was named
            explicitly must exist; dsrun never falls back to a local run.
        HostfileError: the file's content is malformed.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"hostfile {str(p)!r} does not exist (given with --hostfile); "
                                "check the path, or omit --hostfile for a single-node run")
    return parse_hostfile_text(p.read_text(), str(p))


def parse_filter(spec: str, hosts: list[Host], flag: str) -> dict[str, list[int]]:
    """Parse an `--include`/`--exclude` value against the hostfile's hosts.

    Grammar: `NAME[:SLOT[,SLOT|A-B...]][@NAME...]`. NAME may be a host
    pattern (`node[01-02]`). A bare NAME means all of that host's slots.

    Returns:
        host name (as the hostfile writes it) -> sorted slot indices named
        for it, in the order of `spec`. Names match in any letter case.

    Raises:
        HostfileError: (source is the flag name, line 1, column in `spec`) an
            unknown host, a slot >= the host's slots (checked before any
            range is expanded), a descending slot range, an empty element or
            a host named twice.
    """
    slots_of = {h.name: h.slots for h in hosts}
    canonical = {h.name.lower(): h.name for h in hosts}
    chosen: dict[str, list[int]] = {}
    col = 1
    for element in spec.split("@"):
        name_part, _, slot_part = element.partition(":")
        if not name_part:
            raise HostfileError(flag, 1, col, f"empty host name in {flag} {spec!r}; expected NAME[:SLOTS][@NAME...]")
        for written in expand_host_pattern(name_part, flag, 1, col):
            name = canonical.get(written.lower(), written)
            if name not in slots_of:
                raise HostfileError(flag, 1, col, f"host {name!r} is not in the hostfile (hosts: {', '.join(slots_of)})")
            if name in chosen:
                raise HostfileError(flag, 1, col, f"host {name!r} is named twice in {flag}; merge its slots into one entry")
            if not slot_part:
                chosen[name] = list(range(slots_of[name]))
                continue
            slot_col = col + len(name_part) + 1
            ranges = _parse_ranges(slot_part, flag, 1, slot_col)
            too_big = next((hi for _, hi, _ in ranges if hi >= slots_of[name]), None)
            if too_big is not None:
                raise HostfileError(flag, 1, slot_col,
                                    f"slot {too_big} is beyond host {name!r}, which has slots 0-{slots_of[name] - 1}")
            chosen[name] = sorted({i for lo, hi, _ in ranges for i in range(lo, hi + 1)})
        col += len(element) + 1
    return chosen


# [Note: slots=0]
# DeepSpeed's runner (0.19.8, tried) accepts `slots=0` and then starts no
# rank on that host unless `--num_gpus N` is given, which replaces every
# host's slots by N; a hostfile of slots=0 hosts alone is a job of no rank
# (dist_world_size=0) that exits 0 at once.
# SkyPilot's DeepSpeed recipe writes such a hostfile on CPU nodes
# (slots=$SKYPILOT_NUM_GPUS_PER_NODE). dsrun reads slots=0 as "size not
# given": with --num_procs N the host runs N ranks, as with DeepSpeed's
# --num_gpus; without it the launch is refused, naming the case, rather
# than doing nothing successfully.


def select_slots(hosts: list[Host], include: str = "", exclude: str = "",
                 num_nodes: int | None = None, num_procs: int | None = None) -> dict[str, list[int]]:
    """Decide which slots of which hosts the job runs on.

    Args:
        hosts: the hostfile's hosts, in file order (node rank order).
        include: keep only these hosts/slots (`--include`).
        exclude: drop these hosts/slots (`--exclude`).
        num_nodes: use only the first N hosts (after the filters).
        num_procs: use only the first N slots of each host.

    Returns:
        host name -> slot indices, in hostfile order, hosts with no slot left
        dropped.

    Raises:
        HostfileError: a malformed filter (see `parse_filter`).
        ValueError: include and exclude together, num_nodes/num_procs with a
            filter, a count < 1 or larger than what the hostfile offers, or
            nothing left to run on.
    """
    if include and exclude:
        raise ValueError("--include and --exclude cannot be used together; "
                         "express the selection with one of them")
    if (include or exclude) and (num_nodes is not None or num_procs is not None):
        raise ValueError("--num_nodes/--num_procs cannot be combined with --include/--exclude; "
                         "name the slots in the filter instead")
    unsized = [h.name for h in hosts if h.slots == 0]
    if unsized and num_procs is None:
        raise ValueError(
            f"host {unsized[0]!r} has slots=0, which says nothing about how many ranks to start there (SkyPilot's "
            "DeepSpeed recipe writes slots=$SKYPILOT_NUM_GPUS_PER_NODE, 0 on CPU nodes); pass --num_procs N "
            "for N ranks on every host, or write slots=N (see [Note: slots=0] in dsrun/launcher/hostfile.py)")
    # See [Note: slots=0]: --num_procs sizes a host written with slots=0.
    selection = {h.name: list(range(h.slots or num_procs or 0)) for h in hosts}
    if include:
        picked = parse_filter(include, hosts, "--include")
        selection = {h.name: picked[h.name] for h in hosts if h.name in picked}
    if exclude:
        dropped = parse_filter(exclude, hosts, "--exclude")
        selection = {n: [s for s in slots if s not in dropped.get(n, [])] for n, slots in selection.items()}
        selection = {n: s for n, s in selection.items() if s}
    if num_nodes is not None:
        if not 1 <= num_nodes <= len(selection):
            raise ValueError(f"--num_nodes {num_nodes} is out of range: the hostfile has {len(selection)} host(s)")
        selection = dict(list(selection.items())[:num_nodes])
    if num_procs is not None:
        short = [n for n, s in selection.items() if len(s) < num_procs]
        if num_procs < 1 or short:
            raise ValueError(f"--num_procs {num_procs} is out of range: "
                             + (f"host {short[0]!r} has {len(selection[short[0]])} slot(s)" if short else "must be >= 1"))
        selection = {n: s[:num_procs] for n, s in selection.items()}
    if not selection:
        raise ValueError(f"no slot left after --exclude {exclude!r}; exclude fewer hosts or slots")
    return selection
