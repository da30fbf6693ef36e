"""Private TorchRec / FBGEMM / torch names are used only in ``torchrec_hybrid/_compat.py``.

The rule, checked on the package's source with ``ast``:
- a private name is ``_x`` (not a dunder);
- *own* names are those the package gives itself: attributes it assigns on ``self``
  (``self._x = ...``, ``register_buffer("_x", ...)``, ``setattr(self, "_x", ...)``), class-level
  definitions, module-level definitions and module names;
- inside a class, ``self._x`` / ``cls._x`` / ``super()._x`` must be own to that class or one
  of its package bases, and must not be a name any TorchRec / FBGEMM / torch base class
  defines or sets (overriding or shadowing their internals counts as using them);
- any other ``obj._x`` (and ``getattr(obj, "_x")`` & co.) must be own somewhere in the
  package;
- importing ``_x`` from (or a ``_``-prefixed module of) torch / torchrec / fbgemm_gpu fails.

Blind spot: ``obj._x`` on a foreign object, where the package also gives some class of its
own an ``_x`` (e.g. ``_pg``), passes; the receiver's type is not known statically.
"""

import ast
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import torchrec_hybrid

PACKAGE = "torchrec_hybrid"
PACKAGE_DIR = Path(torchrec_hybrid.__file__).parent
COMPAT = "_compat.py"
FOREIGN_ROOTS = ("torch", "torchrec", "fbgemm_gpu")
STRING_ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")
REGISTERS = ("register_buffer", "register_parameter", "register_module", "add_module")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign(dotted: str) -> bool:
    return dotted.split(".")[0] in FOREIGN_ROOTS


def _self_attrs(tree: ast.AST, names=("self", "cls")) -> Set[str]:
    """Private names a class body assigns or reads on ``self`` (used for foreign sources too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            if _private(node.attr):
                out.add(node.attr)
    return out


_FOREIGN_CACHE: Dict[type, Set[str]] = {}


def _foreign_private_names(cls: type) -> Set[str]:
    """Private names a foreign class and its bases define in their dicts or use on ``self``."""
    if cls not in _FOREIGN_CACHE:
        names: Set[str] = set()
        for base in cls.__mro__:
            if base is object or not _foreign(getattr(base, "__module__", "") or ""):
                continue
            names |= {n for n in vars(base) if _private(n)}
            try:
                names |= _self_attrs(ast.parse(inspect.getsource(base).lstrip()))
            except (OSError, TypeError, SyntaxError, IndentationError):
                pass
        _FOREIGN_CACHE[cls] = names
    return _FOREIGN_CACHE[cls]


def _resolve(dotted: str) -> Optional[object]:
    """Imports ``a.b.C`` (longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return None
        return obj
    return None


def _dotted(expr: ast.AST) -> Optional[str]:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return None if inner is None else f"{inner}.{expr.attr}"
    if isinstance(expr, ast.Subscript):  # Generic[T], List[...] bases
        return _dotted(expr.value)
    return None


@dataclass
class _Class:
    module: str
    node: ast.ClassDef
    aliases: Dict[str, str]  # the module's import aliases: local name -> dotted path
    own: Set[str] = field(default_factory=set)


@dataclass
class _Source:
    path: str  # relative to the package's parent, for messages
    module: str
    tree: ast.Module
    aliases: Dict[str, str] = field(default_factory=dict)


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE] + parts)


def _aliases(module: str, tree: ast.Module) -> Dict[str, str]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: always inside the package
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def _class_own(node: ast.ClassDef) -> Set[str]:
    """Private names a class gives itself: class-level definitions, ``self._x`` assignments,
    registered buffers / parameters / modules and ``setattr(self, "_x", ...)``."""
    own = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for t in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                own |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    for n in ast.walk(node):
        targets = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
            targets = [n.target]
        for t in targets:
            for a in ast.walk(t):
                if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id in ("self", "cls"):
                    own.add(a.attr)
        if isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in REGISTERS and _dotted(f.value) == "self":
                own.add(n.args[0].value)
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
                and len(n.args) >= 2 and _dotted(n.args[0]) == "self" and isinstance(n.args[1], ast.Constant)):
            own.add(n.args[1].value)
    return {x for x in own if isinstance(x, str) and _private(x)}


