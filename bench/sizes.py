"""How big the package's pieces are, and where each piece of the cluster wing's knowledge is
written (issue 37), for this checkout or another one, side by side.

    python bench/sizes.py [--root /work/base] [--no-worker]

Prints: the largest classes and functions (lines); each knowledge item with file:line where it
is declared (the worker's job fields, launch options, the collective timeout's default, the sync
rule `(t - offset) % H`, the metrics row's keys); the package modules each process loads on the
way from `launch` to a remote worker's first step (the launcher, the agent, and a real worker
trained for one step: `sys.modules` at its end); the import graph's cycles and upward imports
(tests/test_imports.py's layers, read from the checkout measured).
"""

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from mlx_diloco.blas import find_openblas  # noqa: E402

# The fields a worker's job is made of, under every spelling the package has used for them.
JOB_FIELDS = {"shard_dir", "data_dir", "data_worker", "num_shards", "progress_path", "progress", "control_path",
              "control", "checkpoint_dir", "own_run_dir", "ring_slots", "joiners", "resume_step",
              "collective_timeout", "workers_per_process"}
LAUNCH_OPTIONS = {"on_loss", "collective_timeout", "heartbeat_timeout", "max_restarts", "data_on_workers",
                  "min_workers", "max_workers", "add", "backend", "measure_links"}
# The sync rule in its written forms: (t - offset) % H, t % H, (t + 1) % period, ...
SYNC_RULE = re.compile(r"\(\s*\w+(\s*[-+]\s*[\w.]+)+\s*\)\s*%\s*(self\.)?(H|sync_every|period|every)\b"
                       r"|\b(step|tick|t)\s*%\s*(self\.)?(H|sync_every|period|every)\b")
TIMEOUT_DEFAULT = re.compile(r"collective_timeout\s*:\s*float\s*=\s*(option\()?\d|--collective-timeout.*default=\d"
                             r"|(init_ring|group).*timeout_s: float = \d")
# Keys of the run's records (records.py), spelled as literals in code (docstrings and comments apart).
RECORD_KEYS = ("eval_loss", "train_loss", "sync_s", "compute_s", "link_s", "straggler_s", "bytes_sent_per_worker",
               "tokens_per_s", "final_eval_loss", "wall_s", "peak_exchange_bytes", "measured_utilisation", "busy_s",
               "modelled_time_s", "tokens_per_shard", "inner_steps_lost", "eval_loss_workers", "blocked_s",
               "exposed_s", "job_tokens_per_s", "steps_per_s", "restart_s", "total_s", "peak_memory_bytes")


def python_files(root: Path) -> list:
    return sorted((root / "mlx_diloco").rglob("*.py"))


def where(root: Path, f: Path, line: int) -> str:
    return f"{f.relative_to(root)}:{line}"


