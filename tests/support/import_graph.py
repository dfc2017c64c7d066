"""The import graph of a package tree, read from the source with `ast` (nothing imported): every import at any
depth counts, those under `if TYPE_CHECKING:` and inside functions too, since each still ties the two modules
together for a reader and for a later change that makes it run."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """The dotted name of `path`, a file of the tree at `root` (`pkg/__init__.py` is `pkg`)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, root: Path) -> set[str]:
    """Every module name `path` imports, relative imports resolved (`from a import b` names `a` and `a.b`)."""
    is_package = path.name == "__init__.py"
    package = module_name(path, root).split(".")
    if not is_package:
        package = package[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[: len(package) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def graph(package_dir: Path, root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (itself excluded)."""
    files = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    return {name: (imported(path, root) & files.keys()) - {name} for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected group of two or more modules, sorted (Tarjan's algorithm,
    iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)
