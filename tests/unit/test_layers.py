"""The layer table (hpctrain/layers.py) holds for every import in hpctrain/, function-level ones included:
each points to its module's layer or one below, nothing imports in a cycle, the layers of NO_TORCH_LAYERS
import neither torch nor mpi4py, and docs/architecture.md shows the same table."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.layers import LAYERS, NO_TORCH_LAYERS, ROOT, layer_of, unit_of

REPO = Path(__file__).resolve().parents[2]


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every .py file of the package under ``root``."""
    found = {}
    for path in sorted((root / ROOT).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(module: str, path: Path, known) -> list[tuple[int, str]]:
    """(line, imported module) for every hpctrain import in ``path``, wherever it stands in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base))
    return [(line, name) for line, name in dict.fromkeys(found) if name == ROOT or name.startswith(ROOT + ".")]


def import_graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    known = modules(root)
    return {module: imports(module, path, known) for module, path in known.items()}


def violations(root: Path) -> list[str]:
    """One line per import against the table: file:line, the two modules and their layers."""
    found, known = [], modules(root)
    for module, edges in import_graph(root).items():
        for line, target in edges:
            if layer_of(target) > layer_of(module):
                where = known[module].relative_to(root)
                found.append(f"{where}:{line}: {module} (layer {LAYERS[layer_of(module)][0]}) imports {target} "
                             f"(layer {LAYERS[layer_of(target)][0]}, above it)")
    return sorted(found)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def module_cycles(root: Path) -> list[str]:
    """One line per cycle: each import inside it, as file:line."""
    graph, known = import_graph(root), modules(root)
    edges = {m: {t for _, t in e if t in known and t != m} for m, e in graph.items()}
    return ["; ".join(f"{known[m].relative_to(root)}:{line}: {m} imports {t}"
                      for m in component for line, t in sorted(graph[m]) if t in component and t != m)
            for component in cycles(edges)]


def unit_cycles(root: Path) -> list[str]:
    edges: dict[str, set[str]] = {}
    for module, imported in import_graph(root).items():
        edges.setdefault(unit_of(module), set()).update(unit_of(t) for _, t in imported)
    edges = {u: targets - {u} for u, targets in edges.items()}
    return [" <-> ".join(c) for c in cycles(edges)]


HEAVY = ("torch", "mpi4py")


def no_torch_modules(root: Path) -> dict[str, Path]:
    units = {unit for name, layer in LAYERS if name in NO_TORCH_LAYERS for unit in layer}
    return {module: path for module, path in modules(root).items() if unit_of(module) in units}


def heavy_imports(root: Path) -> list[str]:
    """file:line for every torch or mpi4py import in a module of a NO_TORCH_LAYERS layer, function-level too."""
    found = []
    for module, path in no_torch_modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(root)}:{node.lineno}: {module} (layer {LAYERS[layer_of(module)][0]}) "
                      f"imports {name}" for name in names if name.split(".")[0] in HEAVY]
    return sorted(found)


def test_every_module_has_a_layer():
    for module in modules(REPO):
        unit_of(module)  # raises, naming the module


def test_every_import_points_to_its_layer_or_below():
    assert violations(REPO) == []


def test_the_no_torch_layers_import_neither_torch_nor_mpi4py():
    assert heavy_imports(REPO) == []


def test_importing_the_no_torch_layers_loads_neither_torch_nor_mpi4py():
    """What they import from other layers (runtime, profiling, the parent packages) is light at import too."""
    names = sorted(no_torch_modules(REPO))
    assert "hpctrain.plan.planner" in names and "hpctrain.sweep.runs" in names
    code = (f"import importlib, sys\nfor m in {names!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


def test_no_import_cycle_between_modules():
    assert module_cycles(REPO) == []


def test_no_import_cycle_between_units():
    assert unit_cycles(REPO) == []


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_names_an_upward_import(tmp_path):
    write(tmp_path, "hpctrain/runtime/launcher.py", "from hpctrain.errors import LaunchError\n")
    write(tmp_path, "hpctrain/runtime/bad.py", "import os\n\n\ndef start():\n    from hpctrain.train.loop import x\n")
    write(tmp_path, "hpctrain/train/loop.py", "x = 1\n")
    assert violations(tmp_path) == [
        "hpctrain/runtime/bad.py:5: hpctrain.runtime.bad (layer runtime) imports hpctrain.train.loop "
        "(layer train, above it)"]


def test_the_checker_resolves_relative_and_submodule_imports(tmp_path):
    write(tmp_path, "hpctrain/comm/__init__.py", "")
    write(tmp_path, "hpctrain/comm/watchdog.py", "from . import grid\n")
    write(tmp_path, "hpctrain/comm/grid.py", "from ..config import layout\n")
    write(tmp_path, "hpctrain/config/layout.py", "")
    assert violations(tmp_path) == [
        "hpctrain/comm/watchdog.py:1: hpctrain.comm.watchdog (layer collectives) imports hpctrain.comm.grid "
        "(layer grid, above it)"]


def test_the_checker_names_a_torch_import_in_a_no_torch_layer(tmp_path):
    write(tmp_path, "hpctrain/plan/cost.py", "import math\n\n\ndef f():\n    import torch.nn\n")
    write(tmp_path, "hpctrain/sweep/runs.py", "from mpi4py import MPI\n")
    write(tmp_path, "hpctrain/train/loop.py", "import torch\n")
    assert heavy_imports(tmp_path) == [
        "hpctrain/plan/cost.py:5: hpctrain.plan.cost (layer plan) imports torch.nn",
        "hpctrain/sweep/runs.py:1: hpctrain.sweep.runs (layer sweep) imports mpi4py"]


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    write(tmp_path, "hpctrain/data/a.py", "from hpctrain.data.b import y\n")
    write(tmp_path, "hpctrain/data/b.py", "def f():\n    from hpctrain.data import a\n")
    assert module_cycles(tmp_path) == ["hpctrain/data/a.py:1: hpctrain.data.a imports hpctrain.data.b; "
                                       "hpctrain/data/b.py:2: hpctrain.data.b imports hpctrain.data.a"]


def test_an_unlisted_package_is_refused():
    with pytest.raises(KeyError, match="hpctrain/layers.py"):
        unit_of("hpctrain.newthing.x")
    assert unit_of("hpctrain") == "hpctrain" and unit_of("hpctrain.comm.grid.x") == "hpctrain.comm.grid"


def doc_rows() -> dict[str, str]:
    """Layer name -> its rows' text, from the ```text block under "## Layers" in docs/architecture.md."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"## Layers\n.*?```text\n(.*?)```", text, re.S).group(1)
    rows: dict[str, str] = {}
    name = None
    for line in block.splitlines()[1:]:  # the first line holds the column titles
        if line[:1].isalpha():
            name = line.split()[0]
            rows[name] = ""
        if name:
            rows[name] += line + "\n"
    return rows


def test_the_documented_table_is_this_table():
    rows = doc_rows()
    assert list(rows) == [name for name, _ in reversed(LAYERS)]  # the doc lists the top layer first
    for name, units in LAYERS:
        for unit in units:
            path = unit.replace(".", "/")
            shown = f"{path}/__init__.py" if unit == ROOT else (f"{path}.py", f"{path}/")
            assert any(p in rows[name] for p in ([shown] if isinstance(shown, str) else shown)), (name, unit)


def test_every_test_module_has_its_own_name():
    """pytest imports test modules by their base name (rootdir-relative "prepend" mode): two test files of one
    name in different folders stop the whole collection, so CI would run nothing."""
    from collections import Counter

    names = Counter(p.name for p in (Path(__file__).resolve().parents[1]).rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []
