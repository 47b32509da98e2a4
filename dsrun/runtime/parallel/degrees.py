"""The parallel degrees of a job, declared once, and the mesh built from them.

[Note: one declaration of the degrees]
A job's degrees are pipe x model x sequence (data parallelism takes the rest
of the world). They may be given before the model is built, by
`dsrun.init_distributed(config=cfg)` (DeepSpeed's `config` argument): it
reads `pipeline.stages`, `tensor_parallel.autotp_size` and
`sequence_parallel_size` and builds the mesh at once, on every rank, so that
layers built afterwards (DistributedAttention on
`groups._get_sequence_parallel_group()`, Megatron layers on the model axis)
take their groups from it. `initialize` resolves the same degrees again from
its own config and the model (a PipelineModule's stages, a model already
sharded by `tp_model_init`, `mesh_param`, an mpu's groups) and keeps the mesh
when it has them; when the script declared degrees through
`init_distributed(config=)` that `initialize` does not find, it is a
ConfigError naming both. Scripts that never declared anything get the mesh
built by `initialize`, as before.

No MoE degree is read: DeepSpeed's configs have none (each MoE layer names
its `ep_size`); expert groups are blocks of ZeRO's group (data x
sequence) made by the layers (runtime/parallel/expert/groups.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError, pipeline_of, sequence_parallel_size_of, tensor_parallel_of
from dsrun.runtime.parallel.mesh import ParallelMesh, set_current


@dataclass(frozen=True)
class ParallelDegrees:
    """How many ranks each model-splitting axis has (each >= 1); the data
    axis is the world size over their product."""

    pipe: int = 1
    model: int = 1
    sequence: int = 1

    @classmethod
    def from_config(cls, source) -> "ParallelDegrees":
        """The degrees a ds_config (dict, path or DsConfig) declares:
        `pipeline.stages` ("auto": 1 here; a PipelineModule gives it at
        initialize), `tensor_parallel.autotp_size`, `sequence_parallel_size`.

        Raises:
            ConfigError: one of those keys is invalid, or the file cannot be read.
        """
        stages = pipeline_of(source).stages
        return cls(pipe=1 if stages == "auto" else stages, model=tensor_parallel_of(source).autotp_size,
                   sequence=sequence_parallel_size_of(source))

    @classmethod
    def of_mesh(cls, mesh: ParallelMesh) -> "ParallelDegrees":
        """The degrees `mesh` was built with."""
        return cls(mesh.size("pipe"), mesh.size("model"), mesh.size("sequence"))

    @property
    def replica(self) -> int:
        """Ranks of one data-parallel replica: pipe x model x sequence (the
        world size over the data degree)."""
        return self.pipe * self.model * self.sequence

    def data(self, world_size: int) -> int:
        """The data-parallel degree on `world_size` ranks.

        Raises:
            ConfigError: the product of the degrees does not divide the world size.
        """
        if world_size % self.replica:
            raise ConfigError(f"pipeline x tensor x sequence = {self.pipe} x {self.model} x {self.sequence} "
                              f"= {self.replica} ranks does not divide the {world_size} ranks of the job; "
                              "choose pipeline.stages, tensor_parallel.autotp_size and sequence_parallel_size "
                              "whose product divides it (data parallelism takes the rest)")
        return world_size // self.replica

    def __str__(self) -> str:
        return f"pipe {self.pipe} x tensor {self.model} x sequence {self.sequence}"


class _Declared:
    mesh: ParallelMesh | None = None  # see record_declaration
    source: str = ""


def record_declaration(mesh: ParallelMesh, source: str) -> None:
    """Make `mesh` current as the script's own declaration of the degrees,
    made by `source` (e.g. "init_distributed(config=...)"), which
    `initialize` checks its degrees against (check_declared). The
    declaration holds while `mesh` is the current mesh."""
    set_current(mesh)
    _Declared.mesh, _Declared.source = mesh, source


def declare_mesh(degrees: ParallelDegrees, built_on: ParallelMesh) -> ParallelMesh:
    """The job's mesh with `degrees`: `built_on` (the mesh the script built
    its layers on: [Note: the declared mesh] in mesh.py) when it has them
    (those layers keep their groups), else a new pipe x data x sequence x
    model mesh (ParallelMesh.build) made current -- collective then: every
    rank creates every group.

    Raises:
        ConfigError: the degrees do not divide the world size.
    """
    world = comm.get_world_size()
    degrees.data(world)
    if ParallelDegrees.of_mesh(built_on) == degrees:
        return built_on
    mesh = ParallelMesh.build(world, pipe=degrees.pipe, model=degrees.model, sequence=degrees.sequence)
    set_current(mesh)
    return mesh


def declared_degrees(built_on: ParallelMesh) -> ParallelDegrees | None:
    """The degrees the script declared (init_distributed(config=) or an
    mpu), or None: no declaration, or its mesh is not `built_on` (the
    current mesh when initialize began: set_current replaced the declared
    one, or the process group was re-created)."""
    mesh = _Declared.mesh
    if mesh is None or not mesh.belongs_to_current_world() or built_on is not mesh:
        return None
    return ParallelDegrees.of_mesh(mesh)


def check_declared(resolved: ParallelDegrees, built_on: ParallelMesh) -> None:
    """Raise ConfigError when the script declared other degrees (with
    init_distributed(config=) or an mpu) than `resolved` (initialize's,
    from its config and the model); `built_on` is the current mesh when
    initialize began. Checked on every rank alike, before any collective of
    the mesh or the model."""
    declared = declared_degrees(built_on)
    if declared is not None and declared != resolved:
        raise ConfigError(f"{_Declared.source} declared {declared}, but initialize() finds "
                          f"{resolved} from its config and the model; make them agree (the same config for "
                          "both, a PipelineModule with num_stages = pipeline.stages, "
                          "tensor_parallel.autotp_size = the mpu's tensor-parallel size)")
