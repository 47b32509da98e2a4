"""DeepSpeed's PipelineParallelGrid, answered from the parallelism mesh.

The grid is the `mpu` object DeepSpeed code passes around (PipelineModule's
`mpu()`, `deepspeed.initialize(mpu=...)`, activation checkpointing's
`configure(mpu)`). Its words, as DeepSpeed defines them:

- stage / pipe parallel: the pipe axis;
- data parallel: the data axis (one pipeline replica per data rank);
- slice parallel = tensor model parallel: the model axis, within a stage;
- model parallel: every rank holding a different part of one model copy,
  i.e. pipe x model (the mesh's "pipe_model" group), over which DeepSpeed
  sums gradient norms and overflow flags.

Groups of one rank are one-rank process groups (ParallelMesh.group), as
DeepSpeed's grid gives, so passing any of them to a collective is safe.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.parallel.topology import ProcessTopology, default_pipe_data_topology


class PipelineParallelGrid:
    """This rank's place in the pipe x data x model grid; see the module doc.

    Args:
        topology: the rank layout; None = DeepSpeed's default for the world
            size (topology.default_pipe_data_topology).
        process_group: only None or the default group (DeepSpeed ignores
            this argument; a grid over a subgroup is not supported).
        mesh: an existing mesh to answer from (e.g. mesh.current()); then
            no group is created. Otherwise constructing the grid builds a
            ParallelMesh, which is collective over every rank.

    Attributes (DeepSpeed's): global_rank, world_size, pipe_parallel_size,
    data_parallel_size, model_parallel_size (the model axis size),
    slice_parallel_size, stage_id, data_parallel_id, is_first_stage,
    is_last_stage, mesh.

    Raises:
        ValueError: both topology and mesh given with different layouts, a
            process_group other than the default group, or a topology whose
            world size is not the job's.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: ProcessGroup | None = None,
                 mesh: ParallelMesh | None = None) -> None:
        if process_group is not None and process_group is not dist.group.WORLD:
            raise ValueError("PipelineParallelGrid(process_group=...): only the default group is supported; "
                             "pass process_group=None")
        if mesh is not None:
            if topology is not None and not mesh.topology.same_layout(topology):
                raise ValueError(f"PipelineParallelGrid: topology {topology.get_axis_names()} x {topology.dims} "
                                 f"differs from the mesh's {mesh.topology.get_axis_names()} x "
                                 f"{mesh.topology.dims}; pass one of them")
        else:
            mesh = ParallelMesh(topology if topology is not None
                                else default_pipe_data_topology(comm.get_world_size()))
        self.mesh = mesh
        self._topo = mesh.topology
        self.global_rank = mesh.global_rank
        self.world_size = mesh.world_size
        self.pipe_parallel_size = mesh.size("pipe")
        self.data_parallel_size = mesh.size("data")
        self.model_parallel_size = mesh.size("model")
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

    def topology(self) -> ProcessTopology:
        """The rank layout."""
        return self._topo

    def get_global_rank(self) -> int:
        """This rank's global rank."""
        return self.global_rank

    def get_stage_id(self) -> int:
        """This rank's pipeline stage (0 without a pipe axis)."""
        return self.mesh.rank("pipe")

    def get_data_parallel_id(self) -> int:
        """Which pipeline replica this rank belongs to (its data coordinate)."""
        return self.mesh.rank("data")

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of stage `stage_id` with this rank's other
        coordinates, except those in kwargs (ParallelMesh.stage_to_global)."""
        return self.mesh.stage_to_global(stage_id, **kwargs)

    # pipe axis
    def get_pipe_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.mesh.rank("pipe")

    def get_pipe_parallel_world_size(self) -> int:
        """The number of pipeline stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> ProcessGroup | None:
        """The ranks of this rank's pipeline (one per stage)."""
        return self.mesh.group("pipe")

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # data axis
    def get_data_parallel_rank(self) -> int:
        """Which pipeline replica this rank is in."""
        return self.mesh.rank("data")

    def get_data_parallel_world_size(self) -> int:
        """The number of pipeline replicas."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> ProcessGroup | None:
        """The ranks of this stage (and model slice) in every pipeline replica."""
        return self.mesh.group("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        """The global ranks of get_data_parallel_group(), ascending."""
        return list(self.mesh.ranks("data"))

    # model parallel: every part of one model copy (pipe x model)
    def get_model_parallel_rank(self) -> int:
        """This rank's rank among the ranks holding one model copy (pipe x model)."""
        return self.mesh.rank("pipe_model")

    def get_model_parallel_world_size(self) -> int:
        """The number of ranks holding one model copy: stages x model slices."""
        return self.mesh.size("pipe_model")

    def get_model_parallel_group(self) -> ProcessGroup | None:
        """The ranks holding one model copy (pipe x model)."""
        return self.mesh.group("pipe_model")

    # slice parallel = tensor model parallel: the model axis within a stage
    def get_slice_parallel_rank(self) -> int:
        """This rank's model (tensor) slice within its stage."""
        return self.mesh.rank("model")

    def get_slice_parallel_world_size(self) -> int:
        """The number of model (tensor) slices per stage."""
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> ProcessGroup | None:
        """The ranks holding the slices of this rank's stage in this replica."""
        return self.mesh.group("model")

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group

    # sequence parallelism (DeepSpeed's groups module asks an mpu for these)
    def get_sequence_parallel_rank(self) -> int:
        """This rank's sequence slice."""
        return self.mesh.rank("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        """The number of sequence slices."""
        return self.mesh.size("sequence")

    def get_sequence_parallel_group(self) -> ProcessGroup | None:
        """The ranks holding the other sequence slices of this rank's batch."""
        return self.mesh.group("sequence")

    def get_sequence_data_parallel_rank(self) -> int:
        """This rank's rank in the data x sequence group."""
        return self.mesh.rank("sequence_data")

    def get_sequence_data_parallel_world_size(self) -> int:
        """The number of ranks holding the same parameters (data x sequence)."""
        return self.mesh.size("sequence_data")

    def get_sequence_data_parallel_group(self) -> ProcessGroup | None:
        """The ranks holding the same parameters (data x sequence): ZeRO's group."""
        return self.mesh.group("sequence_data")
