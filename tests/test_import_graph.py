"""No import cycle among kvtier's modules: the import graph of ``src/kvtier`` is acyclic.

The graph is read from the sources with ``ast`` (nothing is imported): every ``import x`` and
``from x import y`` (absolute or relative), wherever it stands — at module level, inside a
function, or under ``if TYPE_CHECKING:``. A name imported from a package that is one of its
modules (``from kvtier.commands import bench``) is an edge to that module and to the package.

``TYPE_CHECKING``-only imports count. They do not run, but they are the same dependency in the
design: two modules that name each other's types are one module split in two files, and the
next runtime import between them would be a real cycle. The usual ways out — a small shared
types module, a protocol the lower module declares, or passing a callable in — leave no edge
back. Edges from a module to a package that contains it are left out: Python imports a
package before any of its modules, so that edge is always there and says nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package`` under ``src``."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """Every dotted name ``path`` imports (``from a import b`` gives ``a`` and ``a.b``), with its
    line, relative imports resolved against ``module``."""
    is_package = path.name == "__init__.py"
    names: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.append((base, node.lineno))
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


def import_graph(src: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {imported module of ``package``: line of the first import}."""
    files = module_files(src, package)

    def resolve(name: str) -> str | None:  # the longest prefix that is a module
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for module, path in files.items():
        for name, line in _imported_names(module, path):
            target = resolve(name)
            if target is None or target == module or module.startswith(target + "."):
                continue
            graph[module].setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                    found.append(sorted(component))
    return found


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module: ``[a, b, ..., a]``."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def describe_cycles(src: Path, package: str) -> list[str]:
    """One line per import cycle of ``package``: each module, the module it imports and where."""
    graph = import_graph(src, package)
    files = module_files(src, package)
    lines = []
    for component in strongly_connected(graph):
        cycle = one_cycle(graph, component)
        steps = [f"{a} (line {graph[a][b]} of {files[a].relative_to(src)})"
                 for a, b in zip(cycle, cycle[1:], strict=False)]
        lines.append("cycle: " + " -> ".join(steps) + f" -> {cycle[-1]}"
                     + (f"; component: {', '.join(component)}" if len(component) > 2 else ""))
    return lines


def test_kvtier_modules_import_each_other_without_a_cycle() -> None:
    cycles = describe_cycles(SRC, "kvtier")
    assert not cycles, "import cycles among kvtier modules:\n" + "\n".join(cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_type_checking_block_or_a_function_is_found_and_named(
        tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pkg.sub import c\nB = 1\n"),
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "def f():\n    from .. import a\n    return a\n",
        "pkg/leaf.py": "import pkg.a\nfrom pkg import b\n",
    })
    cycles = describe_cycles(tmp_path, "pkg")
    assert len(cycles) == 1
    assert cycles[0].startswith("cycle: pkg.a (line 1 of pkg/a.py) -> pkg.b (line 3 of pkg/b.py)"
                                " -> pkg.sub.c (line 2 of pkg/sub/c.py) -> pkg.a; component:")


def test_a_module_importing_its_own_package_or_names_from_it_is_no_cycle(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "import pkg\nfrom . import b\nA = b.B\n",
        "pkg/b.py": "B = 2\n",
    })
    assert describe_cycles(tmp_path, "pkg") == []
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.a": 1} and graph["pkg.a"] == {"pkg.b": 2}
