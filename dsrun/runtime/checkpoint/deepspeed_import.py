"""`dsrun-ckpt import-deepspeed`: a DeepSpeed checkpoint converted to dsrun's format.

DeepSpeed writes one tag directory per save (its layout, by what trained):

    mp_rank_00_model_states.pt                     module state_dict, counters, LR scheduler,
                                                   param_shapes (ZeRO 1-2), client state;
                                                   without ZeRO also the optimizer
    zero_pp_rank_<r>_mp_rank_00_model_states.pt    the same per rank at ZeRO 3 (parameters empty)
    zero_pp_rank_<r>_mp_rank_00_optim_states.pt    rank r's fp32 partition and Adam states (ZeRO 1-3)
    bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt   the same for DeepSpeed's BF16_Optimizer

A pipeline (DeepSpeed's PipelineEngine) writes its module as one file per
layer instead, from the first data-parallel rank of the stage holding it:

    layer_<XX>-model_states.pt                     the state_dict of layer XX (its global index)
    layer_<XX>-model_<TT>-model_states.pt          the same with tensor parallelism (TT: its rank)

with `mp_rank_00_model_states.pt` holding the counters, LR scheduler and
config (and `module` None). See [Note: importing a pipeline's layers].

The import reassembles every parameter's fp32 value and optimizer states:

- no ZeRO: the torch optimizer's state_dict (its states are indexed in
  parameter order) and, with 16-bit training, the fp32 copies of DeepSpeed's
  16-bit optimizer wrapper (per parameter, or one flat tensor per group);
- ZeRO 1-2 and BF16_Optimizer: per parameter group, the ranks' flat fp32
  partitions concatenated in rank order hold the group's parameters one after
  another in `param_shapes` order (plus per-parameter alignment padding where
  recorded, and padding at the end);
- ZeRO 3: every parameter is split into world-size pieces of ceil(numel /
  world) elements; rank r's flat groups hold its piece of each parameter in
  `param_shapes` order.

The Adam states have the layout of the fp32 values. The result is a
complete dsrun tag written by one "rank": loadable on any world size and
stage, with DeepSpeed's counters, LR scheduler state, optimizer
hyperparameters, loss scale and JSON-able client state.

[Note: reading DeepSpeed's pickles]
DeepSpeed's files are torch.save pickles, and unpickling can run arbitrary
code. They are read with `torch.load(weights_only=True)`, whose unpickler
only builds tensors and plain containers, plus an allow-list of the four
DeepSpeed classes the files hold (LossScaler, DynamicLossScaler,
ZeroStageEnum, fragment_address), each mapped to an inert stand-in defined
here (attributes only, no behaviour); DeepSpeed need not be installed. A file
that names any other class is refused with a CheckpointError naming the file
and the class, never unpickled freely.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import pickle
import re
import time
from collections import OrderedDict
from typing import Any

import torch

import dsrun
from dsrun.runtime.checkpoint.store import (INDEX, LATEST, CheckpointError, Index, StoredSlice,
                                            TensorEntry, atomic_write, dtype_name, fsync_dir, shard_name,
                                            write_json_atomic)
from dsrun.runtime.checkpoint.writer import ShardWriter
from dsrun.runtime.config import AioConfig

log = logging.getLogger("dsrun.checkpoint")


class _Attributes:
    """Stand-in for a DeepSpeed object: keeps its pickled attributes, does nothing."""


class _LossScaler(_Attributes):
    pass


class _DynamicLossScaler(_Attributes):
    pass


class _FragmentAddress(_Attributes):
    pass


class _ZeroStage(int):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (an IntEnum)."""


