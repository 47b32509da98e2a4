"""The engine's `Checkpointer`: save and load the complete training state
(engine.save_checkpoint / load_checkpoint / save_16bit_model).

The checkpointer is given the training parts (`TrainingParts`: module,
strategy, topology, config, counters) and owns what lives between calls: the
pending asynchronous save and its staging buffer. The work is split by
concern: rendezvous.py (how ranks agree), save.py, load.py, export.py (the
16-bit model).

What is saved: the module (fp32 master values of trainable ZeRO parameters,
every other parameter and persistent buffer in its own dtype), optimizer
states (element-wise ones as tensor slices, 0-dim ones as JSON), optimizer
hyperparameters, the loss scaler, engine counters, the LR scheduler's
state_dict, client_state and every rank's RNG states. See store.py for the
format and [Note: commit protocol].

[Note: resharding on load]
The loader knows nothing about the layout that wrote a checkpoint. Under its
own current layout each rank lists the pieces it holds ([lo, hi) of the
flattened parameter `name`, see pieces.py: its ZeRO shards at stages 1-3,
whole tensors for replicated ones). For each piece it walks the stored
slices of "module/<name>" (and of "optim/<name>/<key>"), reads exactly the
overlap [max(lo, s.lo), min(hi, s.hi)) of each through safetensors'
`get_slice` (no whole-file load) and copies it, casting, into the master
(or the tensor itself). Any world size and any stage 0-3 or precision
therefore loads any other: a piece may come from one stored slice or from
several files. Tensor-parallel slices are stored as the full tensors they
are slices of, so any tensor-parallel size loads any other too (see
[Note: tensor-parallel checkpoints] in tensor_split.py). Masters are then cast into the compute copy and every rank's
full parameters re-gathered (`GradientStrategy.after_checkpoint_load`).

[Note: replicated loads]
A tensor several ranks hold alike (stage 0: the whole model and its
optimizer states, in fp32 as plain tensors, in 16-bit as masters replicated
over ZeRO's replicate group; frozen parameters at stages 1-2; buffers)
would otherwise be read from the files by each of them: N ranks read a
stage-0 checkpoint N times, from one disk or one shared file system.
Instead each replica reads only its even part of such a piece (the part it
writes on save, `HeldPiece.write_lo/write_hi` under the current layout),
and once every rank has read without error (the load's "read" agreement)
each part is broadcast in the replica group from the rank that read it
(`_fill_replicated`; over shared memory when the group is the whole job on
one host). The bytes are copied, never reduced, so values stay bit for
bit. Loading a checkpoint that N ranks wrote at stage 0 on the same N
ranks, rank r then reads exactly its own file. 2 ranks, 48M GPT, stage 0
(bench/checkpoint/README.md): rank 0 reads 287 MB per load instead of
575; the load's time, alternated with the old way, went 0.60-0.62 ->
0.52-0.62 s in fp32 (within the noise) and 0.68-0.75 -> 0.51-0.61 s in
bf16; the ~600 broadcasts (one per part) take 0.08-0.19 s of it.
"""
from __future__ import annotations

from typing import Any, Callable

from dsrun.runtime.checkpoint import export
from dsrun.runtime.checkpoint import load as loading
from dsrun.runtime.checkpoint import save as saving
from dsrun.runtime.checkpoint.rendezvous import ARRIVAL_TIMEOUT_S, COMMIT_TIMEOUT_S, Rendezvous, agree_on_location
from dsrun.runtime.checkpoint.writer import StagingBuffer
from dsrun.runtime.engine.train_state import TrainingParts

# Tests set this to a function called with a point name ("before_shard",
# "after_shard", "before_index", "before_latest") to inject failures; tests
# may also lower ARRIVAL_TIMEOUT_S / COMMIT_TIMEOUT_S here (read at each call).
fault_hook: Callable[[str], None] | None = None


def _fault(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)


