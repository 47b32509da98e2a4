"""ZeRO stage 3: parameters partitioned too, gathered per unit when used.

[Note: units]
A unit is a group of modules whose parameters are gathered with ONE
collective: the model itself (root) and every module held in an
nn.ModuleList / nn.Sequential (e.g. one transformer block). A parameter
belongs to the nearest unit above the module that holds it; a parameter held
by several modules (tied embedding/head) belongs to the nearest unit above
all of them, so it is gathered whenever any of its users runs. A unit's
trainable parameters form one FlatParamSet, bucketed by optimizer group.
Frozen parameters are not partitioned (they stay whole on every rank).

[Note: unit life cycle]
    SHARDED --gather()--> GATHERING --wait()--> GATHERED --release()--> SHARDED
Forward pre-hook: make the unit GATHERED (waiting on a prefetch when one is
in flight), then prefetch the next unit of the recorded forward order.
Forward post-hook: release (unless persistent: fewer elements than
stage3_param_persistence_threshold, kept until the step), and hook the
outputs so that the first gradient reaching them gathers the unit again
before its backward runs (prefetching the next unit of the recorded
backward order). Post-accumulate-grad hooks move gradients into the unit's
staging buffer; when all of a unit's parameters have their gradient, the
unit is reduce-scattered (in the fixed order of [Note: ordered reduction],
reverse registration order) and released. Per step: Ψ gathered in forward,
Ψ in backward, Ψ reduce-scattered = 3Ψ logical elements.

Autograd saved the Parameter objects, not their storage, so swapping
`param.data` between the gathered view and an empty tensor is what makes
the saved tensors valid again in backward.
"""
from __future__ import annotations

import enum
import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from dsrun.runtime.comm.zero_collectives import all_gather_region, own_shard_views
from dsrun.runtime.dist import Topology
from dsrun.runtime.precision import PrecisionPolicy
from dsrun.runtime.zero.flat_params import FlatParamSet
from dsrun.runtime.zero.init import restore_full
from dsrun.runtime.zero.partition import param_views
from dsrun.runtime.zero.reducer import OrderedReducer, Region
from dsrun.runtime.zero.strategy import ZeroStrategy


class UnitState(enum.Enum):
    SHARDED = "sharded"        # only the partition is held; params are empty tensors
    GATHERING = "gathering"    # a gather is in flight into `full`
    GATHERED = "gathered"      # params are views of `full`


class Unit:
    """One gather unit (see [Note: units]); transitions as in [Note: unit life cycle]."""

    def __init__(self, index: int, name: str, module: torch.nn.Module, fset: FlatParamSet,
                 persistent: bool, owner: "PartitionedParamStrategy"):
        self.index = index
        self.name = name
        self.module = module
        self.fset = fset
        self.persistent = persistent
        self.owner = owner
        self.state = UnitState.SHARDED
        self.full: torch.Tensor | None = None
        self.handle = None
        self._empty = torch.empty(0, dtype=fset.partition.dtype, device=fset.partition.device)
        self.release(force=True)

    @property
    def numel(self) -> int:
        return self.fset.layout.padded_numel

    def gather(self, phase: str) -> None:
        """SHARDED -> GATHERING: issue the all-gather (async)."""
        if self.state is not UnitState.SHARDED:
            return
        layout = self.fset.layout
        self.full = torch.empty(layout.padded_numel, dtype=self.fset.partition.dtype,
                                device=self.fset.partition.device)
        for view, dst in own_shard_views(layout, layout.buckets, self.full, self.fset.rank):
            view.copy_(self.fset.partition[dst:dst + view.numel()])
        # Issuing may block too (synchronous transports such as shm).
        with self.owner.watchdog.waiting(f"all-gather of unit '{self.name}' ({phase})"):
            self.handle = all_gather_region(layout, layout.buckets, self.full, self.fset.rank,
                                            self.owner.group, async_op=True)
        self.state = UnitState.GATHERING
        self.phase = phase

    def wait(self, phase: str) -> None:
        """Any state -> GATHERED (gathers first when SHARDED)."""
        if self.state is UnitState.SHARDED:
            self.gather(phase)
        if self.state is UnitState.GATHERING:
            with self.owner.watchdog.waiting(f"all-gather of unit '{self.name}' ({phase})"):
                self.handle.wait()  # blocks until every rank's shard arrived
            self.handle = None
            for p, view in zip(self.fset.params, param_views(self.fset.layout, self.full)):
                p.data = view
            self.state = UnitState.GATHERED

    def release(self, force: bool = False) -> None:
        """GATHERED -> SHARDED (kept when persistent, unless forced)."""
        if self.state is UnitState.GATHERING:
            self.wait("release")
        if self.persistent and not force:
            return
        for p in self.fset.params:
            p.data = self._empty
        self.full = None
        self.state = UnitState.SHARDED


