"""The package's layout rules, checked from the source: module sizes, import circles, floors, hidden imports.

    python tests/support/layout_check.py          # prints every finding; exit 1 if a rule is broken

Rules (docs/architecture.md): no module in ``distckpt/`` above ``MAX_LINES`` lines; no circle among
the imports of distckpt modules (function-local imports count: they hide a dependency, they do not
remove it); every module on one of the :data:`FLOORS` and no import of a module on a higher floor;
no import of :data:`FORBIDDEN`'s kinds (the formats and the I/O never import a strategy, the library
never imports the CLI), however the floors are drawn; no private (leading underscore) name imported
from another distckpt module. Function-local imports of distckpt modules are listed for information
(a few break a real cycle or defer a heavy optional dependency and say so). tests/test_layout.py
asserts the rules.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "distckpt"
MAX_LINES = 700

# The floors of the package, bottom up (docs/architecture.md draws the same table): a module may
# import modules of its own floor and of the floors below, never of one above. A module is on the
# floor of the longest prefix (a module path below ``distckpt.``) that names it or a package above
# it; ``""`` is the package itself (``distckpt/__init__.py``, the public face).
FLOORS: List[Tuple[str, List[str]]] = [
    ("ground", ["errors", "checksum", "containment", "bounds", "core", "budget", "dict_utils"]),
    ("storage", ["storage"]),
    (
        "data model",
        [
            "sharded_base",
            "sharded_tensor",
            "sharded_object",
            "factories",
            "mapping",
            "foreign",
            "utils",
            "optimizer",
        ],
    ),
    ("process group", ["process_group", "heartbeat", "checkin", "dist", "timings"]),
    ("formats", ["formats", "manifest"]),
    ("io", ["io"]),
    ("checkpoint protocol", ["commit", "commit_store", "dcp_native"]),
    ("strategy interfaces", ["strategies.base"]),
    ("strategies", ["strategies"]),
    ("registration", ["strategies.builtin"]),
    (
        "entry points",
        [
            "saving",
            "loading",
            "queries",
            "serialization",
            "strict",
            "shard_tables",
            "global_integrity",
            "common_guard",
            "validation",
            "megatron_api",
            "exchange_utils",
            "tensor_aware_state_dict",
        ],
    ),
    ("around", ["", "local", "tiered", "dcp", "tools", "examples", "demo"]),
    ("cli", ["cli"]),
]

# Imports that must never exist, however the floors are drawn: (importers, imported) as module
# prefixes; a module that is itself one of the imported kind may import its own kind.
FORBIDDEN: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "formats or io importing a strategy": (("distckpt.formats", "distckpt.io"), ("distckpt.strategies",)),
    "the library importing the CLI": (("distckpt",), ("distckpt.cli",)),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(test)


def _module_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """The statements that run at import: the top level, and the bodies of top-level if/try."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        yield node
        if isinstance(node, ast.If) and not _is_type_checking(node):
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                stack.extend(handler.body)


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: Set[str], local: bool) -> List[Tuple[str, List[str], int]]:
    """(module imported, names taken from it, line) for the module-level (or, with ``local``, the
    function-local) imports of distckpt modules."""
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, _module_level(tree)))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or (id(node) in top) == local:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.append((alias.name, [], node.lineno))
            continue
        target = _resolve(name, path.name == "__init__.py", node)
        if not target.startswith("distckpt"):
            continue
        names = []
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in known:
                found.append((sub, [], node.lineno))
            else:
                names.append(alias.name)
        if names and target in known:
            found.append((target, names, node.lineno))
    return found


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    result: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    result.append(sorted(component))
    return result


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def floor_of(module: str) -> Optional[int]:
    """The index in :data:`FLOORS` of ``module``'s floor (None: on no floor)."""
    rel = module[len("distckpt.") :] if module.startswith("distckpt.") else ""
    best: Optional[Tuple[int, int]] = None
    for floor, (_name, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            named = rel == "" if prefix == "" else _under(rel, prefix)
            if named and (best is None or len(prefix) > best[1]):
                best = (floor, len(prefix))
    return None if best is None else best[0]


def _forbidden(importer: str, target: str) -> List[str]:
    return [
        rule
        for rule, (importers, imported) in FORBIDDEN.items()
        if any(_under(importer, p) for p in importers)
        and any(_under(target, p) for p in imported)
        and not any(_under(importer, p) for p in imported)
    ]


def findings() -> Dict[str, List[str]]:
    mods = modules()
    known = set(mods)
    too_long = []
    graph: Dict[str, Set[str]] = {name: set() for name in mods}
    private = []
    local = []
    unplaced = [name for name in mods if floor_of(name) is None]
    up: List[str] = []
    forbidden: Dict[str, List[str]] = {rule: [] for rule in FORBIDDEN}

    def depends(name: str, path: Path, target: str, line: int) -> None:
        """``name`` imports ``target``: an edge of the graph, checked against the floors."""
        # A package's __init__ importing its own submodules is how a package re-exports.
        if path.name == "__init__.py" and target.startswith(name + "."):
            return
        graph[name].add(target)
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        low, high = floor_of(name), floor_of(target)
        if low is not None and high is not None and high > low:
            up.append(f"{where} (floor {FLOORS[high][0]!r}, above {FLOORS[low][0]!r})")
        for rule in _forbidden(name, target):
            forbidden[rule].append(where)

    for name, path in mods.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines (max {MAX_LINES})")
        for target, names, line in imports_of(name, path, known, local=False):
            depends(name, path, target, line)
            for imported in names:
                if imported.startswith("_") and not imported.startswith("__") and target != name:
                    private.append(f"{path.relative_to(ROOT)}:{line}: {imported} from {target}")
        for target, _names, line in imports_of(name, path, known, local=True):
            local.append(f"{path.relative_to(ROOT)}:{line}: {target}")
            # A function-local import hides a dependency but is one all the same: it counts.
            depends(name, path, target, line)
    for name in graph:
        graph[name].discard(name)
    cycles = [" -> ".join(c) for c in _cycles(graph)]
    return {
        "too long": too_long,
        "import circles": cycles,
        "modules on no floor": unplaced,
        "imports up a floor": up,
        **forbidden,
        "private names imported": private,
        "local imports": local,
    }


def main() -> int:
    found = findings()
    broken = False
    for rule, items in found.items():
        print(f"{rule}: {len(items)}")
        for item in items:
            print(f"  {item}")
        broken |= bool(items) and rule != "local imports"
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
