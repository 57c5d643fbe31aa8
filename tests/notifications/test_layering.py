"""The notifications package's imports go one way: the channel kinds register into
`_kinds`, below them, and `_channels` reads it; no circle remains among its modules,
counting imports inside functions and under TYPE_CHECKING. The built-in kinds still load
without their libraries (httpx, standardwebhooks, apprise) until a channel sends."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "crewai_idempotent" / "notifications"
NAME = "crewai_idempotent.notifications"


def _imports(path: Path) -> set[str]:
    """Every notifications module `path` imports, wherever the statement is."""
    found: set[str] = set()
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found |= {a.name for a in node.names if a.name in modules}
            elif node.module and node.module.startswith(NAME + "."):
                found.add(node.module.split(".")[2])
            elif node.module == NAME:
                found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith(NAME + ".")}
    return found & modules


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    def walk(node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            found = walk(nxt, [*path, nxt])
            if found:
                return found
        return None

    for start in sorted(graph):
        found = walk(start, [start])
        if found:
            return found
    return None


def test_no_import_circle_among_the_notifications_modules() -> None:
    graph = {p.stem: _imports(p) - {p.stem} for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert _circle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the check can fail
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])
    for kind in ("_webhook", "_slack", "_apprise"):
        assert "_kinds" in graph[kind] and "_channels" not in graph[kind], kind
    assert {"_kinds", "_webhook", "_slack", "_apprise"} <= graph["_channels"]
    assert graph["_kinds"] & {"_channels", "_webhook", "_slack", "_apprise"} == set()


def test_the_built_in_kinds_load_without_their_libraries() -> None:
    script = (
        "import json, sys\n"
        "from crewai_idempotent.notifications import channel_from_url, Channel\n"
        "kinds = [type(channel_from_url(u)).__name__ for u in (\n"
        "    'slack+https://hooks.slack.com/services/T/B/x',\n"
        ")]\n"
        "heavy = [m for m in ('httpx', 'apprise', 'standardwebhooks') if m in sys.modules]\n"
        "print(json.dumps({'kinds': kinds, 'heavy': heavy}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"kinds": ["SlackChannel"], "heavy": []}