class Checkpointer:
    """Saves and loads one engine's training state (collective calls: every rank).

    Args:
        parts: what a checkpoint holds (see parts.py); kept by reference.
    """

    def __init__(self, parts: TrainingParts) -> None:
        self.parts = parts
        self._pending: saving.SaveJob | None = None  # a running asynchronous save (checkpoint.async_save)
        self._staging: StagingBuffer | None = None  # reused by every save of this engine

    def _rendezvous(self, what: str, tag: str | None) -> Rendezvous:
        return Rendezvous(self.parts.topology, what, self.parts.state.global_steps, tag,
                          arrival_timeout=ARRIVAL_TIMEOUT_S, commit_timeout=COMMIT_TIMEOUT_S)

    def save(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
             save_latest: bool = True, exclude_frozen_parameters: bool = False, lr_scheduler: Any = None,
             dataloader: Any = None) -> str:
        """Save the training state under save_dir/<tag>/ (collective: every rank).

        tag: default "global_step<N>" (the global step). Returns the tag
        directory. With `checkpoint.async_save` a background thread writes
        and commits (see [Note: copy-on-write snapshot] in writer.py); the
        call returns at once and the next save, load or `wait_pending` waits
        for it (and raises its error). save_dir and tag are rank 0's when
        ranks pass different ones (one warning; see
        `rendezvous.agree_on_location`); client_state is rank 0's, whatever
        the other ranks pass. lr_scheduler and dataloader (state_dict()
        holders, or None) are saved beside the parts.

        Raises CheckpointError (on every rank) when a rank cannot write,
        state is not JSON-able (LR scheduler, client_state), not every rank
        called save, or ranks passed different save_dir/tag under strict
        checking (then before anything is written); `latest` and any
        earlier tag are then untouched. See [Note: commit protocol] in store.py.
        """
        self.wait_pending()
        tag = f"global_step{self.parts.state.global_steps}" if tag is None else str(tag)
        rdv = self._rendezvous("save_checkpoint", tag)
        save_dir, tag = agree_on_location(rdv, self.parts.config, "save_dir", save_dir, tag)
        job = saving.prepare_save(self.parts, rdv, save_dir, tag, client_state or {}, save_latest,
                                  exclude_frozen_parameters, lr_scheduler, dataloader, _fault)
        if self._staging is None:
            self._staging = StagingBuffer()
        job.snapshot(self._staging)  # copies only what may change before the write reads it
        if self.parts.config.checkpoint.async_save:
            self._pending = job.start()
        else:
            job.run()
        return job.tag_dir

    def load(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
             load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
             load_module_only: bool = False, lr_scheduler: Any = None,
             dataloader: Any = None) -> tuple[str | None, Any]:
        """Load a checkpoint into the parts (and lr_scheduler, dataloader when
        given), on any world size, stage and precision (collective: every
        rank). Returns (tag directory, client_state), or (None, None) when
        load_dir holds no complete checkpoint. load_dir and tag are rank 0's
        when ranks pass different ones (one warning; see
        `rendezvous.agree_on_location`).

        Raises CheckpointError (on every rank) naming the file or key:
        missing tag, incomplete tag, corrupted/truncated file, a checkpoint
        of another model (missing/unexpected keys under load_module_strict,
        shape mismatch always); or naming the ranks, when they passed
        different load_dir/tag under strict checking (then before any file
        is read). A failure while reading may leave some tensors loaded.
        """
        self.wait_pending()
        rdv = self._rendezvous("load_checkpoint", tag)
        load_dir, tag = agree_on_location(rdv, self.parts.config, "load_dir", load_dir,
                                          None if tag is None else str(tag))
        return loading.load(self.parts, rdv, load_dir, tag, load_module_strict, load_optimizer_states,
                            load_lr_scheduler_states, load_module_only, lr_scheduler, dataloader)

    def save_16bit(self, save_dir: str, save_filename: str = "model.safetensors",
                   exclude_frozen_parameters: bool = False) -> str:
        """The full model in the compute dtype as one safetensors file from
        rank 0 (collective; see `export.save_16bit`). Returns its path."""
        self.wait_pending()
        return export.save_16bit(self.parts, lambda name: self._rendezvous("save_16bit_model", name),
                                 save_dir, save_filename, exclude_frozen_parameters)

    def full_16bit_state(self, exclude_frozen_parameters: bool = False):
        """Yield (name, full value in the export dtype) of every parameter
        (tied ones once) and persistent buffer; a collective per
        strategy-managed parameter, so every rank must exhaust it."""
        self.wait_pending()
        specs, values = export.model_16bit(self.parts, exclude_frozen_parameters)
        for (name, *_), value in zip(specs, values):
            yield name, value

    def release_pending(self) -> None:
        """Before an optimizer step: a running asynchronous save stops
        reading the state the step changes (copying what it has not written)."""
        if self._pending is not None:
            self._pending.release()

    def wait_pending(self) -> None:
        """Wait for the asynchronous save, if one is running; raise its error
        (CheckpointError) if it failed. Every save and load calls it first."""
        job, self._pending = self._pending, None
        if job is not None:
            job.wait()

    @property
    def pending(self) -> saving.SaveJob | None:
        """The running asynchronous save, if any (benchmarks read its timing)."""
        return self._pending
