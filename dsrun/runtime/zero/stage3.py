"""ZeRO stage 3: parameters partitioned too, gathered per unit when used.

[Note: units]
A unit is a group of modules whose parameters are gathered with ONE
all-gather. By default: the model itself (root) and every module held in an
nn.ModuleList / nn.Sequential (e.g. one transformer block); a user can name
them instead (`zero_optimization.stage3_unit_modules`: fnmatch patterns of
module names or class names, as torchtitan calls fully_shard per block). A
parameter belongs to the nearest unit above the module that holds it; a
parameter held by several modules (tied embedding/head) belongs to the
nearest unit above all of them, so it is gathered whenever any user runs.
Parameters smaller than stage3_param_persistence_threshold (while their
total stays within stage3_model_persistence_threshold) form one extra,
persistent unit instead: gathered after every step, never freed
(DeepSpeed's ds_persist). Frozen parameters are partitioned too.

Each unit's parameters form one FlatParamSet with ONE BUCKET PER PARAMETER:
a rank's shard of a parameter is then exactly what zero.Init kept for it
(see init.py), so a model built under zero.Init is adopted without ever
rebuilding full values.

[Note: hooks]
Forward pre-hook: fetch the unit (see schedule.py; gathers, prefetches).
Forward post-hook: done with it (freed or kept), and hook the outputs so
the first gradient reaching them fetches the unit again before its
backward runs. Post-accumulate-grad hooks move gradients into staging
buffers; a unit's gradients are reduce-scattered in runs of at most
reduce_bucket_size elements as each run completes (in the fixed order of
[Note: ordered reduction], reverse unit order), and the unit is released
once its last run is launched. Per step: Ψ gathered
in forward, Ψ in backward, Ψ reduce-scattered = 3Ψ logical elements. With ZeRO++ hpZ
the backward Ψ is gathered within each hpZ group (a node) from a secondary
partition (unit.py, [Note: hpZ secondary partition]): Ψ + Ψ across nodes.
`_register_hooks` registers them all, labelled for profiles, and `close()`
(engine.destroy()) removes them: [Note: strategy hooks] in dsrun/runtime/strategy/hooks.py.
"""
from __future__ import annotations

import fnmatch

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from dsrun.runtime.distributed import nodes
from dsrun.runtime.config import ConfigError
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.strategy.hooks import HookSet, labelled
from dsrun.runtime.optim.precision import PrecisionPolicy
from dsrun.runtime.zero.collectives import GradientQuantization
from dsrun.runtime.zero.experts import ExpertSetGroups, expert_name, expert_set_groups
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.parallel.mesh import MeshGroup, ParallelMesh
from dsrun.runtime.zero.groups import NodeGroups, RankGroup, ZeroGroups
from dsrun.runtime.zero.module_hints import external_parameters, z3_layer_names, z3_leaf_module
from dsrun.runtime.zero.params import home_device, record_of
from dsrun.runtime.zero.policies import QGZ_BLOCK, GatherPolicy, ZeroPPPolicy
from dsrun.runtime.zero.reducer import OrderedReducer, Region
from dsrun.runtime.zero.schedule import GatherSchedule
from dsrun.runtime.zero.strategy import ZeroStrategy
from dsrun.runtime.zero.unit import Unit, UnitContext, UnitState

PERSISTENT = "<persistent>"


