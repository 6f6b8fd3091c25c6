"""No module-level mutable state (docs/architecture.md, "Design invariants"): no function of hpctrain/
declares ``global``, and none writes into a module-level name (``NAME[k] = v``, ``del NAME[k]``,
``NAME.attr = v``, ``NAME.append(...)``, ``NAME.update(...)``, ...), so nothing depends on import order."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "discard", "remove", "pop", "popitem",
            "clear", "__setitem__", "__delitem__"}


def module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def local_names(function) -> set[str]:
    args = function.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a}
    return names | {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def writes(path: Path, root: Path = REPO) -> list[str]:
    """file:line of each write into module state inside a function of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    shared, found = module_names(tree), []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        outer = shared - local_names(function)
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found.append(f"{path.relative_to(root)}:{node.lineno}: global {', '.join(node.names)}")
            target = None
            if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                target = node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                target = node.func.value
            if isinstance(target, ast.Name) and target.id in outer:
                found.append(f"{path.relative_to(root)}:{node.lineno}: writes into module-level {target.id}")
    return found


def test_no_function_writes_module_state():
    assert [w for path in sorted((REPO / "hpctrain").rglob("*.py")) for w in writes(path)] == []


def test_the_check_sees_a_registry_filled_at_import(tmp_path):
    source = tmp_path / "registry.py"
    source.write_text("REGISTRY = {}\n\n\ndef register(cls):\n    REGISTRY[cls.name] = cls\n    return cls\n\n\n"
                      "def count():\n    global CALLS\n    CALLS += 1\n\n\ndef local():\n    REGISTRY = {}\n"
                      "    REGISTRY['a'] = 1\n")
    assert writes(source, tmp_path) == ["registry.py:5: writes into module-level REGISTRY",
                                        "registry.py:10: global CALLS"]
