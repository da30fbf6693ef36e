"""The package's imports, read with ``ast``: no cycle between its modules, no import inside a function.

Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so such an import is an edge to those
packages too (not to the importer's own packages: they are already running). An import inside a function
hides a cycle until the call; only optional dependencies may be imported there.
"""

import ast
import pathlib
from typing import Dict, List, Optional, Set

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torchrec_hybrid"
OPTIONAL = {"matplotlib"}  # pyproject.toml's extras


def _modules() -> Dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(path.read_text(), str(path))
    return out


def _targets(node: ast.AST, module: str, package: bool, modules: Set[str]) -> List[str]:
    """What an import names, as absolute module names (``from m import x``: ``m.x`` where that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        parts = (module if package else module.rpartition(".")[0]).split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _graph() -> Dict[str, Set[str]]:
    trees = _modules()
    graph: Dict[str, Set[str]] = {m: set() for m in trees}
    for m, tree in trees.items():
        package = (PACKAGE.parent / (m.replace(".", "/") + "/__init__.py")).exists()
        running = {m.rsplit(".", i)[0] for i in range(m.count(".") + 1)}  # m and the packages it is in
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, m, package, set(trees)):
                    parts = target.split(".")
                    graph[m].update(t for t in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                                    if t in trees and t not in running)
    return graph


def _cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the path, 2: done
    path: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            found = None if n in state else visit(n)
            if found:
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        found = None if m in state else visit(m)
        if found:
            return found
    return None


def test_the_package_imports_no_module_that_imports_it_back():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_inside_a_function_but_optional_dependencies():
    found = []
    for m, tree in _modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                        found += [f"{m}.{fn.name} (line {node.lineno}): {n}" for n in names
                                  if n.split(".")[0] not in OPTIONAL]
    assert not found, "imports inside functions:\n" + "\n".join(found)


def test_no_code_reads_its_callers_stack_frames():
    """Behaviour follows from what TorchRec passes, never from who called (no ``inspect.currentframe``,
    ``sys._getframe``, ``f_locals`` / ``f_back``)."""
    found = [f"{name}:{node.lineno} {node.attr}" for name, tree in _modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in {"currentframe", "_getframe", "f_locals", "f_back"}]
    assert not found, found
