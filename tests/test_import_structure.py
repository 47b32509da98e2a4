"""dsrun's import graph: no cycles among its modules, and every documented import path imports.

The graph counts every `import` statement in a module, at any depth: module
level, inside functions and under `if TYPE_CHECKING:` (a cycle hidden by a
late import is still two modules that need each other).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dsrun"

# Cycles tolerated for now (none left). The test fails on any other cycle,
# and on an entry here that no longer is one, so the list only shrinks.
KNOWN_CYCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(module: str, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The dsrun modules one import statement names (a name imported from a
    package counts as its submodule when there is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if modules[module].name != "__init__.py":
                package = package[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the dsrun modules it imports anywhere in its body."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_targets(name, node, modules) for node in ast.walk(tree)
                                    if isinstance(node, (ast.Import, ast.ImportFrom))))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, 1972), iteratively."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [{"a", "b", "c"}]


def test_no_new_import_cycles():
    found = cycles(import_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not new, f"import cycles among dsrun's modules: {new}; import from a leaf module instead"
    assert not gone, f"{gone} is no longer a cycle: remove it from KNOWN_CYCLES"


# The runtime's layers, bottom up: a package imports only those before it -- the
# parallelism mesh and layers; the gradient-strategy interface; ZeRO, strategies over
# the mesh's data axis; the engine, which composes them all (no pair imports each
# other, which the earlier KNOWN_LAYER_PAIRS list tolerated until it was empty).
LAYERS = ["dsrun.runtime.parallel", "dsrun.runtime.strategy", "dsrun.runtime.zero", "dsrun.runtime.engine"]


def layer_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(package, package) -> the (module, module) imports from one of LAYERS into another."""
    def layer(module: str) -> str | None:
        return next((p for p in LAYERS if module == p or module.startswith(p + ".")), None)

    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = layer(module), layer(target)
            if a and b and a != b:
                edges.setdefault((a, b), []).append((module, target))
    return edges


def test_layer_pairs_finder_finds_a_planted_pair():
    graph = {"dsrun.runtime.zero.a": {"dsrun.runtime.parallel.mesh"}, "dsrun.runtime.parallel.mesh": set(),
             "dsrun.runtime.parallel.b": {"dsrun.runtime.zero.c"}, "dsrun.runtime.zero.c": set()}
    edges = layer_edges(graph)
    assert edges[("dsrun.runtime.zero", "dsrun.runtime.parallel")] == [("dsrun.runtime.zero.a",
                                                                        "dsrun.runtime.parallel.mesh")]
    assert ("dsrun.runtime.parallel", "dsrun.runtime.zero") in edges


def test_upward_finder_finds_a_planted_upward_import():
    graph = {"dsrun.runtime.parallel.b": {"dsrun.runtime.zero.c"}, "dsrun.runtime.zero.c": set()}
    assert upward_imports(layer_edges(graph)) == {("dsrun.runtime.parallel", "dsrun.runtime.zero"):
                                                  [("dsrun.runtime.parallel.b", "dsrun.runtime.zero.c")]}


def upward_imports(edges: dict[tuple[str, str], list[tuple[str, str]]]) -> dict:
    """The entries of `edges` that import a layer listed after the importer's in LAYERS."""
    return {(a, b): imports for (a, b), imports in edges.items() if LAYERS.index(a) < LAYERS.index(b)}


def test_runtime_layers_import_only_downward():
    """runtime/parallel imports none of strategy, zero and engine; strategy
    neither zero nor engine; zero not the engine. So no two of them import
    each other (a module-level cycle is caught above; this is the package
    level)."""
    upward = upward_imports(layer_edges(import_graph()))
    assert not upward, (f"imports against the layer order {LAYERS} ((importer, imported) package: modules): "
                        f"{upward}; move the code to the lower layer or pass it in as an argument")