def largest(root: Path, n: int = 5) -> tuple:
    classes, functions = [], []
    for f in python_files(root):
        for node in ast.walk(ast.parse(f.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                classes.append((size, f"{node.name} ({where(root, f, node.lineno)}, {methods} methods)"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((size, f"{node.name} ({where(root, f, node.lineno)})"))
    return sorted(classes, reverse=True)[:n], sorted(functions, reverse=True)[:n]


def declarations(root: Path, names: set) -> dict:
    """{'Class (file:line)': [fields]}: the classes (dataclasses, schemas) that declare fields of
    `names`, and the argparse flags and message schemas naming them."""
    found = {}
    for f in python_files(root):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = [b.target.id for b in node.body if isinstance(b, ast.AnnAssign)
                       and isinstance(b.target, ast.Name) and b.target.id in names]
                if own:
                    found[f"class {node.name} ({where(root, f, node.lineno)})"] = own
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--"):
                name = str(node.args[0].value)[2:].replace("-", "_")
                if name in names:
                    found.setdefault(f"argparse flags ({f.relative_to(root)})", []).append(name)
            elif isinstance(node, ast.Dict):  # a message schema or a request naming the fields as keys
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
                if len(keys) >= 2:
                    found[f"dict ({where(root, f, node.lineno)})"] = keys
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "request":
                keys = [k.arg for k in node.keywords if k.arg in names]
                if len(keys) >= 2:
                    found[f"request ({where(root, f, node.lineno)})"] = keys
    return found


def lines_matching(root: Path, pattern) -> list:
    return [f"{where(root, f, i)}  {line.strip()[:90]}" for f in python_files(root)
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]


def code_strings(tree) -> set:
    """The string constants of a module's code: its docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def record_keys(root: Path) -> dict:
    """{key: the files that spell it as a string literal in code}: where a record's key is written."""
    out = {}
    for f in python_files(root):
        strings = code_strings(ast.parse(f.read_text()))
        for key in RECORD_KEYS:
            if key in strings:
                out.setdefault(key, []).append(str(f.relative_to(root)))
    return out


def loaded_modules(root: Path, code: str) -> list:
    # OpenBLAS preloaded here, as the CLI would re-exec itself to (else the dump would be lost)
    env = {**os.environ, "PYTHONPATH": str(root), "MLX_DILOCO_NO_BLAS_FIX": "1",
           "LD_PRELOAD": ":".join(filter(None, [find_openblas(), os.environ.get("LD_PRELOAD")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=600)
    if out.returncode or "MODULES " not in out.stdout:
        sys.exit(f"failed in {root}:\n{out.stderr[-2000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("MODULES "))[8:])


DUMP = "import sys, json; print('MODULES', json.dumps(sorted(m for m in sys.modules if m.startswith('mlx_diloco'))))"


def worker_modules(root: Path) -> list:
    """The package modules a worker has loaded by the end of a one-step job (one process: a ring of one)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = dict(model="tiny", seq_len=16, batch_size=4, workers=1, steps=1, warmup=0, eval_sequences=4,
                      sync_every=1)
        (tmp / "job.json").write_text(json.dumps({"config": config, "run_dir": str(tmp / "run")}))
        (tmp / "hostfile.json").write_text(json.dumps([["127.0.0.1:1"]]))
        os.environ.update(MLX_RANK="0", MLX_HOSTFILE=str(tmp / "hostfile.json"))
        code = (f"import atexit, runpy, sys\natexit.register(lambda: ({DUMP.split('; ', 1)[1]}))\n"
                f"import sys, json\nsys.argv = ['mlx-diloco', 'worker', '--job', {str(tmp / 'job.json')!r}]\n"
                "runpy.run_module('mlx_diloco', run_name='__main__')")
        return loaded_modules(root, code)


def import_checks(root: Path) -> tuple:
    spec = importlib.util.spec_from_file_location("imports_of_root", root / "tests" / "test_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ROOT = root
    graph = module.import_graph()
    return module.cycles(graph), module.upward_imports(graph)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(HERE), help="the checkout to measure (default: this one)")
    p.add_argument("--no-worker", action="store_true", help="skip training a one-step worker")
    root = Path(p.parse_args().root).resolve()
    args = p.parse_args()
    lines = sum(len(f.read_text().splitlines()) for f in python_files(root))
    print(f"# {root}: {len(python_files(root))} modules, {lines} lines")
    classes, functions = largest(root)
    print("\nlargest classes (lines):\n" + "\n".join(f"  {n:4d} {what}" for n, what in classes))
    print("largest functions (lines):\n" + "\n".join(f"  {n:4d} {what}" for n, what in functions))
    for title, names in (("the worker's job fields", JOB_FIELDS), ("launch options", LAUNCH_OPTIONS)):
        found = declarations(root, names)
        print(f"\n{title}: declared in {len(found)} places")
        for place, keys in found.items():
            print(f"  {place}: {len(keys)} ({', '.join(keys[:6])}{', ...' if len(keys) > 6 else ''})")
    for title, pattern in (("collective timeout defaults", TIMEOUT_DEFAULT), ("the sync rule", SYNC_RULE)):
        found = lines_matching(root, pattern)
        print(f"\n{title}: {len(found)}\n" + "\n".join(f"  {line}" for line in found))
    keys = record_keys(root)
    outside = sum(f != "mlx_diloco/records.py" for files in keys.values() for f in files)
    print(f"\nrecord keys spelled as string literals in code: {sum(map(len, keys.values()))}, outside records.py "
          f"{outside} (key, files)")
    for key, files in keys.items():
        print(f"  {key}: {len(files)}  {' '.join(files)}")
    launcher = loaded_modules(root, f"import mlx_diloco.cli, mlx_diloco.cluster.launcher; {DUMP}")
    agent = loaded_modules(root, f"import mlx_diloco.cluster.agent; {DUMP}")
    print(f"\nmodules loaded on the way from launch to a worker's first step: launcher {len(launcher)}, "
          f"agent {len(agent)}", end="")
    if not args.no_worker:
        worker = worker_modules(root)
        print(f", worker {len(worker)}; distinct {len(set(launcher) | set(agent) | set(worker))}")
        print(f"  the worker's: {' '.join(m.removeprefix('mlx_diloco.') for m in worker)}")
    else:
        print()
    cycles, upward = import_checks(root)
    print(f"\nimport graph: {len(cycles)} cycles, {len(upward)} upward imports")
    for line in [*map(str, cycles), *upward]:
        print(f"  {line}")


if __name__ == "__main__":
    main()