_ALLOWED = [(_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
            (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
            (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
            (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address")]

# Keys of DeepSpeed's model-states file; any other top-level key is client state.
_ENGINE_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
                "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
                "mp_world_size", "ds_config", "ds_version"}
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def read_pickle(path: str) -> Any:
    """A DeepSpeed .pt file, read restrictively (see [Note: reading DeepSpeed's
    pickles]). Raises CheckpointError naming the file (and the class it
    would need) when it is missing or holds anything beyond the allow-list."""
    if not os.path.isfile(path):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing")
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"the class {found.group(1)}" if found else "an object"
        raise CheckpointError(f"{path} holds {what}, which dsrun does not unpickle (only tensors, plain "
                              "containers and DeepSpeed's LossScaler, DynamicLossScaler, ZeroStageEnum and "
                              "fragment_address are read; unpickling anything else could run code)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read as a torch.save file: {e}") from None


def _tag_dir(ds_dir: str, tag: str | None) -> str:
    if tag is None and os.path.isfile(os.path.join(ds_dir, LATEST)):
        with open(os.path.join(ds_dir, LATEST)) as f:
            tag = f.read().strip()
    path = ds_dir if tag is None else os.path.join(ds_dir, tag)
    if not glob.glob(os.path.join(path, "*model_states.pt")):
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint tag directory (no *model_states.pt; "
                              "give the save directory holding `latest`, or --tag)")
    return path


def _rank_files(tag_dir: str, kind: str) -> list[str]:
    """Per-rank files of `kind` ("optim" or "model") in rank order, bf16_ ones included."""
    found = {}
    for path in glob.glob(os.path.join(tag_dir, f"*zero_pp_rank_*_mp_rank_00_{kind}_states.pt")):
        found[int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))] = path
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{tag_dir}: the *zero_pp_rank_*_{kind}_states.pt files are not ranks 0..N-1 "
                              f"(found ranks {sorted(found)}): a file is missing")
    return [found[r] for r in range(len(found))]


_LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")


def _layer_files(tag_dir: str) -> dict[int, str]:
    """Global layer index -> its file, for the layer files of a pipeline
    checkpoint ({} when there are none). Raises CheckpointError when the
    checkpoint was written with tensor parallelism (a layer split over
    several model ranks), which the import does not reassemble."""
    found: dict[int, str] = {}
    for name in sorted(os.listdir(tag_dir)):
        m = _LAYER_FILE.fullmatch(name)
        if m is None:
            continue
        if m.group(2) is not None and int(m.group(2)) != 0:
            raise CheckpointError(f"{tag_dir}/{name}: a layer written by tensor-parallel rank {int(m.group(2))}; "
                                  "dsrun imports pipeline checkpoints without tensor parallelism only")
        found[int(m.group(1))] = os.path.join(tag_dir, name)
    return found


def _pipeline_layers(files: dict[int, str], out: _Collected) -> None:
    """[Note: importing a pipeline's layers]
    Each layer file is the state_dict of one layer (keys such as `weight`
    or `linear.bias`); its tensors become "{XX}.{key}", the names dsrun's
    PipelineModule and an nn.Sequential of the same layers give them,
    whatever the number of stages. The values are stored in the dtype
    DeepSpeed wrote (a load casts them). DeepSpeed keeps a pipeline's
    optimizer states per stage in files whose names collide across stages
    (`mp_rank_00_model_states.pt` at ZeRO 0) or follow its stage x
    data-parallel rank layout (ZeRO 1-2); they are not imported: load the
    result with `load_optimizer_states=False`, or let the optimizer start
    afresh. A tied layer (TiedLayerSpec) is imported under the index of
    each layer whose file holds it; dsrun names it "tied_modules.{key}.*"."""
    for idx in sorted(files):
        state = read_pickle(files[idx])
        if not isinstance(state, dict):
            raise CheckpointError(f"{files[idx]} holds a {type(state).__name__}, not a layer's state_dict")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{files[idx]}: entry {key!r} is a {type(value).__name__}, not a tensor")
            out.values[f"{idx}.{key}"] = value.clone()


class _Collected:
    """What the import gathers: full fp32 tensors by name and their Adam states."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = OrderedDict()  # module tensors (params fp32, buffers as stored)
        self.states: dict[str, dict[str, torch.Tensor]] = {}  # name -> exp_avg / exp_avg_sq (flat fp32)
        self.steps: dict[str, Any] = {}  # name -> Adam step (tensor or number)
        self.group_of: dict[str, int] = {}
        self.frozen: list[str] = []

    def param(self, name: str, shape, value: torch.Tensor, state: dict | None, group: int, where: str) -> None:
        numel = 1
        for d in shape:
            numel *= d
        if value.numel() != numel:
            raise CheckpointError(f"{where}: parameter {name} needs {numel} elements, the file holds "
                                  f"{value.numel()}")
        self.values[name] = value.float().reshape(shape).clone()
        self.group_of[name] = group
        if state:
            self.states[name] = {k: state[k].float().reshape(-1).clone() for k in _ADAM_KEYS if k in state}
            if "step" in state:
                self.steps[name] = state["step"]


def _cut(flat: torch.Tensor, shapes: "OrderedDict[str, Any]", paddings: list[int] | None, where: str):
    """(name, shape, elements) of consecutive parameters in a flat group."""
    offset = 0
    for i, (name, shape) in enumerate(shapes.items()):
        numel = torch.Size(shape).numel()
        if offset + numel > flat.numel():
            raise CheckpointError(f"{where}: the flat fp32 group ends at {flat.numel()} elements, parameter "
                                  f"{name} needs [{offset}, {offset + numel})")
        yield name, tuple(shape), flat[offset:offset + numel]
        offset += numel + (paddings[i] if paddings else 0)


def _zero12(model: dict, optim_files: list[str], out: _Collected) -> dict:
    """ZeRO 1-2 and BF16_Optimizer: rank partitions of flat groups. Returns
    rank 0's optimizer_state_dict (hyperparameters, loss scaler)."""
    parts = [read_pickle(f)["optimizer_state_dict"] for f in optim_files]
    for g, group_shapes in enumerate(model["param_shapes"]):
        flat = torch.cat([p["single_partition_of_fp32_groups"][g] for p in parts])
        states = [p["base_optimizer_state"]["state"].get(g, {}) for p in parts]
        flat_states = {k: torch.cat([s[k] for s in states]) for k in _ADAM_KEYS if all(k in s for s in states)}
        paddings = parts[0].get("param_alignment_paddings")
        paddings = paddings[g] if paddings else None
        where = f"{optim_files[0]} group {g}"
        cut_states = {k: {n: v for n, _, v in _cut(t, group_shapes, paddings, where)} for k, t in flat_states.items()}
        for name, shape, value in _cut(flat, group_shapes, paddings, where):
            state = {k: cut_states[k][name] for k in cut_states}
            if "step" in states[0]:
                state["step"] = states[0]["step"]
            out.param(name, shape, value, state, g, where)
    return parts[0]


def _zero3(models: list[dict], optim_files: list[str], out: _Collected) -> dict:
    """ZeRO 3: each parameter split evenly over the ranks (padded). Returns
    rank 0's optimizer_state_dict."""
    world = len(optim_files)
    parts = [read_pickle(f)["optimizer_state_dict"] for f in optim_files]
    flats = [torch.cat(p["fp32_flat_groups"]) for p in parts]
    per_rank_states = []
    for p in parts:
        state = p["optimizer_state_dict"]["state"]
        subgroups = [state[i] for i in sorted(state)]
        per_rank_states.append({k: torch.cat([s[k].reshape(-1) for s in subgroups]) for k in _ADAM_KEYS
                                if subgroups and all(k in s for s in subgroups)})
    step = next((s["step"] for s in parts[0]["optimizer_state_dict"]["state"].values() if "step" in s), None)
    offset = 0
    for g, group_shapes in enumerate(models[0]["param_shapes"]):
        for name, shape in group_shapes.items():
            numel = torch.Size(shape).numel()
            piece = -(-numel // world)
            if offset + piece > flats[0].numel():
                raise CheckpointError(f"{optim_files[0]}: the fp32 groups end at {flats[0].numel()} elements, "
                                      f"parameter {name} needs [{offset}, {offset + piece})")
            value = torch.cat([f[offset:offset + piece] for f in flats])[:numel]
            state = {k: torch.cat([s[k][offset:offset + piece] for s in per_rank_states])[:numel]
                     for k in per_rank_states[0]}
            if step is not None:
                state["step"] = step
            out.param(name, tuple(shape), value, state, g, optim_files[0])
            offset += piece
    return parts[0]


def _no_zero(model: dict, path: str, out: _Collected) -> dict:
    """No ZeRO: the module's parameters; the torch optimizer's states indexed in
    parameter order; with 16-bit training the fp32 copies of DeepSpeed's
    16-bit wrapper. Returns the wrapper's state (or the torch optimizer's)."""
    buffers = set(model.get("buffer_names") or ())
    module = model["module"]
    names, seen = [], set()
    for name, t in module.items():  # parameters in order; a tied one appears under its first name
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if name not in buffers and key not in seen:
            seen.add(key)
            names.append(name)
    opt = model.get("optimizer") or {}
    inner = opt.get("optimizer_state_dict", opt)  # the 16-bit wrapper nests the torch state_dict
    groups = inner.get("param_groups") or [{"params": list(range(len(names)))}]
    state, flat_groups = inner.get("state", {}), opt.get("fp32_groups_flat")
    masters = [t for group in opt["fp32_groups"] for t in group] if "fp32_groups" in opt else None
    index = 0
    for g, group in enumerate(groups):
        start = 0  # element offset inside group g's flat fp32 tensor (fp32_groups_flat)
        for pid in group["params"]:
            if index >= len(names):
                raise CheckpointError(f"{path}: the optimizer holds more parameters than the module")
            name = names[index]
            numel = module[name].numel()
            if flat_groups is not None:  # one flat tensor per group, its states those of the flat tensor
                cut = slice(start, start + numel)
                value = flat_groups[g][cut]
                st = {k: (v.reshape(-1)[cut] if k in _ADAM_KEYS else v) for k, v in state.get(g, {}).items()}
                start += numel
            else:
                value = masters[index] if masters is not None else module[name]
                st = state.get(pid, {})
            out.param(name, tuple(module[name].shape), value, st, g, path)
            index += 1
    for name in names[index:]:  # not in the optimizer: frozen
        out.values[name] = module[name].clone()
        out.frozen.append(name)
    return opt


def _buffers_and_frozen(models: list[dict], out: _Collected) -> None:
    """Buffers, and the frozen parameters of ZeRO checkpoints (whole in
    `module` at ZeRO 1-2, one fragment per rank at ZeRO 3)."""
    model = models[0]
    for name in model.get("buffer_names") or ():
        if name in model["module"]:
            out.values[name] = model["module"][name].clone()
    for name, shape in (model.get("frozen_param_shapes") or {}).items():
        numel = torch.Size(shape).numel()
        value = model["module"].get(name)
        if value is None or value.numel() != numel:  # ZeRO 3
            value = torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in models])[:numel]
        out.values[name] = value.reshape(tuple(shape)).clone()
        out.frozen.append(name)


