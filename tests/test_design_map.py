"""docs/design.md's module map is the tree: every module of the package is on it, and
nothing on it is missing from the package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    assert f"{PACKAGE}/backends/sqlite.py" in mapped_paths()
    assert f"{PACKAGE}/integration/__init__.py" in mapped_paths()
