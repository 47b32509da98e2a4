"""Build and load dsrun's native ops (C++ in csrc/), or say why not.

Each op is a plain shared library with a C interface, built by
torch.utils.cpp_extension (ninja) just in time on first use, or ahead of time
by `DSRUN_BUILD_OPS=1 pip install --no-build-isolation .` (see setup.py), and
called from Python through ctypes.

[Note: build time] A C++ file that includes torch/extension.h costs 25-30 s
of CPU to compile on the reference machine; DeepSpeed's async_io took 202 s
cold. dsrun's kernels include no torch (or Python) header at all: the Python
side checks dtypes, devices and sizes and passes raw pointers, and ctypes
releases the GIL for the duration of every call. A cold build of an op takes
a few seconds.

[Note: build cache] Builds live in `$DSRUN_OPS_CACHE` (default
`$XDG_CACHE_HOME/dsrun/ops`, i.e. ~/.cache/dsrun/ops) in a directory named
`<op>-<key>`, where the key hashes the op's sources, flags, the torch version,
the compiler's identity and the CPU architecture. A change to any of these
builds afresh; nothing is ever reused across them. A file lock per key makes
concurrent ranks build once: the first builds, the others wait and load.
A marker file written after a successful build guards against a half-written
library left by a killed build.

[Note: trusting the cache] Whatever is in the cache gets dlopen'ed by every
rank, so only what this user built is loaded. The cache root and each
`<op>-<key>` entry must be directories owned by the current user that no
group or other user can write (dsrun creates them 0700; a root that fails
is refused with a message, an entry of ours with a wider mode is rebuilt,
an entry of someone else's is refused). The marker (`BUILD_OK`) is JSON
holding the library's bare file name (no path: it cannot point outside its
entry) and the SHA-256 of the library written at build time, which is
checked before every load; a library that does not match is rebuilt. Lock
and marker files are opened with O_NOFOLLOW, so a planted symbolic link
cannot make dsrun write to another file. Prebuilt libraries inside the
installed package pass the same checks, owned by this user or root.

An op that cannot be built (no compiler, missing library headers, a compile
error, `DSRUN_OPS_DISABLE`) is reported once with one line saying why, and
the caller uses its pure-PyTorch fallback.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from dsrun.env import OPS_CACHE, OPS_DISABLE

log = logging.getLogger("dsrun.ops")

_PKG_DIR = Path(__file__).resolve().parent
# Sources: the repository's csrc/ (editable installs, a clone) or the copy
# that setup.py puts inside the installed package.
_CSRC_CANDIDATES = (_PKG_DIR.parent.parent / "csrc", _PKG_DIR / "csrc")
PREBUILT_DIR = _PKG_DIR / "_prebuilt"
MARKER = "BUILD_OK"
_LIB_FILE = re.compile(r"^[A-Za-z0-9_.+-]+\.so$")


class OpBuildError(RuntimeError):
    """An op cannot be built or loaded; the message is the one-line reason."""


@dataclass(frozen=True)
class OpSpec:
    """How to build one op.

    Attributes:
        name: op name (also the library name, prefixed with `dsrun_`).
        sources: C++ files relative to csrc/.
        cflags / ldflags: extra compiler and linker flags.
        headers: system headers the op needs; probed before building so a
            missing -dev package gives a precise reason.
        description: one line for `dsrun-report`.
    """

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...] = ("-O3",)
    ldflags: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()
    description: str = ""
    requires_cuda: bool = False  # a .cu source: needs nvcc and a CUDA build of torch
    # Directories under csrc/ whose files (headers included) enter the cache key.
    hashed_dirs: tuple[str, ...] = ()


OPS: dict[str, OpSpec] = {
    "cpu_adam": OpSpec(
        name="cpu_adam",
        sources=("cpu_adam/cpu_adam.cpp", "cpu_adam/adam_scalar.cpp",
                 "cpu_adam/adam_avx2.cpp", "cpu_adam/adam_avx512.cpp"),
        cflags=("-O3", "-fopenmp"),
        ldflags=("-fopenmp",),
        description="CPU Adam/AdamW, scalar/AVX2/AVX-512 chosen at run time, OpenMP",
        hashed_dirs=("cpu_adam", "common"),
    ),
    "quantizer": OpSpec(
        name="quantizer",
        sources=("quantizer/quantizer.cpp", "quantizer/quant_scalar.cpp",
                 "quantizer/quant_avx2.cpp", "quantizer/quant_avx512.cpp"),
        cflags=("-O3", "-fopenmp"),
        ldflags=("-fopenmp",),
        description="int8/int4 block quantization and 1-bit sign packing, scalar/AVX2/AVX-512 chosen at run time",
        hashed_dirs=("quantizer", "common"),
    ),
    "aio": OpSpec(
        name="aio",
        sources=("aio/aio_handle.cpp", "aio/aio_uring.cpp", "aio/aio_kernel_aio.cpp"),
        cflags=("-O2",),
        ldflags=("-pthread",),
        # The kernel's UAPI headers (linux-libc-dev, a dependency of gcc), not liburing/libaio.
        headers=("linux/io_uring.h", "linux/aio_abi.h"),
        description="asynchronous file I/O, io_uring or Linux native AIO (raw system calls), O_DIRECT, any size",
        hashed_dirs=("aio",),
    ),
    "shm_comm": OpSpec(
        name="shm_comm",
        sources=("shm_comm/shm_comm.cpp", "shm_comm/shm_channel.cpp"),
        cflags=("-O3",),
        ldflags=("-lrt",),
        description="shared-memory all_reduce/reduce_scatter/all_gather/broadcast and point-to-point "
                    "channels for one node",
        hashed_dirs=("shm_comm",),
    ),
    "host_alloc": OpSpec(
        name="host_alloc",
        sources=("host_alloc/host_alloc.cpp",),
        cflags=("-O2",),
        description="caching allocator for large CPU tensors (reuses freed blocks, no page faults)",
        hashed_dirs=("host_alloc",),
    ),
    "cuda_adam": OpSpec(
        name="cuda_adam",
        sources=("cuda_adam/multi_tensor_adam.cu",),
        cflags=("-O3",),
        description="fused multi-tensor Adam/AdamW on CUDA (fp32/bf16/fp16 parameters)",
        requires_cuda=True,
        hashed_dirs=("cuda_adam",),
    ),
    "quantizer_cuda": OpSpec(
        name="quantizer_cuda",
        sources=("quantizer/quantizer_cuda.cu",),
        cflags=("-O3",),
        description="int8/int4 block quantization and 1-bit sign packing on CUDA",
        requires_cuda=True,
        hashed_dirs=("quantizer",),
    ),
}


def csrc_dir() -> Path:
    """The directory holding the C++ sources. Raises OpBuildError if none exists."""
    for cand in _CSRC_CANDIDATES:
        if cand.is_dir():
            return cand
    raise OpBuildError(f"C++ sources not found (looked in {', '.join(map(str, _CSRC_CANDIDATES))})")


def cache_root() -> Path:
    """Per-user build cache root (see [Note: build cache])."""
    chosen = OPS_CACHE.read()
    if chosen is not None:
        return chosen
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "dsrun" / "ops"


def compiler() -> str:
    """The C++ compiler torch.utils.cpp_extension will run ($CXX or c++)."""
    return os.environ.get("CXX", "c++")


@lru_cache(maxsize=None)
def _compiler_identity(cxx: str) -> str:
    path = shutil.which(cxx)
    if path is None:
        raise OpBuildError(f"C++ compiler {cxx!r} not found (install g++ or set CXX to a C++ compiler)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        raise OpBuildError(f"C++ compiler {path!r} cannot run: {e}") from None
    if out.returncode != 0:
        raise OpBuildError(f"C++ compiler {path!r} --version failed: {out.stderr.strip()[:200]}")
    return f"{os.path.realpath(path)}: {out.stdout.splitlines()[0] if out.stdout else ''}"


def compiler_version() -> str:
    """First line of `$CXX --version`, or why it is unavailable (for reports)."""
    try:
        return _compiler_identity(compiler()).split(": ", 1)[1]
    except OpBuildError as e:
        return f"unavailable ({e})"


def _probe_headers(spec: OpSpec, cxx: str) -> None:
    for header in spec.headers:
        proc = subprocess.run([cxx, "-x", "c++", "-E", "-o", os.devnull, "-"],
                              input=f"#include <{header}>\n", capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            pkg = "linux-libc-dev" if header.startswith("linux/") else "its -dev package"
            raise OpBuildError(f"header <{header}> not found (install {pkg})")


def source_key(spec: OpSpec) -> str:
    """Hash of the op's sources, flags, the torch version and the CPU architecture.
    Names prebuilt libraries, which must load on machines without a compiler."""
    root = csrc_dir()
    h = hashlib.sha256()
    files = {root / s for s in spec.sources}
    for d in spec.hashed_dirs:
        files.update(p for p in (root / d).rglob("*") if p.is_file())
    for p in sorted(files):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    h.update(repr((spec.cflags, spec.ldflags, torch.__version__, torch.version.cuda, platform.machine())).encode())
    return h.hexdigest()[:16]


def cache_key(spec: OpSpec) -> str:
    """source_key plus the compiler's identity (see [Note: build cache]).
    Raises OpBuildError if the compiler is missing."""
    ident = _compiler_identity(compiler())
    return hashlib.sha256(f"{source_key(spec)}|{ident}".encode()).hexdigest()[:16]


def _disabled(name: str) -> bool:
    names = OPS_DISABLE.read()
    return "all" in names or name in names


def _lib_name(spec: OpSpec) -> str:
    return f"dsrun_{spec.name}"


def check_compatible(spec: OpSpec) -> None:
    """Raise OpBuildError saying why `spec` cannot be built here (CPU-only torch
    for a CUDA op, no compiler, a missing library header); return if it can."""
    if spec.requires_cuda and torch.version.cuda is None:
        raise OpBuildError(f"torch {torch.__version__} is a CPU build; this op needs a CUDA build of torch")
    cxx = compiler()
    _compiler_identity(cxx)
    _probe_headers(spec, cxx)


def _check_private(path: Path, owners: set[int], what: str) -> None:
    """Raise OpBuildError unless `path` (not a symbolic link) is owned by one of `owners` and not
    writable by group or others (see [Note: trusting the cache])."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OpBuildError(f"{what} {path} is a symbolic link; dsrun loads only files it built: remove it")
    if st.st_uid not in owners:
        raise OpBuildError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); dsrun "
                           "does not load native code others can replace: remove it, or set DSRUN_OPS_CACHE "
                           "to a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OpBuildError(f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}), "
                           "so anyone could plant a library in it; chmod 700 it, or set DSRUN_OPS_CACHE to a "
                           "directory only you can write")


