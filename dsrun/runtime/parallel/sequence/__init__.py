"""Ulysses sequence parallelism (Jacobs et al. 2023, arXiv 2309.14509):
DistributedAttention (attention.py) with its all-to-alls (all_to_all.py)
and the heads each rank takes (heads.py),
each rank's slice of a sample (data.py) or of a dict batch (batches.py),
the token-averaged loss (loss.py; the engine's for a model's own loss:
model_loss.py) and a Hugging Face model's attention wrapped (hf.py).

Hugging Face model (transformers, `sdpa` attention):

    engine, *_ = dsrun.initialize(model=model, config=config, mesh_param=(D, P))
    wrap_hf_attention(model)                    # before the first forward
    loader = UlyssesSPDataLoaderAdapter(batches, mesh.rank("sequence"), mesh.group("sequence"),
                                        P, device, shared_samples=True)
    for batch in loader:                        # input_ids, shift_labels, position_ids: this rank's slice
        loss = engine(**batch).loss             # the token mean over data x sequence ranks
        engine.backward(loss); engine.step()

Own model (DeepSpeed's `deepspeed.sequence` path works too):

    config["sequence_parallel_size"] = P        # data parallelism takes world / P
    mesh = ParallelMesh.build(world, sequence=P); set_current(mesh)   # optional: lets
        # the model be built on the sequence group before initialize(), which keeps
        # this mesh; without it initialize() builds the same mesh
    attention = DistributedAttention(local_attention, groups._get_sequence_parallel_group())
    engine, *_ = dsrun.initialize(model=model, config=config)
    for batch in loader:                        # the sequence ranks of a replica read the same samples
        ids, labels, mask, positions = (shard_sequence(t, dim=1) for t in ...)
        per_token = cross_entropy(engine(ids, positions)..., reduction="none")
        engine.backward(sequence_parallel_loss(per_token, mask))   # tokens counted, not ranks
        engine.step()

Positions (rotary or learned) must be the tokens' places in the whole
sequence, and a causal mask is the local attention's (it sees the whole
sequence). ZeRO partitions and averages gradients over the mesh's
"sequence_data" group (data x sequence), as DeepSpeed; the batch triple
counts the data ranks only.
"""
from dsrun.runtime.parallel.sequence.attention import DistributedAttention
from dsrun.runtime.parallel.sequence.batches import UlyssesSPDataLoaderAdapter, shard_batch
from dsrun.runtime.parallel.sequence.data import shard_sequence
from dsrun.runtime.parallel.sequence.hf import wrap_hf_attention
from dsrun.runtime.parallel.sequence.loss import sequence_parallel_loss, token_weighted_mean

__all__ = ["DistributedAttention", "UlyssesSPDataLoaderAdapter", "sequence_parallel_loss", "shard_batch",
           "shard_sequence", "token_weighted_mean", "wrap_hf_attention"]
