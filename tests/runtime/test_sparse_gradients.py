"""sparse_gradients at 2 gloo ranks: embedding gradients reduced by their
rows (see [Note: sparse embedding gradients] in
dsrun/runtime/strategy/sparse.py) equal the dense all-reduce's for a
sparse and a dense nn.Embedding, an nn.EmbeddingBag, an embedding that one
rank does not use, with and without a predivide factor; training on goes
the same way.

Tolerance: a sparse gradient sums a row's entries (repeated tokens, two
micro-batches) when it is coalesced, the dense buffer as they arrive: the
same numbers added in another order, equal to 1e-6 relative."""
import pytest
import torch

from tests.dist_helpers import run_ranks

VOCAB, DIM = 50, 4


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = torch.nn.Embedding(VOCAB, DIM, sparse=True)
        self.dense = torch.nn.Embedding(VOCAB, DIM)
        self.bag = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum")
        self.rank0_only = torch.nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids, rank):
        x = self.sparse(ids) + self.dense(ids) + self.bag(ids)[:, None, :]
        if rank == 0:
            x = x + self.rank0_only(ids)
        return self.head(torch.tanh(x)).square().mean()


def _ids(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB // 2 + 10 * rank, (3, 5), generator=g)  # the ranks' rows overlap in part


def _train(sparse: bool, extra: dict, steps: int = 3):
    """Per step: the reduced gradients (dense copies, and whether each was
    sparse) after the boundary's backward; the final weights."""
    import dsrun
    from dsrun.runtime import comm

    torch.manual_seed(0)
    model = Model()
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "steps_per_print": 10**6, "sparse_gradients": sparse, **extra}
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                  config=config)
    rank = comm.get_rank()
    grads = []
    for step in range(steps):
        for micro in range(2):
            loss = engine(_ids(rank, 2 * step + micro), rank)
            engine.backward(loss)
            if micro == 1:
                grads.append({n: (p.grad.is_sparse, p.grad.to_dense().clone())
                              for n, p in model.named_parameters() if p.grad is not None})
            engine.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return grads, weights


def _rank(extra: dict):
    return _train(True, extra), _train(False, extra)


@pytest.mark.parametrize("extra", [{}, {"gradient_predivide_factor": 3.0}])
def test_rows_reduction_equals_the_dense_all_reduce(extra):
    for (sparse_grads, sparse_weights), (dense_grads, dense_weights) in run_ranks(_rank, 2, extra, timeout=120):
        for got, want in zip(sparse_grads, dense_grads):
            assert set(got) == set(want)
            for name in want:
                torch.testing.assert_close(got[name][1], want[name][1], rtol=1e-6, atol=1e-9, msg=name)
            # a sparse gradient stays sparse; a dense one comes back dense
            assert got["sparse.weight"][0] and got["rank0_only.weight"][0]
            assert not got["dense.weight"][0] and not got["bag.weight"][0]
            assert not any(sparse for sparse, _ in want.values())  # without the setting: all dense
            assert got["rank0_only.weight"][1].abs().sum() > 0  # rank 1 received rank 0's rows
        for name in dense_weights:
            torch.testing.assert_close(sparse_weights[name], dense_weights[name], rtol=1e-6, atol=1e-7)