def _scaler(optim: dict) -> dict | None:
    """DeepSpeed's loss scaler (a LossScaler object in ZeRO files, plain keys
    in the 16-bit wrapper's state) as dsrun's scaler state."""
    attrs = vars(optim["loss_scaler"]) if optim.get("loss_scaler") is not None else optim
    if "cur_scale" not in attrs:
        return None
    if "cur_iter" in attrs and attrs.get("dynamic_loss_scale", attrs.get("dynamic", True)):
        return {"scale": float(attrs["cur_scale"]), "hysteresis_left": int(attrs.get("cur_hysteresis", 1)),
                "iteration": int(attrs["cur_iter"]),
                "last_overflow_iteration": int(attrs.get("last_overflow_iter", -1))}
    return {"scale": float(attrs["cur_scale"])}


def _jsonable(value: Any, what: str) -> Any:
    """`value` through JSON, or None (with a warning) when it holds other objects."""
    def refuse(obj):
        raise TypeError(type(obj).__name__)
    try:
        return json.loads(json.dumps(value, allow_nan=True, default=refuse))
    except (TypeError, ValueError) as e:
        log.warning("import-deepspeed: %s is not JSON-able (%s); left out", what, e)
        return None


def import_deepspeed(ds_dir: str, out_dir: str, tag: str | None = None) -> str:
    """Convert DeepSpeed checkpoint `ds_dir` (its save directory with
    `latest`, or a tag directory; `tag` picks one) into a dsrun checkpoint
    under out_dir/<tag>/ (and out_dir/latest). Returns the new tag directory.

    Raises CheckpointError naming the file: not a DeepSpeed checkpoint, a
    missing rank file, a file that needs a class outside the allow-list (see
    [Note: reading DeepSpeed's pickles]), sizes that do not add up.
    """
    tag_dir = _tag_dir(ds_dir, tag)
    layers = _layer_files(tag_dir)
    if layers:
        return _import_pipeline(tag_dir, layers, out_dir)
    optim_files = _rank_files(tag_dir, "optim")
    model_files = _rank_files(tag_dir, "model") or [os.path.join(tag_dir, "mp_rank_00_model_states.pt")]
    models = [read_pickle(f) for f in model_files]
    out = _Collected()
    if len(model_files) > 1 or "fp32_flat_groups" in (read_pickle(optim_files[0])["optimizer_state_dict"]
                                                        if optim_files else {}):
        stage, optim = 3, _zero3(models, optim_files, out)
    elif optim_files:
        optim = _zero12(models[0], optim_files, out)
        stage = int(optim.get("zero_stage", 1))  # DeepSpeed's BF16_Optimizer records none: ZeRO 1
    else:
        stage, optim = 0, _no_zero(models[0], model_files[0], out)
    _buffers_and_frozen(models, out)
    return _write(out, os.path.join(out_dir, os.path.basename(os.path.normpath(tag_dir))), out_dir,
                  _fields(models[0], optim, stage))