def private_cache_root() -> Path:
    """cache_root(), created 0700 if missing; raises OpBuildError if it is not private to this user."""
    root = cache_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(root.resolve(), {os.geteuid()}, "the ops build cache")
    return root


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _open_nofollow(path: Path, flags: int, mode: int = 0o600) -> int:
    """os.open with O_NOFOLLOW; a symbolic link at `path` is an OpBuildError naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OpBuildError(f"{path} is a symbolic link (planted?); remove it") from None
        raise


def _write_marker(out_dir: Path, lib: Path) -> None:
    """Record a finished build: the library's file name and SHA-256, written atomically."""
    tmp = out_dir / f".{MARKER}.tmp"
    tmp.unlink(missing_ok=True)
    fd = _open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w") as f:
        json.dump({"library": lib.name, "sha256": _sha256(lib)}, f)
    os.replace(tmp, out_dir / MARKER)


def _verified_library(out_dir: Path, owners: set[int]) -> Path | None:
    """The library of a complete, untampered build in `out_dir`, or None if there is none to load.

    Raises OpBuildError when `out_dir` or the library fails the ownership
    checks; logs why a present build is not used (a bad marker, a library
    that does not match its SHA-256), so that the caller rebuilds.
    """
    try:
        fd = _open_nofollow(out_dir / MARKER, os.O_RDONLY)
    except FileNotFoundError:
        return None
    _check_private(out_dir, owners, "ops build directory")
    with os.fdopen(fd) as f:
        text = f.read(4096)
    try:
        record = json.loads(text)
        name, digest = record["library"], record["sha256"]
    except (ValueError, TypeError, KeyError):
        log.warning("dsrun.ops: %s does not hold a library name and SHA-256 (an older dsrun?); rebuilding",
                    out_dir / MARKER)
        return None
    if not isinstance(name, str) or not _LIB_FILE.match(name):
        log.warning("dsrun.ops: %s names %r, not a library file in its directory; rebuilding", out_dir / MARKER, name)
        return None
    lib = out_dir / name
    if not lib.exists():
        return None
    _check_private(lib, owners, "ops library")
    if _sha256(lib) != digest:
        log.warning("dsrun.ops: %s does not match the SHA-256 recorded when it was built; rebuilding", lib)
        return None
    return lib


