"""The crewAI compatibility matrix: one session per crewAI release the package supports.

Each session installs this project with one crewai release pinned, runs the crewai
integration tests (tests/crewai/test_crewai_*.py, which include every path x retry source check
of tests/crewai/test_crewai_paths.py) and the offline demo, twice (its throwaway ledger and a
given file).

    nox -s crewai                       # the full matrix: every release, oldest first
    nox -s "crewai(1.10.0)"             # one release
    nox -t ci                           # oldest, middle, newest: what CI runs
    nox -s compat_report                # print the table of the last results
    nox -s compat_report -- --write     # ... and put it into docs/compatibility.md

uv is the virtualenv backend when it is installed (it comes with the test extra): a
release installs in seconds instead of about a minute with pip.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

ROOT = Path(__file__).parent
RESULTS = ROOT / ".nox-results"
COMPAT_DOC = ROOT / "docs" / "compatibility.md"

# Every final release on PyPI in the range, oldest first. Yanked ones stay (1.10.0,
# 1.12.0, 1.14.0): `==` still installs them, and teams pinned to them exist. There is no
# 1.10.2, 1.11.2, 1.13.1 or 1.14.8.
CREWAI_RELEASES = [
    "1.10.0",
    "1.10.1",
    "1.11.0",
    "1.11.1",
    "1.12.0",
    "1.12.1",
    "1.12.2",
    "1.13.0",
    "1.14.0",
    *(f"1.14.{n}" for n in range(1, 8)),
    *(f"1.15.{n}" for n in range(31)),
]
# The oldest; 1.14.5, where crewai-core split out and the flow-based AgentExecutor became
# the default (the widest internal change in the range); the newest.
CI_RELEASES = ("1.10.0", "1.14.5", "1.15.30")

PYTHON = "3.11"  # the project's floor; every release in the range allows 3.10 to 3.13

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = []  # nothing by default: name a session or a tag

# Offline and quiet, as tests/support/crewai/fixtures.py sets them for subprocesses.
OFFLINE = {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "OTEL_SDK_DISABLED": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "CREWAI_TESTING": "true",
    "OPENAI_API_KEY": "sk-fake-not-used",
}


def _releases() -> list[nox.param]:
    return [nox.param(v, id=v, tags=["ci"] if v in CI_RELEASES else []) for v in CREWAI_RELEASES]


@nox.session(python=PYTHON)
@nox.parametrize("release", _releases())
def crewai(session: nox.Session, release: str) -> None:
    """The crewai integration tests and the offline demo against one crewAI release."""
    # pip as well: uv-made environments have none, and a test builds a wheel with it.
    session.install("-e", ".[test]", f"crewai=={release}", "pip")
    installed = session.run(
        "python",
        "-c",
        "import importlib.metadata as m; print(m.version('crewai'))",
        silent=True,
    )
    if not isinstance(installed, str) or installed.strip() != release:
        session.error(f"asked for crewai {release}, got {installed!r}")

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"crewai-{release}.demo").unlink(missing_ok=True)
    tests = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/crewai/test_crewai_*.py"))
    # No success codes beyond 0: "no tests collected" (5) is a broken matrix, not a pass.
    session.run(
        "python",
        "-m",
        "pytest",
        *tests,
        f"--junitxml={RESULTS / f'crewai-{release}.xml'}",
        "-p",
        "no:cacheprovider",
        "-q",
        *session.posargs,
        env=OFFLINE,
    )

    # The demo on its throwaway ledger and on a given file (crewai's storage folder is in
    # the session's tmp through XDG_DATA_HOME all the same: no user data is touched).
    tmp = Path(session.create_tmp())
    env = {**OFFLINE, "XDG_DATA_HOME": str(tmp / "xdg"), "CREWAI_STORAGE_DIR": "nox-demo"}
    session.run("crewai-idempotent", "demo", env=env)
    session.run("crewai-idempotent", "demo", "--ledger-path", str(tmp / "demo.db"), env=env)
    (RESULTS / f"crewai-{release}.demo").write_text("passed\n")


# -- the report ------------------------------------------------------------------------

PATHS = ("react", "native", "parallel native", "agent", "flow", "async")
PATH_TITLES = {
    "react": "ReAct",
    "native": "native",
    "parallel native": "parallel native",
    "agent": "step executor / LiteAgent",
    "flow": "flows",
    "async": "async",
}
SOURCES = ("guardrail", "agent retry", "repeated call", "new kickoff", "uncertain")


def _cases(path: Path) -> list[tuple[dict[str, str], str, str]]:
    """(properties, outcome, test id) per test case of one JUnit file."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        if case.find("skipped") is not None:
            outcome = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        else:
            outcome = "passed"
        cases.append((props, outcome, f"{case.get('classname')}::{case.get('name')}"))
    return cases


