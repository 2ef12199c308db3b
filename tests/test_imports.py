"""The package's import graph (imports inside functions count too): no cycle, and no module
importing a layer above its own; the control plane's modules import without MLX."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The package's layers, bottom first: a module may import its own layer and those below. Names
# are module prefixes (a package stands for its modules).
LAYERS = [
    ("leaves", ["options", "atomic", "blas"]),  # errors and typed values, atomic files, the BLAS fix
    # what a run is and writes down (its config, records and files, a worker's job), when its workers train
    # and meet (schedules/), what a worker needs of a machine (machine/), and the parts a run is made of
    ("parts", ["objectives.kinds", "config", "mlx_lm_config", "records", "run_folder", "run_status", "worker_job",
               "schedules", "hub", "machine", "exchange", "models", "data"]),
    ("strategies", ["strategies", "objectives"]),  # and the objectives (post-training)
    ("training", ["training"]),
    ("tools", ["tools", "gym", "cluster", "dashboard"]),  # what the commands run
    ("entry points", ["api", "cli", "__main__"]),
]
# The package's __init__ holds the version (which anything may read) and hands out the API on first use.
FACADE = "mlx_diloco"
# Imported without MLX: what the agent, discover and the launcher's planning run on (a Mac's agent stays small).
MLX_FREE = ["options", "atomic", "blas", "objectives.kinds", "config", "mlx_lm_config", "records", "run_folder",
            "run_status", "worker_job", "schedules.schedule", "schedules.speeds", "schedules.membership",
            "schedules.sync_period", "hub", "machine.memory", "machine.utilisation", "exchange.network", "exchange.ledger",
            "cluster.agent", "cluster.discovery", "cluster.protocol", "cluster.hostinfo", "cluster.launcher",
            "cluster.supervisor", "cluster.job_files", "cluster.ringplan", "cluster.backend", "cluster.hostfile",
            "dashboard.server",
            "cluster.links", "cluster.linktests"]


def import_graph() -> dict:
    """{module: the package's modules it imports}, read from the source with ast."""
    files = {}
    for f in (ROOT / "mlx_diloco").rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {m: set() for m in files}
    for module, f in files.items():
        package = module.split(".") if f.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    """The index in LAYERS of `module` ('mlx_diloco.training.run' -> 3), or a failed assertion
    naming a module that no layer lists."""
    name = module.removeprefix(FACADE + ".")
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it to one")


def upward_imports(graph: dict) -> list:
    """'a (layer) imports b (layer above)' for every import of a layer above the importer's."""
    found = []
    for module, imported in sorted(graph.items()):
        if module == FACADE:
            continue
        for other in sorted(imported - {FACADE}):
            if layer_of(other) > layer_of(module):
                found.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {other} "
                             f"({LAYERS[layer_of(other)][0]})")
    return found


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports(import_graph()) == []


def test_an_upward_import_would_be_found():
    graph = {"mlx_diloco.config": {"mlx_diloco.strategies"}, "mlx_diloco.strategies": {"mlx_diloco.config"}}
    assert upward_imports(graph) == ["mlx_diloco.config (parts) imports mlx_diloco.strategies (strategies)"]


def test_the_control_plane_imports_without_mlx():
    code = (f"import importlib, sys\nfor m in {MLX_FREE!r}:\n    importlib.import_module('mlx_diloco.' + m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and graph["mlx_diloco.training.run"]  # the graph was read
    assert cycles(graph) == []


def test_a_cycle_would_be_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