def built_library(spec: OpSpec) -> Path | None:
    """The complete, verified library for the current key, prebuilt or in the cache, or None.

    Raises OpBuildError when the cache is not private to this user (see [Note: trusting the cache]).
    """
    prebuilt = PREBUILT_DIR / f"{spec.name}-{source_key(spec)}"
    if prebuilt.is_dir():
        try:
            lib = _verified_library(prebuilt, {os.geteuid(), 0})
        except OpBuildError as e:
            log.warning("dsrun.ops: not loading the prebuilt %s: %s", spec.name, e)
            lib = None
        if lib is not None:
            return lib
    try:
        key = cache_key(spec)
    except OpBuildError:
        return None  # no compiler: only a prebuilt library can serve
    entry = private_cache_root() / f"{spec.name}-{key}"
    try:
        return _verified_library(entry, {os.geteuid()}) if entry.is_dir() else None
    except OpBuildError:
        return None  # build() rebuilds an entry of ours, or refuses someone else's, with its message


def build(spec: OpSpec, build_dir: Path | None = None, verbose: bool = False) -> Path:
    """Build `spec` (or reuse a complete earlier build) and return the library path.

    build_dir defaults to the per-user cache directory for the op's key.
    Concurrent callers (ranks) serialise on a file lock; all but the first
    find the finished library. Raises OpBuildError with a one-line reason.
    """
    check_compatible(spec)
    key = cache_key(spec)
    if build_dir is None:
        out_dir = private_cache_root() / f"{spec.name}-{key}"
    else:
        out_dir = build_dir
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(mode=0o700, exist_ok=True)
    try:
        _check_private(out_dir, {os.geteuid()}, "ops build directory")
    except OpBuildError as e:
        if os.lstat(out_dir).st_uid != os.geteuid() or out_dir.is_symlink():
            raise
        log.warning("dsrun.ops: %s; removing it and rebuilding", e)  # ours, but others could have written in it
        shutil.rmtree(out_dir)
        out_dir.mkdir(mode=0o700)
    with os.fdopen(_open_nofollow(out_dir / ".lock", os.O_WRONLY | os.O_CREAT), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks wait here while one builds
        done = _verified_library(out_dir, {os.geteuid()})
        if done is not None:
            return done
        (out_dir / MARKER).unlink(missing_ok=True)
        # Leftovers of a killed build: a possibly half-written library, and
        # torch's own lock file, which would make load() wait forever. Nobody
        # else is building here: we hold the lock.
        for stale in out_dir.glob("*.so"):
            stale.unlink()
        (out_dir / "lock").unlink(missing_ok=True)
        from torch.utils.cpp_extension import load  # imported late: it is slow to import

        src = csrc_dir()
        try:
            # Returns the library's path; torch appends _v<N> to the name when
            # one process builds the same name twice with other inputs.
            path = load(name=_lib_name(spec), sources=[str(src / s) for s in spec.sources],
                        extra_cflags=list(spec.cflags), extra_ldflags=list(spec.ldflags),
                        extra_cuda_cflags=["-O3", "-std=c++17"] if spec.requires_cuda else None,
                        extra_include_paths=[str(src)], build_directory=str(out_dir),
                        verbose=verbose, is_python_module=False)
        except Exception as e:  # cpp_extension raises RuntimeError/OSError/CalledProcessError
            (out_dir / "build.log").write_text(str(e))
            lines = str(e).splitlines() or [type(e).__name__]
            first = next((ln.strip() for ln in lines if "error:" in ln), lines[0])  # the compiler's diagnostic
            raise OpBuildError(f"build failed: {first[:300]} (log: {out_dir / 'build.log'})") from None
        _write_marker(out_dir, Path(path))
        return Path(path)


@dataclass
class OpStatus:
    """What `dsrun-report` prints for one op."""

    name: str
    compatible: bool
    built: bool
    loaded: bool
    reason: str | None
    path: str | None


class NativeOp:
    """Loads one op's library once per process and remembers why it could not."""

    def __init__(self, spec: OpSpec):
        self.spec = spec
        self._lib: ctypes.CDLL | None = None
        self._reason: str | None = None
        self._path: Path | None = None
        self._tried = False

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, or None (reason in `.reason`, logged once)."""
        if self._tried:
            return self._lib
        self._tried = True
        try:
            if _disabled(self.spec.name):
                raise OpBuildError("disabled by DSRUN_OPS_DISABLE")
            self._path = built_library(self.spec) or build(self.spec)
            self._lib = ctypes.CDLL(str(self._path))
        except (OpBuildError, OSError) as e:
            self._reason = str(e)
            log.warning("dsrun.ops: %s: using the PyTorch fallback: %s", self.spec.name, self._reason)
        return self._lib

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def path(self) -> Path | None:
        return self._path

    def status(self, build_missing: bool = True) -> OpStatus:
        """Say whether the op can be built here, is built, and is loaded.
        With build_missing, load it first (building it if needed)."""
        if build_missing:
            self.load()
        try:
            check_compatible(self.spec)
            compatible, reason = True, self._reason
        except OpBuildError as e:
            compatible, reason = False, str(e)
        try:
            path = self._path or (built_library(self.spec) if compatible else None)
        except OpBuildError as e:
            path, reason = None, str(e)
        if reason is None and self._lib is None:
            reason = "not built yet (run without --no-build)" if path is None else "built, not loaded"
        return OpStatus(self.spec.name, compatible, path is not None, self._lib is not None, reason,
                        str(path) if path else None)


_LOADED: dict[str, NativeOp] = {}


def get_op(name: str) -> NativeOp:
    """The process-wide NativeOp for `name` (one of OPS). Raises KeyError otherwise."""
    if name not in _LOADED:
        _LOADED[name] = NativeOp(OPS[name])
    return _LOADED[name]
