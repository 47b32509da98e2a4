"""The order of the trials and when to stop (autotuning.tuner_type, tuner_num_trials, tuner_early_stopping).

    gridsearch   the candidates in grid order (space.generate)
    random       the same candidates shuffled (seeded: a rerun tries the same order)
    model_based  a cost model: after `MODEL_WARMUP` trials, each next trial is the
                 untried candidate with the best predicted score, from a least-squares
                 fit of the measured scores to the candidate's features (ZeRO stage,
                 offload, log2 micro-batch size, its square, activation checkpointing).
                 DeepSpeed fits XGBoost here; a linear fit needs no extra package and,
                 with a handful of trials, has fewer parameters to guess.

The search stops after `tuner_num_trials` trials, or when
`tuner_early_stopping` trials in a row did not beat the best score so far.
"""
from __future__ import annotations

import math
import random

import numpy as np

from dsrun.autotuning.space import Candidate

TUNER_TYPES = ("gridsearch", "random", "model_based")
MODEL_WARMUP = 3  # trials measured in grid order before the cost model chooses
_SEED = 0


def features(c: Candidate) -> list[float]:
    """The cost model's inputs for `c`."""
    log_mbs = math.log2(c.micro_batch)
    return [1.0, *(float(c.stage == s) for s in (1, 2, 3)), float(c.offload_optimizer != "none"),
            log_mbs, log_mbs * log_mbs, float(bool(c.activation_checkpointing))]


class Search:
    """Hands out the next candidate to try and learns each trial's score (larger = better).

    Args:
        candidates: the candidates that may be tried (already pruned), grid order.
        tuner_type: "gridsearch", "random" or "model_based" (see the module docstring).
        num_trials: most candidates handed out.
        early_stopping: stop after this many trials in a row without a better score.
    """

    def __init__(self, candidates: list[Candidate], tuner_type: str, num_trials: int, early_stopping: int) -> None:
        if tuner_type not in TUNER_TYPES:
            raise ValueError(f"unknown tuner_type {tuner_type!r}; use one of {', '.join(TUNER_TYPES)}")
        self._untried = list(candidates)
        if tuner_type == "random":
            random.Random(_SEED).shuffle(self._untried)
        self._model = tuner_type == "model_based"
        self._limit = num_trials
        self._patience = early_stopping
        self._measured: list[tuple[Candidate, float]] = []
        self._best: float | None = None
        self._since_best = 0
        self.trials = 0
        self.stopped_early = False

    def next(self) -> Candidate | None:
        """The next candidate, or None when the search is over."""
        if not self._untried or self.trials >= self._limit:
            return None
        if self._since_best >= self._patience:
            self.stopped_early = True
            return None
        pick = 0
        if self._model and len(self._measured) >= MODEL_WARMUP:
            pick = int(np.argmax(self._predict(self._untried)))
        self.trials += 1
        return self._untried.pop(pick)

    def record(self, candidate: Candidate, score: float | None) -> None:
        """Learn the score of a tried candidate; None: it failed (counts as no improvement)."""
        if score is not None:
            self._measured.append((candidate, score))
        if score is not None and (self._best is None or score > self._best):
            self._best, self._since_best = score, 0
        else:
            self._since_best += 1

    def _predict(self, candidates: list[Candidate]) -> np.ndarray:
        x = np.array([features(c) for c, _ in self._measured])
        y = np.array([s for _, s in self._measured])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        return np.array([features(c) for c in candidates]) @ coef
