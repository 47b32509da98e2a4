"""Per-job, per-rank swap files for NVMe offload: checks, layout, I/O errors, cleanup.

[Note: swap directory life cycle]
A rank's swap files live in `<nvme_path>/dsrun-<job>/rank<r>.<kind>/`
(kind: optimizer or params), where
<job> is DSRUN_JOB_ID (set by the dsrun launcher) or `pid<pid>` of the rank
without one. Before training starts `SwapDir.create` refuses, with a
`SwapError` saying what to change, a path that is missing, not a directory,
not writable, or on a filesystem with less free space than the files need
(sizes are known up front); the files are then preallocated
(posix_fallocate), so running out of space later cannot happen. The
directory is removed at interpreter exit, whether training ended normally
or with an exception (atexit), and by `SwapDir.remove`. A rank killed by a
signal cannot clean up: every rank registers its directory in a per-job
registry on its node (see registry.py) and the launcher's per-node agent
removes what is registered there once the ranks exited.

[Note: O_DIRECT]
dsrun's aio op opens files with O_DIRECT (no page cache: the point of NVMe
offload is not to spend host memory on the files). A filesystem without it
(tmpfs, some network filesystems) is not refused: the swap files are then
read and written with buffered pread/pwrite through the op's PyTorch
fallback, and rank 0 logs one line saying so. On tmpfs the "swap" is host
memory anyway, so refusing would gain nothing.
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import shutil
from pathlib import Path

from dsrun.env import JOB_ID
from dsrun.runtime.offload import registry

log = logging.getLogger("dsrun.offload")


class SwapError(RuntimeError):
    """nvme_path cannot hold the swap files, or a swap file went bad during training."""


def job_name(env: dict | None = None) -> str:
    """`dsrun-<DSRUN_JOB_ID>`, or `dsrun-pid<pid>` outside the dsrun launcher."""
    job = JOB_ID.read(env) or f"pid{os.getpid()}"
    job = job.removeprefix("dsrun-")  # the launcher's ids already start with it
    return "dsrun-" + "".join(c if c.isalnum() or c in "_.-" else "_" for c in job)


def supports_o_direct(directory: Path) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (probe file, removed)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = directory / f".dsrun-odirect-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | flag, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    else:
        os.close(fd)
        return True
    finally:
        probe.unlink(missing_ok=True)


def check_path(nvme_path: Path | str, need_bytes: int, what: str) -> Path:
    """Check that `nvme_path` can take `need_bytes` more bytes of swap files.

    Returns the resolved directory. Raises SwapError (naming the path, the
    config key `what` and the fix) when it is missing, not a directory, not
    writable, or its filesystem has fewer than `need_bytes` bytes available.
    """
    path = Path(nvme_path).expanduser()
    if not path.exists():
        raise SwapError(f"{what}={path}: the directory does not exist; create it (on a fast local "
                        "drive) or point nvme_path at an existing one")
    if not path.is_dir():
        raise SwapError(f"{what}={path}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SwapError(f"{what}={path}: not writable by this user; fix its permissions or choose "
                        "another directory")
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise SwapError(f"{what}={path}: needs {need_bytes / 2**30:.2f} GiB for this rank's swap files, "
                        f"the filesystem has {free / 2**30:.2f} GiB available; free space, use another "
                        "directory, or offload less (offload_param / a smaller model per rank)")
    return path.resolve()


_CREATED: set[Path] = set()  # rank directories this process made (removed or not)


class SwapDir:
    """This rank's swap directory; see [Note: swap directory life cycle].

    Build with `SwapDir.create(nvme_path, rank, files, what)`.
    Attributes: path (the rank directory), files (name -> Path), o_direct
    (whether the filesystem supports O_DIRECT), nbytes (name -> size).
    """

    def __init__(self, path: Path, files: dict[str, int], o_direct: bool):
        self.path = path
        self.nbytes = dict(files)
        self.files = {name: path / f"{name}.swp" for name in files}
        self.o_direct = o_direct
        self._removed = False

    @classmethod
    def create(cls, nvme_path: Path | str, rank: int, files: dict[str, int], what: str,
               kind: str) -> "SwapDir":
        """Check nvme_path, make `<nvme_path>/dsrun-<job>/rank<rank>.<kind>/` and
        preallocate one file per entry of `files` (name -> bytes).

        Raises SwapError (see `check_path`); a directory of this job and rank
        that already exists is an error too (two jobs with the same id).
        Nothing is left behind when it raises.
        """
        base = check_path(nvme_path, sum(files.values()), what)
        job = base / job_name()
        path = job / f"rank{rank}.{kind}"
        serial = 1
        while path in _CREATED:  # a second engine in this process: rank<r>.<kind>.1, ...
            path, serial = job / f"rank{rank}.{kind}.{serial}", serial + 1
        job.mkdir(exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            raise SwapError(f"{what}={base}: {path} already exists: another run with the same job id is "
                            "using it (or a killed run left it; remove it)") from None
        _CREATED.add(path)
        out = cls(path, files, supports_o_direct(path))
        registry.register(path)
        atexit.register(out.remove)
        try:
            for name, size in files.items():
                out._preallocate(out.files[name], size)
        except BaseException:
            out.remove()
            raise
        return out

    @staticmethod
    def _preallocate(file: Path, size: int) -> None:
        fd = os.open(file, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise SwapError(f"cannot reserve {size} bytes for swap file {file}: {e.strerror}") from None
        finally:
            os.close(fd)

    def check(self, name: str, error: OSError) -> SwapError:
        """A SwapError for an I/O `error` on swap file `name`, saying whether
        the file was deleted or truncated while training ran."""
        file = self.files[name]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            return SwapError(f"swap file {file} was deleted while training ran ({error}); the optimizer "
                             "or parameter state it held is lost: restart from a checkpoint")
        if size < self.nbytes[name]:
            return SwapError(f"swap file {file} was truncated while training ran ({size} of "
                             f"{self.nbytes[name]} bytes left; {error}): restart from a checkpoint")
        return SwapError(f"I/O error on swap file {file}: {error}")

    def total_bytes(self) -> int:
        """Bytes of all swap files (as preallocated)."""
        return sum(self.nbytes.values())

    def remove(self) -> None:
        """Delete the rank directory (and the job directory when it is empty). Idempotent."""
        if self._removed:
            return
        self._removed = True
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()
        except OSError:
            pass  # other ranks' directories are still there
        registry.unregister(self.path)
        atexit.unregister(self.remove)
