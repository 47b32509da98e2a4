"""The walk of the combination table: every "works" pair that no other test
trains (combinations.WALKED) trains STEPS steps on WORLD gloo ranks and
equals one process training the same model on the same global batch
(loss and global gradient norm per step; see [Note: one job per pair] in
combination_cases.py).

All pairs share one world of WORLD ranks and one of a single rank (the
references, each computed once): RankPools started by the module, the
engines built one after another in the same processes.

Tolerances: fp32 1e-5 (the ranks sum in another order). bf16 and fp16
2e-2 relative (test_autotp's bf16 bound: a split matmul rounds its
partial sums to 16 bits before the all-reduce). qgZ 4.5% (test_qgz.py:
int4 gradients), qwZ 2% (test_qwz.py: int8 weights). 1-bit Adam (freeze
step 1) is held to fp32's bound: its first step is Adam's warm-up, and its
second step's loss comes before the compressed update; that step's norm is
not compared: its gradients stay local, and the norm it reports is the
root mean square of the ranks' local norms (dsrun/runtime/compression/
onebit_strategy.py, [Note: norm and overflow with local gradients]).
"""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from dsrun.runtime.parallel import combinations as combos
from tests.dist_helpers import RankPool
from tests.parallel import combination_cases as cases

TOLERANCE = {"fp16": 2e-2, "bf16": 2e-2, "qgz": 4.5e-2, "qwz": 2e-2}


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """run(pair) -> (got per rank, want): the pair's job on the shared
    world and its one-process reference (cached by job)."""
    world, single = RankPool(cases.WORLD), RankPool(1)
    nvme = tmp_path_factory.mktemp("nvme")
    references: dict[str, list] = {}

    def run(pair: list[str]):
        job = cases.plan(pair, str(nvme))
        ref = cases.reference(job)
        key = json.dumps(asdict(ref), sort_keys=True)
        if key not in references:
            references[key] = single.run(cases.train, ref, timeout=180)[0]
        return world.run(cases.train, job, timeout=300), references[key]

    yield run
    world.close()
    single.close()


@pytest.mark.parametrize("pair", [sorted(p) for p in combos.WALKED], ids="-x-".join)
def test_pair_trains_like_one_process(walk, pair):
    got, (want, _) = walk(pair)
    tol = max([TOLERANCE.get(name, 1e-5) for name in pair])
    want = torch.tensor(want)
    assert want[-1, 0] != want[0, 0]  # it trains
    for values, settings in got:  # every rank reports the step's loss and the global norm
        assert set(pair) <= set(settings) or "zero:0" in pair and "mics" in pair, settings  # MiCS is off at 0
        got = torch.tensor(values)
        if "onebit" in pair:  # the compressed step's norm is not one process's (see above)
            got[1:, 1] = want[1:, 1]
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-5)


def test_the_walk_names_its_pairs_in_the_table():
    """Each walked pair is a "works" entry naming its walk test id."""
    for pair in combos.WALKED:
        a, b = sorted(pair)
        assert combos.TABLE[pair] == combos.Works(f"{combos.WALK_TEST}[{a}-x-{b}]")
