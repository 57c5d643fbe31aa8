"""docs/design.md's module map is the tree: every module of the package is on it, and
nothing on it is missing from the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "crewai_idempotent"


def map_block() -> list[str]:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("## Modules", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/design.md: the '## Modules' section has no ```text block"
    return block.group(1).splitlines()


def mapped_paths() -> set[str]:
    """The tree drawn by indentation: `name/` opens a folder, `name.py` is a module."""
    folders: list[tuple[int, str]] = []
    paths: set[str] = set()
    for line in map_block():
        match = re.match(r"( *)([\w.]+/|[\w.]+\.py)(?:\s|$)", line)
        if not match:
            continue  # a continuation of the previous line's description
        indent, name = len(match.group(1)), match.group(2)
        while folders and folders[-1][0] >= indent:
            folders.pop()
        prefix = "".join(folder for _, folder in folders)
        if name.endswith("/"):
            folders.append((indent, name))
        else:
            paths.add(prefix + name)
    return paths


def package_paths() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / PACKAGE).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_the_module_map_is_the_tree() -> None:
    drawn, real = mapped_paths(), package_paths()
    assert not real - drawn, f"modules missing from docs/design.md: {sorted(real - drawn)}"
    assert not drawn - real, (
        f"docs/design.md names modules that do not exist: {sorted(drawn - real)}"
    )


def test_the_map_parser_sees_nesting() -> None:
    # The check above is only as good as the parser: a nested module must come out whole.
    assert f"{PACKAGE}/backends/sqlite/_store.py" in mapped_paths()
    assert f"{PACKAGE}/integration/__init__.py" in mapped_paths()


def _module_imports() -> dict[str, set[str]]:
    """Each module's imports of the package's own modules, wherever they are written: at
    the top, inside a function (loaded on first use) and under `if TYPE_CHECKING:` (for
    the annotations). Each is a dependency: a circle through a lazy or a type-only import
    is a circle all the same."""
    graph: dict[str, set[str]] = {}
    for rel in package_paths():
        path = ROOT / rel
        parts = rel[: -len(".py")].split("/")
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = ".".join(parts[:-1])
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if not base.startswith(PACKAGE):
                    continue
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    where = ROOT / candidate.replace(".", "/")
                    known = where.with_suffix(".py").exists() or (where / "__init__.py").exists()
                    found.add(candidate if known else base)
        graph[module] = {m for m in found if m != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle in `graph`: one per group of modules that reach each other
    (a strongly connected component), each as the shortest path that closes on the
    group's first module (`_groups` has every member)."""
    return sorted(_closing_path(graph, group) for group in _groups(graph))


def _groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more modules that each reach all the others."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return groups


def _closing_path(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest path inside `group` from its first module back to itself."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop(0)
        for imported in sorted(graph.get(module, set()) & group):
            if imported == start:
                return [*paths[module], start]
            if imported not in paths:
                paths[imported] = [*paths[module], imported]
                todo.append(imported)
    raise AssertionError(f"{sorted(group)} is not a circle")


def test_the_circle_finder_finds_every_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert sorted(map(sorted, _groups(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_lazy_and_type_only_imports_are_edges() -> None:
    graph = _module_imports()
    # Inside a function: a process whose ledger is a URL never loads the SQLite store.
    assert f"{PACKAGE}.backends.sqlite" in graph[f"{PACKAGE}.integration._ledgers"]
    # Under `if TYPE_CHECKING:`: a name the package loads on first use.
    assert f"{PACKAGE}.integration._wrap" in graph[f"{PACKAGE}.integration"]


def test_no_module_imports_one_that_imports_it() -> None:
    graph = _module_imports()
    # The graph is read right: relative imports resolve to modules, a name imported from a
    # package resolves to its module.
    assert f"{PACKAGE}.ledger._steps" in graph[f"{PACKAGE}.integration._guard"]
    assert f"{PACKAGE}.integration._keying" in graph[f"{PACKAGE}.integration._guard"]
    assert f"{PACKAGE}.ledger._machine" in graph[f"{PACKAGE}.ledger._ledger"]
    found = [
        " -> ".join(_closing_path(graph, group))
        + (f"  (all of {sorted(group)} reach each other)" if len(group) > 2 else "")
        for group in sorted(_groups(graph), key=min)
    ]
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_ledger_drives_the_gates_without_importing_them() -> None:
    graph = _module_imports()

    def reaches(start: str) -> set[str]:
        found, todo = set(), [start]
        while todo:
            for imported in graph.get(todo.pop(), ()):
                if imported not in found:
                    found.add(imported)
                    todo.append(imported)
        return found

    gates = {f"{PACKAGE}.gates.{m}" for m in ("_plan", "_approvals", "_spend", "_gatestore")}
    for core in ("_ledger", "_machine", "_steps", "_leases", "_rooms"):
        reached = reaches(f"{PACKAGE}.ledger.{core}")
        assert not reached & gates, f"{core} imports the gates: {sorted(reached & gates)}"
        assert not any(m.startswith(f"{PACKAGE}.integration") for m in reached), core
    for gate in gates:
        assert f"{PACKAGE}.ledger._ledger" not in reaches(gate), f"{gate} imports the ledger"


def test_the_core_and_the_gates_reach_only_the_outbox_s_write_side() -> None:
    """The ledger writes entries for a person with its transitions; it never loads the
    dispatcher, the channels or their libraries."""
    graph = _module_imports()
    notifications = f"{PACKAGE}.notifications"
    allowed = {notifications, f"{notifications}._outbox", f"{notifications}._incidents"}
    sweeper = ("reconciliation._sweeper", "reconciliation._alerts")  # its alerts write entries
    core = ("ledger._ledger", "ledger._machine")
    gates = ("gates._gatestore", "gates._approvals", "gates._spend", "gates._plan")
    for start in (*core, *gates, *sweeper):
        found, todo = set(), [f"{PACKAGE}.{start}"]
        while todo:
            for imported in graph.get(todo.pop(), ()):
                if imported not in found:
                    found.add(imported)
                    todo.append(imported)
        reached = {m for m in found if m.startswith(notifications)}
        assert reached <= allowed, f"{start} reaches {sorted(reached - allowed)}"
    assert f"{notifications}._outbox" in graph[f"{PACKAGE}.ledger._machine"]  # the graph is read
    assert f"{notifications}._outbox" in graph[f"{PACKAGE}.reconciliation._alerts"]
