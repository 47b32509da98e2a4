"""MiCS under sequence parallelism: ZeRO's group is then data x sequence
(the ranks holding the same parameters), and MiCS's blocks must split that
group, not the data axis alone -- blocking the data axis left each
sequence rank's gradient unsummed over the other sequence ranks, and the
run trained to silently different numbers.

4 gloo ranks, sequence 2 x data 2, mics_shard_size 2 at ZeRO-2 and ZeRO-3,
against the same run without MiCS and against one process training the
same model on the same global batch (gradient accumulation 4); fp32,
1e-5 (sums in another order). The model and data are test_ulysses's."""
from __future__ import annotations

import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_ulysses import TOL, _train


def _runs():
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current

    dsrun.init_distributed()
    out = {}
    for stage, mics in ((2, -1), (2, 2), (3, 2)):
        out[(stage, mics)] = _train(2, stage=stage, mics=mics)
        set_current(None)
    return out


def _one_process():
    import dsrun

    dsrun.init_distributed()
    return _train(1)


def test_mics_with_sequence_parallelism_equals_plain_zero_and_one_process():
    want_loss, want_params = run_ranks(_one_process, 1, timeout=120)[0]
    results = run_ranks(_runs, 4, timeout=240)
    plain_loss, plain_params = results[0][(2, -1)]
    torch.testing.assert_close(torch.tensor(plain_loss), torch.tensor(want_loss), **TOL)
    for key in ((2, 2), (3, 2)):
        loss, params = results[0][key]
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(plain_loss), **TOL, msg=str(key))
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), **TOL, msg=str(key))
        torch.testing.assert_close(params, want_params, **TOL, msg=str(key))
        for rank in results[1:]:  # every rank holds the same parameters
            torch.testing.assert_close(rank[key][1], params, rtol=0, atol=0, msg=str(key))
    assert want_loss[-1] < want_loss[0]  # it trains
