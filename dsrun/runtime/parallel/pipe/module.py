"""The pipeline module: DeepSpeed's `PipelineModule`, `LayerSpec` and `TiedLayerSpec`.

    layers = [LayerSpec(Embed, vocab, hidden), *[LayerSpec(Block, hidden) for _ in range(n)],
              lambda x: x.float(), LayerSpec(Head, hidden, vocab)]
    model = PipelineModule(layers, num_stages=4, loss_fn=cross_entropy, seed_layers=True)

The model is a sequence of layers, each one's output the next one's input
(like nn.Sequential). It is split into num_stages * virtual_stages
contiguous parts (`parts`, see partition.py); this rank holds parts
stage_id + k * num_stages for k = 0 .. virtual_stages - 1, called its chunks
0 .. virtual_stages - 1 (virtual_stages > 1 is for interleaved schedules,
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2.2). Each rank builds only the
layers of its own parts: a LayerSpec elsewhere is never built (the
"parameters" partitioning measures it on the meta device).

[Note: layer names and checkpoints]
A built layer is registered under its global layer index, so the module's
state_dict keys are "{global_idx}.{name in the layer}" and, for a tied
module, "tied_modules.{key}.{name}" (DeepSpeed's keys). Neither depends on
the partitioning, so per-layer checkpoints (DeepSpeed writes
`layer_{idx:02d}-model_states.pt`, see `layer_checkpoint_name`) load into a
model split into a different number of stages.

[Note: tied layers]
Every TiedLayerSpec with the same key uses one module per rank (built at
the first layer of that key on the rank, registered in `tied_modules`).
Stages that hold the key keep one copy each; training keeps them equal:
the engine (1) broadcasts the weights from the lowest such stage at
start-up (`tie_weights` in engine.py; a checkpoint load gives every copy
the one stored value) and (2) sums their gradients among those stages
after backward: `tied_weight_broadcast_plan` lists the groups (DeepSpeed's `_synchronize_tied_weights` and
`allreduce_tied_weight_gradients`). The collectives are the engine's (all
collectives live in dsrun.runtime.comm); this module issues none. Like
DeepSpeed, parameters of a tied copy on a stage other than the lowest carry
`ds_pipe_replicated = True` (so a gradient norm counts them once).

[Note: seeds with seed_layers=True]
As in DeepSpeed, layer idx is built right after seeding with
base_seed + idx (seed_fn(seed), or when seed_fn is None Python's, torch's
and NumPy's generators via dsrun.runtime.utils.set_random_seed), so every
partitioning starts from the same weights. In forward, layer idx runs after
seeding with base_seed * (c + 1) + idx, where c counts the forward calls of
its chunk on this rank: dropout then draws the same masks however the model
is split. (DeepSpeed uses the index within the checkpointed segment there;
dsrun uses the global index throughout.)
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dsrun.runtime import comm
from dsrun.runtime.activation_checkpointing import checkpointing
from dsrun.runtime.config import ConfigError
from dsrun.runtime.observability.logging import logger
from dsrun.runtime.parallel.degrees import ParallelDegrees
from dsrun.runtime.parallel.mesh import ParallelMesh
from dsrun.runtime.parallel.pipe.partition import partition_balanced, partition_uniform
from dsrun.runtime.utils import set_random_seed

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "TiedWeightGroup"]


class LayerSpec:
    """A layer to build later, on the rank that holds it: `typename(*module_args, **module_kwargs)`.

    Raises:
        TypeError: typename is not an nn.Module subclass.
    """

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec({typename!r}, ...): the first argument must be an nn.Module subclass; "
                            f"pass plain functions to PipelineModule directly")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer (on the current default device)."""
        if log:
            logger.info(f"rank {comm.get_rank()} building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every TiedLayerSpec with the same `key`
    (e.g. the input embedding and the output projection).

    Args:
        key: the name of the shared module (a valid nn.ModuleDict key).
        typename, module_args, module_kwargs: as for LayerSpec.
        forward_fn: when given, this layer computes forward_fn(module, inputs)
            instead of module(inputs).
        tied_weight_attr: the attribute path(s) (e.g. "weight", "embed.weight")
            of the tensors kept equal across stages; a str or a list of them.
    """

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


@dataclass(frozen=True)
class TiedWeightGroup:
    """One tied key used by more than one stage (see [Note: tied layers]).

    stages: the stage ids holding the key, ascending. src_stage: stages[0],
    the stage whose weights the others take at start-up. weight_attrs: the
    attribute paths, within the tied module, of the tensors to broadcast
    and whose gradients to all-reduce.
    """

    key: str
    stages: tuple[int, ...]
    src_stage: int
    weight_attrs: tuple[str, ...]


def _layer_type_name(layer: Any) -> str | None:
    """The class name partitioning by type matches (a function's own name)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


class _NoMetaNormal(TorchFunctionMode):
    """`Tensor.normal_` on a meta tensor returns it untouched.

    A meta tensor has no values to fill, but torch's meta kernel of normal_
    is a Python reference wrapped in torch._disable_dynamo, whose first call
    imports torch._dynamo: about 1 CPU-second in every rank that counts a
    LayerSpec holding an nn.Embedding or a normal_ init (uniform_, fill_ and
    zero_ have C++ meta kernels). See [Note: torch._dynamo on the eager path]
    in dsrun/ops/optimizer_base.py. Shape and dtype are unchanged either way.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMAL_FILLS:  # nn.init.normal_ comes here itself (tensor= by keyword); what it calls does not
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


_NORMAL_FILLS = (torch.Tensor.normal_, torch.nn.init.normal_)


def _trainable_parameters(layer: Any) -> int:
    """The number of trainable parameter elements of a layer; a LayerSpec is
    built on the meta device for this, so no memory is allocated."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"), _NoMetaNormal():
                layer = layer.build()
        except Exception as e:
            raise RuntimeError(f"partition_method='parameters' builds each LayerSpec on the meta device to count "
                               f"its parameters, and {layer!r} failed there ({e}); use "
                               f"partition_method='uniform' or 'type:<regex>'") from e
    if not isinstance(layer, nn.Module):
        return 0
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def _get_attr_path(module: nn.Module, path: str) -> torch.Tensor:
    """module.<path> for a dotted path such as "embed.weight"."""
    out = module
    for name in path.split("."):
        out = getattr(out, name)
    return out


class PipelineModule(nn.Module):
    """The layers of this rank's pipeline stage (see the module docstring).

    Args:
        layers: the layers in order: LayerSpec / TiedLayerSpec (built only on
            the rank holding them), nn.Module instances (kept only on that
            rank) or plain callables such as lambdas. An nn.Sequential works.
        num_stages: the number of pipeline stages; without a topology the
            ranks are laid out pipe-outermost, stage = rank // (world_size //
            num_stages). Needed unless topology is given.
        topology: an object with get_dim("pipe") and get_coord(rank).pipe
            (a ProcessTopology); stage and stage count come from it.
        loss_fn: loss = loss_fn(outputs, labels), kept as `loss_fn` for the engine.
        seed_layers, seed_fn, base_seed: see [Note: seeds with seed_layers=True].
        partition_method: "parameters" (balance trainable parameter counts),
            "uniform" (balance layer counts) or "type:<regex>" (balance the
            layers whose class name matches the regex, case-insensitive).
        activation_checkpoint_interval: in training, run every this many
            layers of a chunk under `activation_checkpoint_func`; 0 disables.
        activation_checkpoint_func: called as func(function, *inputs);
            dsrun.checkpointing.checkpoint by default.
        checkpointable_layers: when given, a segment is checkpointed only if
            all its layers' class names are in this list; otherwise only if it
            has a layer with parameters (DeepSpeed's rule).
        virtual_stages: chunks per rank for interleaved schedules (1: none).

    Raises:
        ValueError: neither num_stages nor topology, they disagree, the
            world size is not a multiple of num_stages, a bad stage count,
            interval or partition method, or fewer layers than parts.
        TypeError: a layer is neither a spec, a module nor callable, or
            checkpointable_layers is not a list of class names.
    """

    def __init__(self, layers: Iterable, num_stages: int | None = None, topology=None, loss_fn=None,
                 seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = checkpointing.checkpoint,
                 checkpointable_layers: list[str] | None = None, virtual_stages: int = 1):
        super().__init__()
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages!r}: must be an integer >= 1 (1: no interleaving)")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval!r}: must be an "
                             f"integer >= 0 (0 disables activation checkpointing)")
        if checkpointable_layers is not None and (
                not isinstance(checkpointable_layers, (list, tuple))
                or not all(isinstance(n, str) for n in checkpointable_layers)):
            raise TypeError(f"checkpointable_layers={checkpointable_layers!r}: must be a list of layer class names")
        self._layer_specs = list(layers)
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, PipelineModule):
                raise TypeError(f"layer {idx} is a PipelineModule: nesting them is not supported; "
                                f"pass its layers instead")
            if not isinstance(layer, LayerSpec) and not callable(layer):
                raise TypeError(f"layer {idx} is {layer!r}: layers must be LayerSpecs, nn.Modules or callables")

        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._topo = topology
        self.num_stages, self.stage_id = self._resolve_stage(num_stages, topology)
        self.virtual_stages = virtual_stages
        self.partition_method = partition_method
        self.parts = self._partition(partition_method)

        self.tied_modules = nn.ModuleDict()  # registered first, as in DeepSpeed (parameter order)
        # The children that are layers: ZeRO stage 3 gathers each as one unit
        # (dsrun/runtime/zero/module_hints.py, z3_layer_names).
        self._z3_layers: list[str] = []
        self.tied_weight_attrs: dict[str, list[str]] = {}
        # chunk k: (global layer index, what forward calls) for each of its layers
        self._chunks = [self._build_part(self.stage_id + k * self.num_stages) for k in range(virtual_stages)]
        self._forward_calls = [0] * virtual_stages
        for p in self.parameters():
            p.ds_pipe_replicated = False
        for key in self.tied_modules:
            if self.stage_id != min(self.tied_stages(key)):
                for p in self.tied_modules[key].parameters():
                    p.ds_pipe_replicated = True

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def _resolve_stage(num_stages: int | None, topology) -> tuple[int, int]:
        """(number of stages, this rank's stage id) from the topology or the world."""
        rank = comm.get_rank()
        if topology is not None:
            stages = topology.get_dim("pipe")
            if num_stages is not None and num_stages != stages:
                raise ValueError(f"num_stages={num_stages} but the topology has {stages} pipeline stages; "
                                 f"pass one of them")
            stage = topology.get_coord(rank).pipe
        else:
            if num_stages is None:
                raise ValueError("PipelineModule needs num_stages or topology (a ProcessTopology with a 'pipe' axis)")
            if not isinstance(num_stages, int) or num_stages < 1:
                raise ValueError(f"num_stages={num_stages!r}: must be an integer >= 1")
            world = comm.get_world_size()
            if world % num_stages:
                raise ValueError(f"num_stages={num_stages} does not divide the world size {world}: every stage "
                                 f"needs the same number of data-parallel ranks")
            stages, stage = num_stages, rank // (world // num_stages)
        if not 0 <= stage < stages:
            raise ValueError(f"rank {rank} has pipeline stage {stage}, outside 0..{stages - 1}")
        return stages, stage

    def _partition(self, method: str) -> list[int]:
        """The part boundaries (len num_stages * virtual_stages + 1) for `method`."""
        num_parts = self.num_stages * self.virtual_stages
        specs = self._layer_specs
        if method.lower() == "uniform":
            parts = partition_uniform(len(specs), num_parts)
        elif method.lower() == "parameters":
            parts = partition_balanced([_trainable_parameters(layer) for layer in specs], num_parts)
        elif method.lower().startswith("type:"):
            pattern = re.compile(method[len("type:"):], re.IGNORECASE)
            weights = [int(bool((name := _layer_type_name(layer)) and pattern.search(name))) for layer in specs]
            if not any(weights):
                raise ValueError(f"partition_method={method!r}: no layer's class name matches; names are "
                                 f"{sorted({n for n in map(_layer_type_name, specs) if n})}")
            parts = partition_balanced(weights, num_parts)
        else:
            raise ValueError(f"partition_method={method!r}: use 'parameters', 'uniform' or 'type:<regex>'")
        if comm.get_rank() == 0:
            logger.info(f"pipeline partition ({method}, {self.num_stages} stages x {self.virtual_stages} "
                        f"virtual): layer boundaries {parts}")
        return parts

    def _seed(self, seed: int) -> None:
        if self.seed_fn:
            self.seed_fn(seed)
        else:
            set_random_seed(seed)

    def _build_part(self, part: int) -> list[tuple[int, Callable]]:
        """Build the layers of part `part` on this rank (seeded per layer when asked)."""
        built = []
        for idx in range(self.parts[part], self.parts[part + 1]):
            if self.seed_layers:
                self._seed(self.base_seed + idx)
            built.append((idx, self._build_layer(idx, self._layer_specs[idx])))
        return built

    def _build_layer(self, idx: int, layer) -> Callable:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            return module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(idx), layer)
            self._z3_layers.append(str(idx))
        return layer

    # -- forward ------------------------------------------------------------------------------

    def forward(self, inputs, chunk: int = 0):
        """Run this rank's layers of `chunk` in order on `inputs`.

        Each layer receives the previous one's output as one argument (a tuple
        stays a tuple); the first receives `inputs`. With activation
        checkpointing, a segment's tuple input is passed to the checkpoint
        function unpacked and packed again inside (a 1-tuple arrives unpacked).

        Raises:
            ValueError: chunk is not in 0 .. virtual_stages - 1.
        """
        if not 0 <= chunk < self.virtual_stages:
            raise ValueError(f"chunk={chunk}: this module has chunks 0..{self.virtual_stages - 1}")
        self._forward_calls[chunk] += 1
        seed_step = self._forward_calls[chunk] + 1  # DeepSpeed's micro_offset + 1
        layers = self._chunks[chunk]
        interval = self.activation_checkpoint_interval
        if interval == 0 or not self.training:
            return self._segment(layers, seed_step)(inputs)
        x = inputs
        for start in range(0, len(layers), interval):
            segment = layers[start:start + interval]
            run = self._segment(segment, seed_step)
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable([f for _, f in segment]):
                x = self.activation_checkpoint_func(run, *args)
            else:
                x = run(*args)
        return x

    def _segment(self, layers: list[tuple[int, Callable]], seed_step: int) -> Callable:
        """A function running `layers` in order (the unit a checkpoint recomputes)."""
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for idx, layer in layers:
                if self.seed_layers:
                    self._seed(self.base_seed * seed_step + idx)
                x = layer(x)
            return x
        return run

    def _is_checkpointable(self, funcs: list[Callable]) -> bool:
        """Whether a segment runs under the checkpoint function (DeepSpeed's rule)."""
        names = self.checkpointable_layers
        # Megatron-DeepSpeed's GPT pipes: with a reentrant checkpoint function only the
        # transformer layers are checkpointed (an embedding's input needs no gradient).
        if (self.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint
                and type(self).__name__ in ("GPTModelPipe", "GPT2ModelPipe")):
            return all("ParallelTransformerLayerPipe" in type(f).__name__
                       or (names is not None and type(f).__name__ in names) for f in funcs)
        if names is not None:
            return all(type(f).__name__ in names for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    # -- layout ---------------------------------------------------------------------------------

    def describe(self) -> list[str]:
        """The whole pipeline, equal on every rank whatever its stage: the
        split ("stages=... virtual_stages=... parts=...") and one line per
        layer (global index and what it is), for the ranks' start-up
        agreement (dsrun/runtime/distributed/agreement.py)."""
        lines = [f"stages={self.num_stages} virtual_stages={self.virtual_stages} parts={self.parts}"]
        for idx, layer in enumerate(self._layer_specs):
            key = f" tied={layer.key}" if isinstance(layer, TiedLayerSpec) else ""
            lines.append(f"layer {idx}: {_layer_type_name(layer)}{key}")
        return lines

    def topology(self):
        """The topology given to the constructor (None when built from num_stages)."""
        return self._topo

    def num_pipeline_stages(self) -> int:
        """The number of pipeline stages."""
        return self.num_stages

    def partitions(self) -> list[int]:
        """The part boundaries, `parts` (len num_stages * virtual_stages + 1)."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage id holding global layer `layer_idx`.

        Raises:
            ValueError: no such layer.
        """
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"layer {layer_idx}: the model has layers 0..{len(self._layer_specs) - 1}")
        part = next(j for j in range(len(self.parts) - 1) if self.parts[j] <= layer_idx < self.parts[j + 1])
        return part % self.num_stages

    def is_first_stage(self, chunk: int = 0) -> bool:
        """Whether this rank's `chunk` is the model's first part (it reads the data)."""
        return self.stage_id == 0 and chunk == 0

    def is_last_stage(self, chunk: int | None = None) -> bool:
        """Whether this rank's `chunk` (default: its last) is the model's last part (it computes the loss)."""
        chunk = self.virtual_stages - 1 if chunk is None else chunk
        return self.stage_id == self.num_stages - 1 and chunk == self.virtual_stages - 1

    def local_layers(self, chunk: int | None = None) -> list[tuple[int, Callable]]:
        """(global layer index, layer) for this rank's layers of `chunk`, or of
        all its chunks in order when chunk is None. A layer is what forward
        calls: a module, a tied module (or a partial of its forward_fn) or a
        plain callable."""
        chunks = self._chunks if chunk is None else [self._chunks[chunk]]
        return [entry for layers in chunks for entry in layers]

    @staticmethod
    def layer_checkpoint_name(layer_idx: int, rank_repr: str = "") -> str:
        """DeepSpeed's file name for global layer `layer_idx`'s state dict:
        layer_{idx:02d}[-{rank_repr}]-model_states.pt, where rank_repr names
        the ranks' other model-parallel coordinates (e.g. "model_00")."""
        return f"layer_{layer_idx:02d}" + (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt"

    # -- tied layers ----------------------------------------------------------------------------

    def tied_keys(self) -> list[str]:
        """Every tied key of the model (not only this rank's), sorted, so all ranks agree on the order."""
        return sorted({layer.key for layer in self._layer_specs if isinstance(layer, TiedLayerSpec)})

    def tied_stages(self, key: str) -> list[int]:
        """The stage ids whose parts hold a layer of tied `key`, ascending.

        Raises:
            KeyError: no TiedLayerSpec has this key.
        """
        stages = {self.stage_owner(idx) for idx, layer in enumerate(self._layer_specs)
                  if isinstance(layer, TiedLayerSpec) and layer.key == key}
        if not stages:
            raise KeyError(f"no tied layer has key {key!r}; the keys are {self.tied_keys()}")
        return sorted(stages)

    def tied_parameters(self, key: str) -> list[torch.Tensor]:
        """This rank's tensors of tied `key` named by its tied_weight_attr, in that order.

        Raises:
            KeyError: no TiedLayerSpec has this key.
            ValueError: this rank's stage does not hold the key.
        """
        stages = self.tied_stages(key)
        if key not in self.tied_modules:
            raise ValueError(f"tied key {key!r} is held by stages {stages}, not by this rank's stage {self.stage_id}")
        return [_get_attr_path(self.tied_modules[key], attr) for attr in self.tied_weight_attrs[key]]

    def tied_weight_broadcast_plan(self) -> list[TiedWeightGroup]:
        """The tied keys held by more than one stage, in tied_keys() order; see
        [Note: tied layers] for what the engine does with each."""
        plan = []
        for key in self.tied_keys():
            stages = self.tied_stages(key)
            if len(stages) > 1:
                attrs = next(layer.tied_weight_attr for layer in self._layer_specs
                             if isinstance(layer, TiedLayerSpec) and layer.key == key)
                plan.append(TiedWeightGroup(key, tuple(stages), stages[0], tuple(attrs)))
        return plan


def pipeline_degrees(module: PipelineModule, tensor_parallel, sequence: int,
                     built_on: ParallelMesh) -> ParallelDegrees:
    """The job's degrees for a PipelineModule: its stages, the config's
    `tensor_parallel.autotp_size` (each stage's layers sharded by name,
    tensor/autotp.py shard_stage) and sequence-parallel degree; or, for a
    module built on a topology, that topology's pipe, model and sequence axes.

    Args:
        module: the PipelineModule.
        tensor_parallel: the config's TensorParallelConfig.
        sequence: the config's sequence_parallel_size (already checked).
        built_on: the mesh the script built its layers on (the current one
            when initialize began), whose model axis tensor-parallel layers
            took their groups from.

    Raises:
        ConfigError: vocab_parallel with a pipeline (its embedding and output
            layer sit on different stages; not supported); a topology whose
            model or sequence axis differs from autotp_size or
            sequence_parallel_size (>1) of the config; tensor-parallel layers
            (ColumnParallelLinear, ...: built on a mesh with a model axis) in
            a module whose degrees have none -- its tensor ranks would be
            averaged as data replicas, silently wrong.
    """
    degrees = _pipeline_degrees(module, tensor_parallel, sequence)
    model_ranks = built_on.size("model")  # the model axis the layers took their groups from
    if degrees.model == 1 < model_ranks and any(getattr(p, "tensor_model_parallel", False)
                                                for p in module.parameters()):
        raise ConfigError(f"the PipelineModule holds tensor-parallel layers (built on a model axis of {model_ranks} "
                          "ranks) but its degrees have no tensor (model) axis, so its tensor ranks would train "
                          "as data replicas; build it with "
                          "topology=ParallelMesh.build(world, pipe=P, model=T).topology, or declare the "
                          "degrees first with dsrun.init_distributed(config=...) and "
                          "tensor_parallel.autotp_size=T in the config")
    return degrees


def _pipeline_degrees(module: PipelineModule, tensor_parallel, sequence: int) -> ParallelDegrees:
    """pipeline_degrees without the tensor-parallel-layers check."""
    autotp = tensor_parallel.autotp_size
    if autotp > 1 and tensor_parallel.vocab_parallel:
        raise ConfigError("tensor_parallel.vocab_parallel=true with a PipelineModule: the vocabulary-parallel "
                          "embedding and output layer are not supported inside a pipeline; set it to false "
                          "(each stage's q/k/v/o and MLP projections are still sharded)")
    topology = module.topology()
    if topology is None:
        return ParallelDegrees(pipe=module.num_stages, model=autotp, sequence=sequence)
    degrees = ParallelDegrees(*(max(topology.get_dim(axis), 1) for axis in ("pipe", "model", "sequence")))
    for key, asked, axis, has in (("tensor_parallel.autotp_size", autotp, "model", degrees.model),
                                  ("sequence_parallel_size", sequence, "sequence", degrees.sequence)):
        if asked > 1 and asked != has:
            raise ConfigError(f"{key}={asked} but the PipelineModule's topology has {has} rank(s) on its "
                              f"{axis!r} axis; build the topology with {axis}={asked} or drop the key (or "
                              "build the PipelineModule from num_stages and let initialize make the mesh)")
    return degrees