def find_units(module: torch.nn.Module, patterns: list[str] | None = None) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every unit, root first, in registration order.

    patterns: fnmatch patterns matched against each module's qualified name
    and its class name; None = the default guess (each element of an
    nn.ModuleList / nn.Sequential, and each child a module declares as a
    layer: module_hints.z3_layer_names). The root is always a unit. A module
    marked by set_z3_leaf_modules is one unit and nothing inside it is.
    """
    units = [("", module)]
    leaves: list[str] = []  # see module_hints.py: nothing inside a leaf module is a unit of its own
    for name, m in module.named_modules():
        if any(name.startswith(leaf + ".") for leaf in leaves):
            continue
        if z3_leaf_module(m) and m is not module:
            leaves.append(name)
            units.append((name, m))
        elif patterns is None:
            prefix = f"{name}." if name else ""
            if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):  # a container root too
                units.extend((prefix + c, child) for c, child in m.named_children())
            else:  # layers registered as direct children (a pipeline stage's)
                units.extend((prefix + c, m.get_submodule(c)) for c in z3_layer_names(m))
        elif m is not module and any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(type(m).__name__, p)
                                     for p in patterns):
            units.append((name, m))
    seen: set[str] = set()  # a leaf that is also a ModuleList element was added twice
    return [u for u in units if not (u[0] in seen or seen.add(u[0]))]


def _enclosing_unit(path: str, unit_names: list[str]) -> str:
    """Longest unit name that is `path` or a dotted prefix of it."""
    best = ""
    for u in unit_names:
        if u and (path == u or path.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _assign(module: torch.nn.Module, unit_names: list[str], members) -> dict[str, list]:
    """Unit name -> its (param, name, key) members; see [Note: units]."""
    users: dict[int, list[str]] = {}
    for mod_name, mod in module.named_modules():
        # register_external_parameter makes a module a user of another module's parameter.
        for p in [*mod.parameters(recurse=False), *external_parameters(mod)]:
            users.setdefault(id(p), []).append(_enclosing_unit(mod_name, unit_names))
    out: dict[str, list] = {n: [] for n in unit_names}
    for p, name, key in members:
        owners = users[id(p)]
        common = owners[0]
        for o in owners[1:]:
            while common and not (o == common or o.startswith(common + ".")):
                common = common.rpartition(".")[0]
        out[_enclosing_unit(common, unit_names) if common else ""].append((p, name, key))
    return out


class PartitionedParamStrategy(ZeroStrategy):
    """ZeRO stage 3 (see the module docstring).

    Args:
        module, optimizer, topology, precision: as for every strategy.
        gather: the unit plan's and the gather schedule's settings
            (persistence thresholds, unit patterns, prefetch, live and reuse
            limits; see policies.py).
        zeropp: ZeRO++ qwZ, qgZ, hpZ and int8 frozen weights (policies.py).
            qgZ and hpZ raise as `_gradient_quantization` and `_hpz_group`
            say (ConfigError: a block would span nodes;
            NodeMapError: the node map is unknown).
        reduce_bucket_size: most elements per gradient reduction (a unit's
            gradients go in runs of parameters up to this size).
        sub_group_size: elements per fused optimizer chunk.
        watchdog_timeout: seconds a rank may wait on one collective before it
            reports what it is waiting on (see watchdog.py).
        group: the data-parallel process group (None = all ranks).
        groups: the (shard, replicate) pair to use instead of sharding over
            `group` (MiCS: ZeroGroups.mics).
        mesh, data_axis: the parallelism mesh and ZeRO's axis in it
            ("data", or "sequence_data" under sequence parallelism), whose
            group `group` is: hpZ and qgZ split it into blocks
            (ParallelMesh.data_blocks); the expert parameters' groups are
            the mesh's too.
        optimizer_tier: where masters and optimizer states live (offload/optimizer_tier.py).
        param_tier: where the compute partitions live (offload/param_tier.py).

    Attributes:
        gather_policy, zeropp: the two policies it was built with.
        hpz: this rank's hpZ group (None: off). units: the gather units,
            root first, the persistent one last. schedule: their
            GatherSchedule. reducer: the OrderedReducer of the gradients.
        hooks: the HookSet of [Note: hooks].
    """

    stage = 3

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 topology: Topology, precision: PrecisionPolicy, gather: GatherPolicy = GatherPolicy(),
                 zeropp: ZeroPPPolicy = ZeroPPPolicy(), reduce_bucket_size: int = 500_000_000,
                 sub_group_size: int = 1_000_000_000, watchdog_timeout: float | None = None, group=None,
                 optimizer_tier=None, param_tier=None, groups: ZeroGroups | None = None, *,
                 mesh: ParallelMesh, data_axis: str = "data"):
        groups = groups or ZeroGroups.sharded(group)
        super().__init__(optimizer, topology, precision, groups, sub_group_size, watchdog_timeout,
                         optimizer_tier=optimizer_tier, mesh=mesh)
        self.module = module
        self.gather_policy, self.zeropp = gather, zeropp
        self.hpz = (_hpz_group(zeropp.hpz_partition_size, mesh, data_axis)
                    if zeropp.hpz_partition_size > 1 else None)
        trainable = self.trainable_groups(optimizer, module)
        self._prepare_tier(trainable)
        seen = {id(p) for p, _, _ in trainable}
        frozen = [(p, n, None) for n, p in module.named_parameters()
                  if not p.requires_grad and id(p) not in seen]
        if param_tier is not None:
            self.param_tier = param_tier
            self.param_tier.prepare(self, [_numel(p) for p, _, _ in trainable + frozen], groups.shard.size)
        unit_mods = find_units(module, None if gather.unit_patterns is None else list(gather.unit_patterns))
        unit_names = [n for n, _ in unit_mods]
        by_unit = _assign(module, unit_names, trainable + frozen)
        persistent, budget = [], gather.model_persistence_threshold
        for name in unit_names:
            keep = []
            for member in by_unit[name]:
                numel = _numel(member[0])
                # Expert parameters differ across the expert-parallel group: never in the shared unit.
                if numel < gather.persistence_threshold and numel <= budget and expert_name(member[0]) is None:
                    persistent.append(member)
                    budget -= numel
                else:
                    keep.append(member)
            by_unit[name] = keep
        self.units: list[Unit] = []
        context = UnitContext(groups.shard, self.hpz, self.param_tier, self.watchdog, zeropp.weight_block)
        expert_contexts: dict[str, tuple[ExpertSetGroups, UnitContext]] = {}
        plan = [(n or "<root>", [m], by_unit[n]) for n, m in unit_mods] + [(PERSISTENT, [], persistent)]
        for uname, modules, members in plan:
            if not members:
                continue
            members = sorted(members, key=lambda e: (e[2] is None, -1 if e[2] is None else e[2]))
            name = _unit_expert_name(uname, members)
            if name is not None and name not in expert_contexts:  # see [Note: expert partitions]
                own = expert_set_groups(name, True, groups.data_parallel_size, mesh)
                expert_contexts[name] = (own, UnitContext(own.groups.shard, None, self.param_tier, self.watchdog,
                                                          zeropp.weight_block))
            own, unit_context = expert_contexts[name] if name is not None else (None, context)
            fset = FlatParamSet(uname, members, unit_context.shard, precision, 1, partition_params=True,
                                master_device=self._master_device(members[0][0]),
                                pin_memory=self.optimizer_tier.pin_memory or self.param_tier.pin_memory,
                                partition_device=self.param_tier.partition_device(self._param_device(members)),
                                frozen_block=zeropp.frozen_block,
                                grad_device=self.optimizer_tier.grad_device(self._param_device(members)),
                                experts=own)
            self.sets.append(fset)
            unit = Unit(len(self.units), uname, modules, fset, uname == PERSISTENT, unit_context)
            self.units.append(unit)
            self._adopt(fset, unit)
            unit.drop_values()
        _cast_unmanaged(module, precision)
        self._bind_optimizer()
        for fset in self.sets:  # after the optimizer holds its views: offloaded partitions go now
            self.param_tier.adopt(fset)
        self.schedule = GatherSchedule(self.units, gather.prefetch_numel, gather.max_live_numel,
                                       gather.max_reuse_distance, param_tier=self.param_tier)
        # Reduction order: units in reverse (backward runs them so), the persistent one last;
        # within a unit, runs of at most reduce_bucket_size elements, last buckets first.
        order = [u for u in reversed(self.units) if not u.persistent] + [u for u in self.units if u.persistent]
        regions: list[Region] = []
        self._last_region: dict[int, Unit] = {}  # id(region) -> the unit it completes
        for unit in order:
            runs = _runs(unit.fset, reduce_bucket_size)
            for run in reversed(runs):
                regions.append(Region(unit.fset, run))
            if runs:
                self._last_region[id(regions[-1])] = unit
        self.reducer = OrderedReducer(regions, groups, on_launched=self._on_reduced, watchdog=self.watchdog,
                                      quantize=(_gradient_quantization(mesh, data_axis)
                                                if zeropp.quantized_gradients else None),
                                      host_grads=self.optimizer_tier.host_grads)
        self._register_hooks()
        self._gather_persistent()

    # ---- hooks ---------------------------------------------------------------
    def _register_hooks(self) -> None:
        """Every hook of [Note: hooks], kept in `self.hooks`. The root's first
        pre-hook starts a new step of the schedule: registered before the
        units' hooks, it runs before the root unit's fetch."""
        self.hooks = hooks = HookSet()
        hooks.on_forward_pre(self.module, "dsrun::stage3_start_step", lambda mod, a: self.schedule.start_step())
        for unit in self.units:
            for m in unit.modules:
                hooks.on_forward_pre(m, "dsrun::stage3_pre_forward", lambda mod, a, unit=unit: self._pre_forward(unit))
                hooks.on_forward(m, "dsrun::stage3_post_forward",
                                 lambda mod, a, out, unit=unit: self._post_forward(unit, out))
            for p, slot in zip(unit.fset.params, unit.fset.layout.slots):
                if unit.fset.key_of_bucket[slot.bucket] is not None:
                    hooks.on_grad_accumulated(p, "dsrun::reduce_grad", self.reducer.accumulate)

    def close(self) -> None:
        """Release every gathered non-persistent unit (kept or prefetched
        ones too), then as ZeroStrategy.close: the hooks go, the tiers and
        the watchdog stop. The parameters are left partitioned, persistent
        ones gathered."""
        self.schedule.release_all()
        super().close()

    def _pre_forward(self, unit: Unit) -> None:
        self.schedule.fetch(unit, "forward")

    def _post_forward(self, unit: Unit, output) -> None:
        self.schedule.done(unit)
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            # Lives with this forward's graph (not in self.hooks; see [Note: strategy hooks] in hooks.py).
            register_multi_grad_hook(tensors, labelled("dsrun::stage3_pre_backward",
                                                       lambda grads, unit=unit: self._pre_backward(unit)),
                                     mode="any")

    def _pre_backward(self, unit: Unit) -> None:
        self.schedule.fetch(unit, "backward")

    def _on_reduced(self, region: Region) -> None:
        unit = self._last_region.get(id(region))
        if unit is not None:  # the unit's last gradients are on their way: its values are not needed
            self.schedule.done(unit)

    @staticmethod
    def _param_device(members) -> torch.device:
        return home_device(members[0][0])

    def _gather_persistent(self) -> None:
        for unit in self.units:
            if unit.persistent:
                unit.wait("persistent parameters")

    # ---- GradientStrategy ---------------------------------------------------
    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool) -> None:
        self.reducer.begin(launch=True)
        self._scale(loss).backward(retain_graph=retain_graph)
        with self.watchdog.waiting("reduce-scatter of gradients (end of backward)"):
            self.reducer.flush()
        self.schedule.release_all()
        self.schedule.end_recording()

    def _after_step(self) -> None:
        for unit in self.units:
            unit.fset.commit_frozen()  # a checkpoint load may have written frozen values
            unit.invalidate_secondary()  # the partitions changed
            if unit.persistent:
                unit.release(force=True)  # stale values: gathered again below
        self._gather_persistent()

    def sync_master_from_params(self, params) -> None:
        super().sync_master_from_params(params)
        for unit in {id(rec.unit): rec.unit for p in params
                     if (rec := record_of(p)) is not None and rec.strategy is self}.values():
            unit.fset.commit_frozen()
            unit.invalidate_secondary()

    def _held(self) -> dict[str, list[torch.Tensor]]:
        held = super()._held()
        held["params"] += [t for f in self.sets for t in (f.frozen_message, f.frozen_staging) if t is not None]
        held["gathered_params"] = [u.full for u in self.units if u.state is not UnitState.SHARDED]
        if self.hpz is not None:
            held["hpz_secondary"] = [u.secondary for u in self.units if u.secondary is not None]
        return held

    def gathered_numel(self) -> int:
        """Elements of non-persistent units currently gathered or being gathered."""
        return self.schedule.live_numel()


def _unit_expert_name(unit: str, members) -> str | None:
    """The expert group name of a unit's parameters (None: dense ones).

    Raises:
        ConfigError: the unit mixes expert and dense parameters, or experts
            of two expert groups (e.g. a MoE layer marked as a z3 leaf
            module, or stage3_unit_modules naming the whole layer): its
            parameters would be partitioned over different groups.
    """
    names = {expert_name(p) for p, _, _ in members}
    if len(names) > 1:
        raise ConfigError(f"stage 3 unit '{unit}' holds parameters of different expert groups "
                          f"({sorted(str(n) for n in names)}); each expert must be a unit of its own (the default "
                          "for the experts of dsrun.moe.layer.MoE): do not mark the MoE layer as a z3 leaf module "
                          "or name it in stage3_unit_modules")
    return names.pop()


def _rank_group(group: MeshGroup) -> RankGroup:
    return RankGroup(group.group, group.rank, group.size)


def _gradient_quantization(mesh: ParallelMesh, axis: str) -> GradientQuantization:
    """qgZ's node grid over ZeRO's group, the `axis` group of `mesh` ("data",
    or "sequence_data" under sequence parallelism): intra = its members on
    this rank's node, inter = the members at the same place on every node,
    made as mesh.data_blocks(members per node, axis) (collective the first
    time).

    Raises:
        ConfigError: ZeRO's group has different numbers of
            members on different nodes, or they are not numbered node by
            node.
        NodeMapError: the node map is unknown (see nodes.py).
    """
    key = "zero_optimization.zero_quantized_gradients"
    node_map = nodes.require()
    parts = mesh.partition(axis)
    per_node = {sum(1 for r in part if node_map.node_of(r) == node_map.node_of(part[0])) for part in parts}
    local = min(per_node)
    if len(per_node) != 1 or mesh.size(axis) % local or any(not node_map.within_one_node(part[s:s + local])
                                 for part in parts for s in range(0, len(part), local)):
        raise ConfigError(f"{key}: ZeRO++ qgZ needs ZeRO's group ({axis!r} axis, e.g. ranks {list(parts[0])}) to "
                          "have the same number of ranks on every node, numbered node by node; give every host "
                          "the same slots (and keep tensor/sequence groups inside a node), or set it to false")
    blocks = mesh.data_blocks(local, axis)
    return GradientQuantization(NodeGroups(_rank_group(blocks.block), _rank_group(blocks.replicate)), QGZ_BLOCK)


def _hpz_group(size: int, mesh: ParallelMesh, axis: str) -> RankGroup:
    """This rank's hpZ group: its block of `size` consecutive ranks of
    ZeRO's group, the `axis` group of `mesh` ("data", or "sequence_data"
    under sequence parallelism; as DeepSpeed forms them when that group is
    the whole job), made by mesh.data_blocks (collective the first time).
    Every block must lie within one node, so that the backward gathers never
    cross nodes.

    Raises:
        ConfigError: `size` does not divide ZeRO's group; or a
            block would span two nodes.
        NodeMapError: the node map is unknown (see nodes.py).
    """
    key = "zero_optimization.zero_hpz_partition_size"
    node_map = nodes.require()
    zero_size = mesh.size(axis)
    if zero_size % size:
        what = "data-parallel" if axis == "data" else f"{axis} (ZeRO's group)"
        raise ConfigError(f"{key}={size} does not divide the {what} size {zero_size}; set it to the number of "
                          f"ranks per node of that group or a divisor of it")
    spanning = [part[s:s + size] for part in mesh.partition(axis) for s in range(0, zero_size, size)
                if not node_map.within_one_node(part[s:s + size])]
    if spanning:
        per_node = sorted({len(n) for n in node_map.nodes})
        raise ConfigError(f"{key}={size}: ranks {list(spanning[0])} would form one hpZ group across two nodes "
                          f"(nodes of {per_node} ranks); set it to the ranks per node of ZeRO's group or a "
                          "divisor of it, so the backward all-gather stays inside a node")
    return _rank_group(mesh.data_blocks(size, axis).block)


def _runs(fset: FlatParamSet, limit: int) -> list[list]:
    """The set's trainable buckets in consecutive runs of at most `limit`
    elements (a larger bucket alone): its gradient reduction regions."""
    runs: list[list] = []
    size = 0
    for b, key in zip(fset.layout.buckets, fset.key_of_bucket):
        if key is None:
            break  # frozen buckets come last
        if not runs or size + b.padded_numel > limit:
            runs.append([])
            size = 0
        runs[-1].append(b)
        size += b.padded_numel
    return runs


def _numel(p: torch.nn.Parameter) -> int:
    rec = record_of(p)
    return rec.numel if rec is not None else p.numel()


def _cast_unmanaged(module: torch.nn.Module, precision: PrecisionPolicy) -> None:
    """Buffers (and parameters ZeRO does not manage) follow the compute dtype."""
    if not precision.mixed:
        return
    dtype = precision.compute_dtype
    for t in list(module.buffers()) + [p for p in module.parameters() if record_of(p) is None]:
        if t.is_floating_point():
            t.data = t.data.to(dtype)