# The modules that may read the process-global mesh (runtime/parallel/mesh.py
# current(), [Note: the declared mesh]), each for what it answers or builds
# before or outside the engine; everything inside the engine is handed the mesh.
DECLARED_MESH_READERS = {
    "dsrun.utils.groups": "DeepSpeed's groups answers",
    "dsrun.runtime.activation_checkpointing.checkpointing": "the model-parallel rank without an mpu",
    "dsrun.runtime.comm.deepspeed_api": "init_distributed(config=...) declares the mesh",
    "dsrun.runtime.engine.entry": "initialize reads the declared mesh once, when it begins",
    "dsrun.runtime.engine.tp_model_init": "tp_model_init, called before initialize",
    "dsrun.runtime.parallel.tensor.layers": "Megatron layers a script builds without a mesh",
    "dsrun.runtime.parallel.expert.layer": "MoE layers a script builds",
    "dsrun.runtime.parallel.sequence.data": "shard_sequence without a group",
    "dsrun.runtime.parallel.sequence.loss": "sequence_parallel_loss without a group",
    "dsrun.runtime.parallel.sequence.hf": "wrap_hf_attention without a group",
}


def current_mesh_readers() -> set[str]:
    """The dsrun modules that call runtime/parallel/mesh.py's current(), as a
    name imported from it or an attribute of the module."""
    readers = set()
    for name, path in _modules().items():
        if name == "dsrun.runtime.parallel.mesh":
            continue
        functions, modules = set(), set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "dsrun.runtime.parallel.mesh":
                functions |= {a.asname or a.name for a in node.names if a.name == "current"}
            elif isinstance(node, ast.ImportFrom) and node.module == "dsrun.runtime.parallel":
                modules |= {a.asname or a.name for a in node.names if a.name == "mesh"}
            elif isinstance(node, ast.Import):
                modules |= {a.asname for a in node.names if a.name == "dsrun.runtime.parallel.mesh" and a.asname}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id in functions)
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "current"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id in modules)):
                readers.add(name)
    return readers


def test_only_the_listed_modules_read_the_declared_mesh():
    readers = current_mesh_readers()
    assert readers <= set(DECLARED_MESH_READERS), (
        f"{sorted(readers - set(DECLARED_MESH_READERS))} read the process-global mesh (current()); pass the "
        "engine's mesh in as an argument instead ([Note: the declared mesh] in runtime/parallel/mesh.py)")
    assert set(DECLARED_MESH_READERS) <= readers, (
        f"{sorted(set(DECLARED_MESH_READERS) - readers)} no longer call current(): remove them from "
        "DECLARED_MESH_READERS")

# Import paths the README, the docs or DeepSpeed's users name ("module:attribute"
# for names reached as attributes, as `deepspeed.zero.Init` is in DeepSpeed too).
DOCUMENTED = [
    "dsrun:zero.Init", "dsrun:zero.GatheredParameters", "dsrun:checkpointing.checkpoint", "dsrun:initialize",
    "dsrun.comm", "dsrun.accelerator:get_accelerator", "dsrun.pipe:PipelineModule",
    "dsrun.pipe:LayerSpec", "dsrun.pipe:TiedLayerSpec", "dsrun.runtime.pipe.topology:PipeDataParallelTopology",
    "dsrun.runtime.pipe.engine:PipelineEngine", "dsrun.runtime.pipe.module:PipelineModule",
    "dsrun.utils", "dsrun.utils.groups", "dsrun.utils.zero_to_fp32", "dsrun.monitor.monitor",
    "dsrun.checkpoint.utils", "dsrun.moe.layer", "dsrun.profiling.flops_profiler",
    "dsrun.runtime.engine:DeepSpeedEngine", "dsrun.runtime.utils", "dsrun.runtime.lr_schedules:WarmupLR",
    "dsrun.runtime.dataloader:RepeatingLoader",
    "dsrun.runtime.zero.partition_parameters", "dsrun.runtime.fp16.onebit.adam",
    "dsrun.runtime.fp16.onebit.zoadam", "dsrun.runtime.fp16.onebit.lamb",
    "dsrun.runtime.activation_checkpointing.checkpointing", "dsrun.runtime.config",
    "dsrun.ops.adam", "dsrun.ops.lion", "dsrun.ops.adagrad", "dsrun.ops.lamb", "dsrun.ops.aio",
    "dsrun.launcher.cli", "dsrun.runtime.checkpoint.cli",
]


@pytest.mark.parametrize("path", DOCUMENTED)
def test_documented_import_path(path):
    module, _, attribute = path.partition(":")
    obj = importlib.import_module(module)
    for name in filter(None, attribute.split(".")):
        obj = getattr(obj, name)