def _cell(results: list[str]) -> str:
    if not results:
        return "n/a"
    passed = results.count("passed")
    return "pass" if passed == len(results) else f"**FAIL** ({passed}/{len(results)})"


def _ranges(releases: list[str]) -> str:
    """E.g. "1.10.0-1.11.1, 1.13.0": runs of consecutive releases, none left out between."""
    order = CREWAI_RELEASES.index
    runs: list[list[str]] = []
    for release in CREWAI_RELEASES:
        if release in releases:
            if runs and order(release) == order(runs[-1][-1]) + 1:
                runs[-1].append(release)
            else:
                runs.append([release])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def build_report() -> str:
    """Markdown: one row per release measured, one column per path; each cell says
    whether every retry source (on every executor the release has) held."""
    lines = [
        "| crewai | " + " | ".join(PATH_TITLES[p] for p in PATHS) + " | other tests | demo |",
        "|---|" + "---|" * (len(PATHS) + 2),
    ]
    failures: list[str] = []
    skipped: dict[str, list[str]] = {}
    measured = []
    for release in CREWAI_RELEASES:
        junit = RESULTS / f"crewai-{release}.xml"
        if not junit.exists():
            continue
        measured.append(release)
        by_path: dict[str, list[str]] = {p: [] for p in PATHS}
        others: list[str] = []
        for props, outcome, name in _cases(junit):
            if props.get("path") in by_path:
                by_path[props["path"]].append(outcome)
                if outcome == "failed":
                    failures.append(
                        f"- {release}: {props['path']} x {props.get('retry')} "
                        f"[{props.get('executor')}] failed"
                    )
                continue
            if outcome == "skipped":
                skipped.setdefault(name, []).append(release)
            else:
                others.append(outcome)
                if outcome == "failed":
                    failures.append(f"- {release}: `{name}` failed")
        demo = "pass" if (RESULTS / f"crewai-{release}.demo").exists() else "**FAIL**"
        other = f"{others.count('passed')}/{len(others)}"
        cells = [_cell(by_path[p]) for p in PATHS]
        lines.append(f"| {release} | " + " | ".join(cells) + f" | {other} | {demo} |")
    if not measured:
        return ""
    not_run = [r for r in CREWAI_RELEASES if r not in measured]
    head = [
        f"Measured: {len(measured)} of {len(CREWAI_RELEASES)} releases.",
        f"Not run: {', '.join(not_run) if not_run else 'none'}.",
        "",
    ]
    tail = ["", "Failures:", "", *(failures or ["- none"]), "", "Skipped (path absent):", ""]
    tail += [f"- `{name}`: {_ranges(rels)}" for name, rels in sorted(skipped.items())] or ["- none"]
    return "\n".join(head + lines + tail) + "\n"


@nox.session(python=False)
def compat_report(session: nox.Session) -> None:
    """Print the release x path table of the last matrix results (`-- --write` puts it
    into docs/compatibility.md between its matrix markers)."""
    report = build_report()
    if not report:
        session.error(f"no results in {RESULTS}: run `nox -s crewai` first")
    session.log("\n" + report)
    if "--write" in session.posargs:
        text = COMPAT_DOC.read_text()
        start, end = "<!-- matrix:start -->\n", "<!-- matrix:end -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        COMPAT_DOC.write_text(head + start + report + end + tail)
        session.log(f"wrote {COMPAT_DOC.relative_to(ROOT)}")
    (RESULTS / "report.json").write_text(json.dumps({"markdown": report}))
