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
    """Each module's imports of the package's own modules made when it loads: the
    top-level statements, without `if TYPE_CHECKING:` blocks and without the imports
    functions make when they run (which are deliberate: loading on first use)."""
    graph: dict[str, set[str]] = {}
    for rel in package_paths():
        path = ROOT / rel
        parts = rel[: -len(".py")].split("/")
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = ".".join(parts[:-1])
        found: set[str] = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
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
                    known = (ROOT / (candidate.replace(".", "/") + ".py")).exists()
                    found.add(candidate if known else base)
        graph[module] = {m for m in found if m != module}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle in `graph`, as the path that closes it, or None."""
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        seen[module] = 1
        for imported in sorted(graph.get(module, ())):
            if seen.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in seen:
                found = visit(imported, [*path, imported])
                if found:
                    return found
        seen[module] = 2
        return None

    for module in sorted(graph):
        if module not in seen:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_no_module_imports_one_that_imports_it() -> None:
    graph = _module_imports()
    # The graph is read right: relative imports resolve to modules, a name imported from a
    # package resolves to its module.
    assert f"{PACKAGE}.ledger._steps" in graph[f"{PACKAGE}.integration._guard"]
    assert f"{PACKAGE}.integration._keying" in graph[f"{PACKAGE}.integration._guard"]
    assert f"{PACKAGE}.ledger._machine" in graph[f"{PACKAGE}.ledger._ledger"]
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle(graph) is None, f"import circle: {' -> '.join(_circle(graph) or [])}"


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