def _import_pipeline(tag_dir: str, layers: dict[int, str], out_dir: str) -> str:
    """A pipeline checkpoint: the layers' weights (see [Note: importing a
    pipeline's layers]) and `mp_rank_00_model_states.pt`'s counters, LR
    scheduler, config and optimizer hyperparameters when it is there."""
    out = _Collected()
    _pipeline_layers(layers, out)
    engine_file = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    model = read_pickle(engine_file) if os.path.isfile(engine_file) else {}
    optim = model.get("optimizer") or {}
    stage = int(((model.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    log.warning("import-deepspeed: %s is a pipeline checkpoint: its %d layers' weights are imported, its "
                "optimizer states are not (load it with load_optimizer_states=False)", tag_dir, len(layers))
    return _write(out, os.path.join(out_dir, os.path.basename(os.path.normpath(tag_dir))), out_dir,
                  _fields(model, optim, stage))


def _fields(model: dict, optim: dict, stage: int) -> dict:
    """The index fields read from DeepSpeed's model-states file `model` and
    optimizer state `optim` ({} when absent)."""
    config = model.get("ds_config") or {}
    precision = ("bf16" if (config.get("bf16") or {}).get("enabled") else
                 "fp16" if (config.get("fp16") or {}).get("enabled") else "fp32")
    base = optim.get("base_optimizer_state") or optim.get("optimizer_state_dict") or optim
    param_groups = [{k: v for k, v in g.items() if k != "params"} for g in base.get("param_groups", [])]
    steps = int(model.get("global_steps") or 0)
    counters = {"global_steps": steps, "global_samples": int(model.get("global_samples") or 0),
                "skipped_steps": int(model.get("skipped_steps") or 0),
                "micro_steps": steps * int(config.get("gradient_accumulation_steps") or 1)}
    fields = dict(stage=stage, precision=precision, config=_jsonable(config, "ds_config") or {},
                  param_groups=_jsonable(param_groups, "optimizer param_groups") or [], scaler=_scaler(optim),
                  counters=counters, lr_scheduler=_jsonable(model.get("lr_scheduler"), "the LR scheduler state"),
                  client_state=_jsonable({k: v for k, v in model.items() if k not in _ENGINE_KEYS},
                                         "client state") or {})
    return fields


def _write(out: _Collected, new_dir: str, out_dir: str, fields: dict) -> str:
    """One shard plus index.json under new_dir, then out_dir/latest."""
    file = shard_name(0, 1)
    tensors, entries = {}, {}
    for name, value in out.values.items():
        for key, t in [("module", value), *((f"optim/{k}", v) for k, v in out.states.get(name, {}).items())]:
            gname = f"module/{name}" if key == "module" else f"optim/{name}/{key[len('optim/'):]}"
            tensors[gname] = t.reshape(-1)
            entries[gname] = TensorEntry(shape=list(value.shape), dtype=dtype_name(t.dtype),
                                         slices=[StoredSlice(file=file, key=gname, lo=0, hi=t.numel())])
    scalars = {name: {"step": {"value": step.item() if isinstance(step, torch.Tensor) else step,
                               "dtype": dtype_name(step.dtype) if isinstance(step, torch.Tensor) else None}}
               for name, step in out.steps.items()}
    os.makedirs(new_dir, exist_ok=True)
    if os.path.exists(os.path.join(new_dir, INDEX)):
        os.unlink(os.path.join(new_dir, INDEX))  # overwriting: incomplete first, never mixed
    written = ShardWriter(os.path.join(new_dir, file), tensors, {"dsrun": json.dumps({"rank": 0})},
                          set(tensors), AioConfig()).write()
    fsync_dir(new_dir)
    index = Index(tag=os.path.basename(new_dir), saved_at_ns=time.time_ns(), dsrun_version=dsrun.__version__,
                  torch_version=torch.__version__, world_size=1, tensors=entries, optimizer_scalars=scalars,
                  group_of=out.group_of, rng=[], frozen=out.frozen,
                  files={file: written}, **fields)
    write_json_atomic(os.path.join(new_dir, INDEX), index.model_dump(mode="json"))
    atomic_write(os.path.join(out_dir, LATEST), [os.path.basename(new_dir).encode()])
    fsync_dir(out_dir)
    return new_dir