class Checker:
    """Finds uses of private foreign names in a set of package sources."""

    def __init__(self, sources: Dict[str, Tuple[str, str]]) -> None:
        """sources: relative path -> (module name, source text)."""
        self.sources = []
        for path, (module, text) in sources.items():
            tree = ast.parse(text, filename=path)
            self.sources.append(_Source(path, module, tree, _aliases(module, tree)))
        self.classes: Dict[str, List[_Class]] = {}  # "module.Name" and bare "Name"
        self.global_own: Set[str] = set()
        for src in self.sources:
            self.global_own |= {p for p in src.module.split(".") if _private(p)}
            self.global_own |= {Path(src.path).stem} if _private(Path(src.path).stem) else set()
            for node in ast.walk(src.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                    self.global_own.add(node.name)
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                    self.global_own.add(node.id)
                if isinstance(node, ast.ClassDef):
                    c = _Class(src.module, node, src.aliases, _class_own(node))
                    if Path(src.path).name != COMPAT:  # _compat sets foreign attributes: not own
                        self.global_own |= c.own
                    self.classes.setdefault(f"{src.module}.{node.name}", []).append(c)
                    self.classes.setdefault(node.name, []).append(c)

    def _bases(self, cls: _Class, seen=None) -> Tuple[Set[str], Set[str]]:
        """(own names of the class and its package bases, private names of its foreign bases)."""
        seen = set() if seen is None else seen
        own, foreign = set(cls.own), set()
        if id(cls.node) in seen:
            return own, foreign
        seen.add(id(cls.node))
        for b in cls.node.bases:
            name = _dotted(b)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            full = cls.aliases.get(head, f"{cls.module}.{head}") + (f".{rest}" if rest else "")
            if full.startswith(PACKAGE + ".") or full.startswith(cls.module + "."):
                for local in self.classes.get(full, self.classes.get(name.split(".")[-1], [])):
                    o, f = self._bases(local, seen)
                    own |= o
                    foreign |= f
            elif _foreign(full):
                obj = _resolve(full)
                if isinstance(obj, type):
                    foreign |= _foreign_private_names(obj)
        return own, foreign

    def violations(self) -> List[str]:
        out = []
        for src in self.sources:
            if Path(src.path).name == COMPAT:
                continue
            out += self._imports(src)
            out += self._accesses(src, src.tree, None)
        return sorted(set(out))

    def _imports(self, src: _Source) -> List[str]:
        out = []
        for node in ast.walk(src.tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for m in mods:
                bad = [p for p in m.split(".") if _private(p)]
                if _foreign(m) and bad:
                    out.append(f"{src.path}:{node.lineno}: imports private {bad[0]} ({m})")
                    break
        return out

    def _accesses(self, src: _Source, scope: ast.AST, cls: Optional[_Class]) -> List[str]:
        out = []
        own, foreign = self._bases(cls) if cls is not None else (set(), set())
        if cls is not None:
            for stmt in cls.node.body:  # overriding a foreign base's private member
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name in foreign:
                    out.append(f"{src.path}:{stmt.lineno}: overrides private {stmt.name} of a "
                               f"torch/torchrec/fbgemm base")
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, ast.ClassDef):
                matches = [c for c in self.classes.get(f"{src.module}.{node.name}", []) if c.node is node]
                out += self._accesses(src, node, matches[0] if matches else None)
                continue
            for n in ast.walk(node):
                hit = self._access(n)
                if hit is None:
                    continue
                target, name = hit
                if target == "self" and cls is not None:
                    ok = name in own and name not in foreign
                else:
                    ok = name in self.global_own and target != "super"
                if not ok:
                    out.append(f"{src.path}:{n.lineno}: private {name} (on {target})")
        return out

    @staticmethod
    def _access(n: ast.AST) -> Optional[Tuple[str, str]]:
        """(receiver kind, private name) of an attribute access, or None."""
        if isinstance(n, ast.Attribute) and _private(n.attr):
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                return "self", n.attr
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                return "super", n.attr
            return (_dotted(v) or "expression"), n.attr
        if isinstance(n, ast.Call):
            f = n.func
            name_arg = None
            if isinstance(f, ast.Name) and f.id in STRING_ACCESSORS and len(n.args) >= 2:
                name_arg, obj = n.args[1], n.args[0]
            elif isinstance(f, ast.Attribute) and f.attr in ("__setattr__", "__getattribute__", "__delattr__") \
                    and len(n.args) >= 2:
                name_arg, obj = n.args[1], n.args[0]
            if isinstance(name_arg, ast.Constant) and isinstance(name_arg.value, str) and _private(name_arg.value):
                kind = "self" if _dotted(obj) in ("self", "cls") else (_dotted(obj) or "expression")
                return kind, name_arg.value
        return None


def package_sources(root: Path = PACKAGE_DIR) -> Dict[str, Tuple[str, str]]:
    return {str(p.relative_to(root.parent)): (_module_name(p.relative_to(root)), p.read_text())
            for p in sorted(root.rglob("*.py"))}


def test_private_foreign_names_only_in_compat():
    found = Checker(package_sources()).violations()
    assert not found, "private torchrec/fbgemm/torch names outside _compat.py:\n" + "\n".join(found)


# --- the checker catches what it should (so the test above can fail) -----------------------

_HEADER = (
    "from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection\n"
    "from torchrec.distributed.types import Awaitable\n"
    "from torch import nn\n"
)


def _check(body: str, extra: Optional[Dict[str, str]] = None) -> List[str]:
    sources = {"torchrec_hybrid/m.py": ("torchrec_hybrid.m", _HEADER + body)}
    for path, text in (extra or {}).items():
        sources[path] = ("torchrec_hybrid." + Path(path).stem, text)
    return Checker(sources).violations()


def test_checker_flags_inherited_private_read():
    found = _check("class S(ShardedEmbeddingBagCollection):\n"
                   "    def f(self):\n"
                   "        return self._lookups\n")
    assert found and "_lookups" in found[0] and "m.py:6" in found[0]


def test_checker_flags_shadowing_a_foreign_private_attribute():
    found = _check("class S(ShardedEmbeddingBagCollection):\n"
                   "    def __init__(self):\n"
                   "        self._env = None\n")
    assert any("_env" in v for v in found)


def test_checker_flags_private_override_super_call_and_import():
    found = _check("from torchrec.distributed.planner.stats import _get_sharding_type_abbr\n"
                   "class D(Awaitable):\n"
                   "    def _wait_impl(self):\n"
                   "        return super()._wait_impl()\n")
    text = "\n".join(found)
    assert "imports private _get_sharding_type_abbr" in text
    assert "overrides private _wait_impl" in text
    assert "private _wait_impl (on super)" in text


def test_checker_flags_foreign_object_and_module_attributes():
    found = _check("import torchrec.distributed.planner.stats as st\n"
                   "def f(planner, ctx):\n"
                   "    st._get_sharding_type_abbr = None\n"
                   "    object.__setattr__(ctx, '_hybrid', 1)\n"
                   "    return planner._best_plan\n")
    text = "\n".join(found)
    assert "_get_sharding_type_abbr" in text and "_best_plan" in text and "_hybrid" in text


def test_checker_allows_own_private_names():
    assert _check("class M(nn.Module):\n"
                  "    def __init__(self):\n"
                  "        super().__init__()\n"
                  "        self._mine = 1\n"
                  "        self.register_buffer('_buf', None)\n"
                  "    def _helper(self, other):\n"
                  "        return self._mine + other._mine + self._buf + self._helper\n"
                  "class N(M):\n"
                  "    def g(self):\n"
                  "        return self._mine\n") == []


def test_checker_exempts_only_compat():
    body = "def f(sebc):\n    return sebc._lookups\n"
    assert _check(body)  # the same line outside _compat.py fails
    sources = {"torchrec_hybrid/_compat.py": ("torchrec_hybrid._compat", body)}
    assert Checker(sources).violations() == []