def find_units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every unit: the root, then each element of
    an nn.ModuleList / nn.Sequential, in registration order."""
    units = [("", module)]
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and m is not module:
            for child_name, child in m.named_children():
                units.append((f"{name}.{child_name}" if name else child_name, child))
    return units


def _enclosing_unit(path: str, unit_names: list[str]) -> str:
    """Longest unit name that is `path` or a dotted prefix of it."""
    best = ""
    for u in unit_names:
        if u and (path == u or path.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


class PartitionedParamStrategy(ZeroStrategy):
    """ZeRO stage 3 (see the module docstring).

    persistence_threshold: units with fewer elements stay gathered from
    their first use until the optimizer step. prefetch_numel: most elements
    of upcoming units gathered ahead (stage3_prefetch_bucket_size).
    watchdog_timeout: seconds a rank may wait on one collective before it
    reports what it is waiting on (see watchdog.py).
    """

    stage = 3

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 topology: Topology, precision: PrecisionPolicy, persistence_threshold: int,
                 prefetch_numel: int, watchdog_timeout: float | None = None, group=None):
        super().__init__(optimizer, topology, precision, group, watchdog_timeout)
        self.module = module
        self.prefetch_numel = int(prefetch_numel)
        unit_mods = find_units(module)
        unit_names = [n for n, _ in unit_mods]
        users: dict[int, list[str]] = {}
        for mod_name, mod in module.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                users.setdefault(id(p), []).append(_enclosing_unit(mod_name, unit_names))
        members: dict[str, list] = {n: [] for n in unit_names}
        for p, name, g in self.trainable_groups(optimizer, module):
            owners = users[id(p)]
            common = owners[0]
            for o in owners[1:]:
                while common and not (o == common or o.startswith(common + ".")):
                    common = common.rpartition(".")[0]
            members[_enclosing_unit(common, unit_names) if common else ""].append((p, name, g))
        self.units: list[Unit] = []
        for uname, umod in unit_mods:
            entries = sorted(members[uname], key=lambda e: e[2])  # stable: by group, then order
            if not entries:
                continue
            for p, _, _ in entries:
                restore_full(p, group)  # parameters built under zero.Init
            fset = FlatParamSet(uname or "<root>", [e[0] for e in entries], [e[1] for e in entries],
                                [e[2] for e in entries], self.rank, self.world_size, precision,
                                None, partition_params=True)
            self.sets.append(fset)
            unit = Unit(len(self.units), uname or "<root>", umod, fset,
                        fset.layout.numel < persistence_threshold, self)
            self.units.append(unit)
            for p in fset.params:
                _ZERO_UNITS[id(p)] = (weakref.ref(p), weakref.ref(unit))
        if precision.mixed:
            module.to(precision.compute_dtype)  # frozen params and buffers
        self._bind_optimizer()
        regions = [Region(u.fset, list(u.fset.layout.buckets)) for u in reversed(self.units)]
        self._unit_of_set = {id(u.fset): u for u in self.units}
        self.reducer = OrderedReducer(regions, group, on_launched=self._on_reduced,
                                      watchdog=self.watchdog)
        self._hooks = []
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda m, a, unit=unit: self._pre_forward(unit)))
            self._hooks.append(unit.module.register_forward_hook(
                lambda m, a, out, unit=unit: self._post_forward(unit, out)))
            for p in unit.fset.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self.reducer.accumulate))
        self._order = {"forward": [], "backward": []}  # recorded unit order of the first step
        self._cursor = {"forward": 0, "backward": 0}
        self._recording = True

    # ---- hooks ---------------------------------------------------------------
    def _advance(self, phase: str, unit: Unit) -> None:
        order, pos = self._order[phase], self._cursor[phase]
        if self._recording:
            order.append(unit.index)
        elif pos < len(order) and order[pos] == unit.index:
            # Prefetch what comes next in the recorded order, within the budget.
            budget = self.prefetch_numel
            for nxt in order[pos + 1:]:
                u = self.units[nxt]
                if u is unit or u.numel > budget:
                    break
                budget -= u.numel
                u.gather(phase + " prefetch")
        self._cursor[phase] = pos + 1

    def _pre_forward(self, unit: Unit) -> None:
        if unit.module is self.module:
            self._cursor["forward"] = 0  # a new forward starts (e.g. after an eval pass)
        unit.wait("forward")
        self._advance("forward", unit)

    def _post_forward(self, unit: Unit, output) -> None:
        unit.release()
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads, unit=unit: self._pre_backward(unit),
                                     mode="any")

    def _pre_backward(self, unit: Unit) -> None:
        unit.wait("backward")
        self._advance("backward", unit)

    def _on_reduced(self, region: Region) -> None:
        self._unit_of_set[id(region.fset)].release()

    # ---- GradientStrategy ---------------------------------------------------
    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool) -> None:
        self.reducer.begin(launch=True)
        self._scale(loss).backward(retain_graph=retain_graph)
        with self.watchdog.waiting("reduce-scatter of gradients (end of backward)"):
            self.reducer.flush()
        for unit in self.units:
            unit.release()
        self._recording = False
        self._cursor = {"forward": 0, "backward": 0}

    def _after_step(self) -> None:
        for unit in self.units:
            unit.release(force=True)  # persistent units hold stale values now
            unit.fset.write_back_master(unit.fset.partition)

    def _compute_storage(self, fset: FlatParamSet) -> list[torch.Tensor]:
        return [fset.partition]

    def gathered_numel(self) -> int:
        """Elements of units currently gathered or being gathered (working set)."""
        return sum(u.numel for u in self.units if u.state is not UnitState.SHARDED)


# id(param) -> (weak param, weak Unit), for GatheredParameters (see api.py).
_ZERO_UNITS: dict[int, tuple] = {}


def unit_of(param: torch.Tensor) -> Unit | None:
    """The stage-3 unit holding `param`, or None."""
    entry = _ZERO_UNITS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()

