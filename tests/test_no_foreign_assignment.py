"""The package never assigns into another package's namespace, not even for a moment.

Where TorchRec offers no hook we subclass in our own modules and use the subclass only in our own
sharded module; an assignment to an attribute of a torch, torchrec or fbgemm_gpu module or class
(``torchrec.distributed.planner.stats._get_sharding_type_abbr = ...``, ``setattr(dist_data, ...)``,
``torch.Tensor.tolist = ...``) would change what every other user of that package sees while it
lasts. Checked statically over every module of the package: the target's base name is one bound by
an import from those packages. (Attributes of instances we built, ``self._dense.weights = ...``, are
ours to set.)
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchrec_hybrid"
FOREIGN = ("torch", "torchrec", "fbgemm_gpu")


def _foreign_names(tree: ast.AST) -> set:
    """Names a module binds to objects of the foreign packages by importing them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN:
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            names.update(a.asname or a.name for a in node.names)
    return names


def _base(node: ast.AST):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def foreign_assignments(source: str, filename: str = "<source>") -> list:
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            if isinstance(t, ast.Attribute) and _base(t) in foreign:
                found.append(f"{filename}:{node.lineno}: {ast.unparse(t)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and _base(node.args[0]) in foreign):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_package_assigns_nothing_into_torch_torchrec_or_fbgemm():
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in foreign_assignments(p.read_text(), str(p))]
    assert not found, "assignments into another package's namespace:\n" + "\n".join(found)


def test_the_check_sees_the_swaps_it_forbids():
    """What the package did until this check existed: swapped TorchRec's split-size awaitable class and its
    stats abbreviation function, restoring them afterwards."""
    swapped = (
        "import torchrec.distributed.dist_data as _tr_dist_data\n"
        "import torchrec.distributed.planner.stats as _tr_stats\n"
        "from torch import Tensor\n"
        "def swap(cls, abbr):\n"
        "    _tr_dist_data.SplitsAllToAllAwaitable = cls\n"
        "    _tr_stats._get_sharding_type_abbr = abbr\n"
        "    setattr(Tensor, 'tolist', abbr)\n"
        "    self_made = object()\n"
        "    self_made.x = 1\n"
    )
    found = foreign_assignments(swapped)
    assert [f.split(": ", 1)[1] for f in found] == [
        "_tr_dist_data.SplitsAllToAllAwaitable", "_tr_stats._get_sharding_type_abbr",
        "setattr(Tensor, 'tolist', abbr)"], found
