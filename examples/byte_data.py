"""Byte-level text data: which files, how they split, how windows are drawn.

Every byte is a token (vocabulary 256), so any file works without a
tokenizer. The default corpus is the Python standard library's ``.py`` files.

[Note: train/validation split]
The split is by file, so no file's text is in both sets: files are sorted by
path and every ``VAL_EVERY``-th one, starting with the first, is held out for
validation. Sorting makes the split the same on every rank and every run. A
single file cannot be split that way; its last ``1 / VAL_EVERY`` of bytes is
held out instead.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VAL_EVERY = 10


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes, each as one flat uint8 tensor.

    Attributes:
        train: (N_train,) uint8, the training files concatenated.
        val: (N_val,) uint8, the held-out files concatenated.
        train_files: files whose bytes are in ``train`` (one file: itself).
        val_files: files whose bytes are in ``val`` (one file: itself).
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: list[Path]
    val_files: list[Path]

    def describe(self) -> str:
        """One line: file counts and sizes in MB (10^6 bytes)."""
        return (
            f"{len(self.train_files)} train files ({self.train.numel() / 1e6:.1f} MB), "
            f"{len(self.val_files)} validation files ({self.val.numel() / 1e6:.1f} MB)"
        )


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted; third-party packages left out.

    A walk that never enters site-packages/dist-packages: every rank lists
    the files, and filtering Path.rglob's results took 20 times the CPU
    (0.43 s against 0.02 s for 1,790 files).
    """
    found = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(p for p in found if p.is_file())


def files_under(path: Path) -> list[Path]:
    """``path`` itself if it is a file, else every file below it, sorted; hidden ones skipped.

    Raises:
        FileNotFoundError: path does not exist, or a folder holds no files.
    """
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    files = sorted(
        p for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise FileNotFoundError(f"--data {path}: the folder holds no (non-hidden) files")
    return files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Split at least two files into (train, val) by sorted position; see [Note: train/validation split].

    Raises:
        ValueError: fewer than two files.
    """
    if len(files) < 2:
        raise ValueError(f"need at least 2 files to split by file, got {len(files)}")
    ordered = sorted(files)
    val = ordered[::VAL_EVERY]
    train = [f for i, f in enumerate(ordered) if i % VAL_EVERY != 0]
    return train, val


def _read(files: list[Path]) -> torch.Tensor:
    blob = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def load_corpus(data: str | Path | None, seq_len: int) -> Corpus:
    """Read the corpus and split it (see [Note: train/validation split]).

    Args:
        data: a text file or a folder; None for the standard library's ``.py`` files.
        seq_len: tokens per training window; each split must hold more than
            seq_len + 1 bytes so that at least one window fits.

    Raises:
        FileNotFoundError: ``data`` does not exist or holds no files.
        ValueError: a split is too small for one window of seq_len + 1 bytes.
    """
    files = stdlib_files() if data is None else files_under(Path(data))
    if len(files) >= 2:
        train_files, val_files = split_files(files)
        corpus = Corpus(_read(train_files), _read(val_files), train_files, val_files)
    else:
        blob = _read(files)
        cut = blob.numel() - blob.numel() // VAL_EVERY
        corpus = Corpus(blob[:cut], blob[cut:], files, files)
    for name, part in (("training", corpus.train), ("validation", corpus.val)):
        if part.numel() <= seq_len + 1:
            raise ValueError(
                f"the {name} split holds {part.numel()} bytes, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}; use more data or a smaller --seq_len"
            )
    return corpus


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut windows of seq_len + 1 bytes into inputs and next-byte targets.

    Args:
        data: (N,) uint8.
        starts: (B,) int64 offsets, each <= N - seq_len - 1.

    Returns:
        x, y: (B, seq_len) int64 each, with y[:, t] == x[:, t + 1] shifted by one byte.
    """
    w = data[starts[:, None] + torch.arange(seq_len + 1)].long()  # (B, seq_len + 1)
    return w[:, :-1], w[:, 1:]


class WindowSampler:
    """Draws random training windows from a fixed seed.

    Give each rank its own seed so that ranks train on different micro-batches.
    """

    def __init__(self, data: torch.Tensor, seq_len: int, seed: int) -> None:
        self.data = data
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return x, y: (batch_size, seq_len) int64, windows at uniform random offsets."""
        starts = torch.randint(0, self.data.numel() - self.seq_len, (batch_size,), generator=self.gen)
        return windows(self.data, starts, self.seq_len)


def eval_windows(data: torch.Tensor, count: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed validation set: ``count`` windows at offsets drawn from ``seed``.

    Every rank calls this with the same arguments and gets the same windows,
    so the set is the same before and after training and across world sizes.

    Returns:
        x, y: (count, seq_len) int64.
    """
    return WindowSampler(data, seq_len, seed).sample(count)
