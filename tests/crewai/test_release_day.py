"""Release day: a crewAI release newer than the newest tested, inside the supported minor,
verifies itself once per machine and is allowed when its self-test passes.

The newer release is the installed crewAI relabelled: a copy of its package and
dist-info on PYTHONPATH, ahead of site-packages, with `__version__` and the metadata's
Version one patch release past the newest tested. Everything else is the real thing: the
self-test runs in the background interpreter the first guarded call starts, the verdict
lands in the cache folder (CREWAI_IDEMPOTENT_CACHE_DIR), and the workers are fresh
processes. What the tests observe is public: the refusals the workers get, the charges
at the fake provider, the verdict and history files, and `doctor`'s output.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent.integration import _verify
from crewai_idempotent.integration._patch import NEWEST_TESTED, is_supported, is_tested
from tests.support.crewai.crews import charge_tool
from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env
from tests.support.crewai.provider import FakeProvider

NEWER = f"{NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}.{NEWEST_TESTED[2] + 1}"
TIMEOUT = 600  # a fresh interpreter importing crewAI, plus a whole self-test


def _relabelled(where: Path) -> Path:
    """A copy of the installed crewai package whose version says NEWER."""
    import crewai

    installed = Path(crewai.__file__).parent
    import importlib.metadata

    dist = importlib.metadata.distribution("crewai")
    info = Path(str(dist.locate_file(""))) / f"crewai-{dist.version}.dist-info"
    assert info.is_dir(), f"no dist-info at {info}"
    overlay = where / "site"
    # copy2 keeps the modification times, so the copied bytecode stays valid.
    shutil.copytree(installed, overlay / "crewai", symlinks=True)
    shutil.copytree(info, overlay / f"crewai-{NEWER}.dist-info")
    init = overlay / "crewai" / "__init__.py"
    text = init.read_text()
    assert f'__version__ = "{dist.version}"' in text
    init.write_text(text.replace(f'__version__ = "{dist.version}"', f'__version__ = "{NEWER}"'))
    metadata = overlay / f"crewai-{NEWER}.dist-info" / "METADATA"
    lines = metadata.read_text().splitlines(keepends=True)
    lines = [f"Version: {NEWER}\n" if line.startswith("Version: ") else line for line in lines]
    metadata.write_text("".join(lines))
    return overlay


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _relabelled(tmp_path_factory.mktemp("release-day"))


def _env(overlay: Path, cache: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(overlay)])
    env["CREWAI_IDEMPOTENT_CACHE_DIR"] = str(cache)
    env.pop("CREWAI_IDEMPOTENT_ALLOW_UNTESTED", None)
    env.pop("CREWAI_IDEMPOTENCY_URL", None)
    return env


def _workers(
    overlay: Path, tmp: Path, cache: Path, invoices: list[str], crew: frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """One fresh process per invoice; all make their first guarded call together."""
    go = tmp / f"go-{invoices[0]}"
    processes = []
    for invoice in invoices:
        spec = {
            "provider": str(tmp / "charges.jsonl"),
            "invoice": invoice,
            "ledger": f"sqlite:///{tmp / 'ledger.db'}",
            "cache": str(cache),
            "ready": str(tmp / f"ready-{invoice}"),
            "go": str(go),
            "crew": invoice in crew,
        }
        processes.append(
            subprocess.Popen(
                [PYTHON, "-m", "tests.support.crewai.release_probe", json.dumps(spec)],
                cwd=REPO,
                env=_env(overlay, cache, XDG_DATA_HOME=str(tmp / "xdg")),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    ends = time.monotonic() + TIMEOUT
    while not all((tmp / f"ready-{i}").exists() for i in invoices):
        assert all(p.poll() is None for p in processes), [p.communicate() for p in processes]
        assert time.monotonic() < ends, "the workers never got ready"
        time.sleep(0.05)
    go.touch()
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=TIMEOUT)
        assert process.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _runs(cache: Path) -> list[dict[str, Any]]:
    path = cache / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _doctor(overlay: Path, cache: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            PYTHON,
            "-m",
            "crewai_idempotent.cli",
            "--ledger",
            f"sqlite:///{tmp / 'ledger.db'}",
            "doctor",
        ],
        cwd=REPO,
        env=_env(overlay, cache),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_the_relabelled_release_is_newer_than_the_tested_ones() -> None:
    assert is_supported(NEWER) and not is_tested(NEWER)


def test_the_newest_tested_release_is_the_matrix_newest() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("noxfile", REPO / "noxfile.py")
    assert spec is not None and spec.loader is not None
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    releases = noxfile.CREWAI_RELEASES
    assert releases[-1] == ".".join(map(str, NEWEST_TESTED)), "NEWEST_TESTED follows the matrix"
    assert all(is_tested(release) for release in releases)


@pytest.mark.slow
def test_many_workers_run_the_self_test_once_and_are_allowed_after_it(
    overlay: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    workers = ["inv-1", "inv-2", "inv-3", "inv-4"]
    reports = _workers(overlay, tmp_path, cache, workers, crew=frozenset({"inv-4"}))

    runs = _runs(cache)
    assert len(runs) == 1, runs  # four workers at once: one self-test
    assert runs[0]["passed"] and runs[0]["by"].startswith("the first guarded call")
    refused = [r["first"] for r in reports if r["first"] is not None]
    assert refused, "no worker met the release before its verdict"
    for first in refused:
        assert first["type"] == "UnverifiedCrewAIVersion" and first["state"] == "running"
        assert "\n" not in first["message"] and "it usually takes about" in first["message"]
        assert f"crewai {NEWER} is newer than the newest release" in first["message"]
    # A later call in the same process is allowed once the verdict has landed; the crew's
    # refusal stopped its kickoff (the model never saw it as a tool error).
    assert all(r["result"] for r in reports)
    charges = FakeProvider(tmp_path / "charges.jsonl").effects("charge")
    assert sorted(c["invoice"] for c in charges) == workers
    assert all(c["verdicts"] == 1 for c in charges)  # no body ran before a passing verdict

    (verdict,) = cache.glob("crewai-*.json")
    before = (verdict.stat().st_mtime_ns, verdict.read_bytes())

    # A new process finds the verdict: allowed at its first call, no second run.
    (later,) = _workers(overlay, tmp_path, cache, ["inv-5"])
    assert later["first"] is None and later["result"]
    assert len(_runs(cache)) == 1
    assert (verdict.stat().st_mtime_ns, verdict.read_bytes()) == before

    doctor = _doctor(overlay, cache, tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert f"crewai       {NEWER}: newer than the newest tested release" in doctor.stdout
    assert "self-test    passed: " in doctor.stdout
    assert f"verdict      {verdict}" in doctor.stdout


@pytest.mark.slow
def test_a_self_test_killed_half_way_is_started_again(overlay: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    go = tmp_path / "go-inv-1"
    go.touch()  # one worker: no barrier to wait at
    spec = {
        "provider": str(tmp_path / "charges.jsonl"),
        "invoice": "inv-1",
        "ledger": f"sqlite:///{tmp_path / 'ledger.db'}",
        "cache": str(cache),
        "ready": str(tmp_path / "ready-inv-1"),
        "go": str(go),
    }
    worker = subprocess.Popen(
        [PYTHON, "-m", "tests.support.crewai.release_probe", json.dumps(spec)],
        cwd=REPO,
        env=_env(overlay, cache, XDG_DATA_HOME=str(tmp_path / "xdg")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ends = time.monotonic() + TIMEOUT
    killed = None
    while killed is None:
        assert worker.poll() is None and time.monotonic() < ends, "no self-test started"
        for lock in cache.glob("crewai-*.lock") if cache.exists() else ():
            with contextlib.suppress(ValueError, KeyError):
                killed = int(json.loads(lock.read_text())["pid"])
        time.sleep(0.05)
    os.killpg(killed, signal.SIGKILL)  # the runner and the self-test it started

    out, err = worker.communicate(timeout=TIMEOUT)
    assert worker.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["result"] and report["first"]["state"] == "running"
    (run,) = _runs(cache)  # the killed run left nothing; the next call started another
    assert run["passed"]
    (lock,) = cache.glob("crewai-*.lock")
    assert json.loads(lock.read_text())["pid"] != killed
    assert [c["verdicts"] for c in FakeProvider(tmp_path / "charges.jsonl").effects()] == [1]


def _break_native_tool_path(site: Path) -> str:
    """crewAI's native tool call catching BaseException, as a release might: the guard's
    Halt no longer stops a kickoff on an uncertain outcome there."""
    executor = site / "crewai" / "agents" / "agent_executor.py"
    text = executor.read_text()
    call = "raw_result = tool_func(**args_dict)"
    assert call in text, "the native tool call moved: find another line to break"
    head, tail = text.split(call, 1)
    broken = tail.replace("except Exception as e:", "except BaseException as e:", 1)
    assert broken != tail
    executor.write_text(head + call + broken)
    return "native x uncertain"


@pytest.mark.slow
def test_a_broken_tool_path_is_refused_naming_the_failing_check(
    overlay: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    shutil.copytree(overlay, site, symlinks=True)
    failing = _break_native_tool_path(site)
    cache = tmp_path / "cache"

    (report,) = _workers(site, tmp_path, cache, ["inv-1"])

    assert report["result"] is None
    assert report["first"]["state"] == "running"
    last = report["last"]
    assert last["type"] == "UnverifiedCrewAIVersion" and last["state"] == "failed"
    assert "\n" not in last["message"] and f"{failing}:" in last["message"]
    assert "failed crewai-idempotent's self-test" in last["message"]
    assert not FakeProvider(tmp_path / "charges.jsonl").effects("charge")
    (run,) = _runs(cache)
    assert not run["passed"]

    doctor = _doctor(site, cache, tmp_path)
    assert doctor.returncode == 1
    assert "self-test    PROBLEM: failed " in doctor.stdout and failing in doctor.stdout


# -- the verdict's subject, without running a self-test ----------------------------------


def test_the_digest_follows_the_content_not_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "pkg"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.py").write_text("A = 1\n")
    (tree / "sub" / "b.json").write_text("{}")
    (tree / "__pycache__").mkdir()
    (tree / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"compiled")
    monkeypatch.setenv(_verify.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir(mode=0o700)
    first = _verify.tree_digest(tree)
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy)
    assert _verify.tree_digest(copy) == first  # another venv, same install: one verdict
    (tree / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"recompiled")
    assert _verify.tree_digest(tree) == first  # bytecode is the interpreter's
    assert list((tmp_path / "cache" / "trees").iterdir())  # the stat cache was written
    assert _verify.tree_digest(tree) == first  # and read
    # A modified install, even with its modification time put back, verifies again: the
    # write changed the file's ctime, which no tool sets back.
    before = (tree / "a.py").stat()
    for _ in range(1000):  # the kernel's file clock ticks in jiffies: wait for one tick
        (tree / "a.py").write_text("A = 2\n")
        if (tree / "a.py").stat().st_ctime_ns != before.st_ctime_ns:
            break
        time.sleep(0.001)
    os.utime(tree / "a.py", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (tree / "a.py").stat().st_mtime_ns == before.st_mtime_ns
    modified = _verify.tree_digest(tree)
    assert modified != first
    (tree / "sub" / "c.py").write_text("")
    assert _verify.tree_digest(tree) not in (first, modified)  # a file added


def test_a_cache_folder_others_can_write_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv(_verify.CACHE_ENV, str(cache))
    subject = _verify.Subject("9.9.9", "0.1.0", "cpython-3.11.0", "0" * 64)
    with pytest.raises(_verify.CacheUnusable, match="not this user's alone"):
        _verify.read(subject)
    with pytest.raises(_verify.CacheUnusable, match="not this user's alone"):
        _verify.ensure_running(subject, "a test")
    assert not list(cache.iterdir())  # nothing was started, nothing written


# -- the switch, and a machine where no verdict can be kept (in this process) ------------


@pytest.fixture
def newer_crewai(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The integration reinstalled as if crewai said NEWER; the full guard back after."""
    import crewai

    from crewai_idempotent import configure, install, uninstall

    uninstall()
    monkeypatch.setattr(crewai, "__version__", NEWER)
    monkeypatch.setenv(_verify.CACHE_ENV, str(tmp_path / "cache"))
    configure(backend=f"sqlite:///{tmp_path / 'ledger.db'}")
    yield install
    configure(None)
    uninstall()
    monkeypatch.undo()
    install()


def test_allow_untested_0_refuses_without_a_self_test(
    newer_crewai: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from crewai_idempotent.integration import UnsupportedCrewAIVersion, UnverifiedCrewAIVersion

    monkeypatch.setenv("CREWAI_IDEMPOTENT_ALLOW_UNTESTED", "0")
    with pytest.warns(RuntimeWarning, match="turns off its self-test"):
        newer_crewai()
    charges = FakeProvider(tmp_path / "charges.jsonl")
    with pytest.raises(UnsupportedCrewAIVersion, match="turns off its self-test") as refused:
        charge_tool(charges, idempotent=True).run(amount=1, recipient="bob")
    assert not isinstance(refused.value, UnverifiedCrewAIVersion)
    assert not charges.effects() and not (tmp_path / "cache").exists()


def test_allow_untested_1_runs_the_full_guard_without_a_verdict(
    newer_crewai: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:

    monkeypatch.setenv("CREWAI_IDEMPOTENT_ALLOW_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="CREWAI_IDEMPOTENT_ALLOW_UNTESTED is set"):
        newer_crewai()
    charges = FakeProvider(tmp_path / "charges.jsonl")
    charge = charge_tool(charges, idempotent=True)
    assert charge.run(amount=1, recipient="bob") == charge.run(amount=1, recipient="bob")
    assert len(charges.effects()) == 1 and not (tmp_path / "cache").exists()


def test_no_verdict_can_be_kept_refuses_saying_why(
    newer_crewai: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from crewai_idempotent.integration import UnverifiedCrewAIVersion

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(_verify.CACHE_ENV, str(shared))
    newer_crewai()
    charges = FakeProvider(tmp_path / "charges.jsonl")
    for _ in range(2):  # and again: no verdict appears, nothing starts
        with pytest.raises(UnverifiedCrewAIVersion) as refused:
            charge_tool(charges, idempotent=True).run(amount=1, recipient="bob")
        assert refused.value.state == "unavailable"
        assert "self-test cannot run here" in str(refused.value)
        assert "not this user's alone" in str(refused.value) and "\n" not in str(refused.value)
    assert not charges.effects() and not list(shared.iterdir())


def _on_a_terminal(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `command` with a pseudo-terminal as its stdin, stdout and stderr."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdin=follower, stdout=follower, stderr=follower
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(timeout=TIMEOUT), b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_doctor_self_test_on_a_terminal_shows_progress_and_keeps_the_verdict(
    overlay: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    env = _env(overlay, cache, XDG_DATA_HOME=str(tmp_path / "xdg"), TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    status, screen = _on_a_terminal(
        [PYTHON, "-m", "crewai_idempotent.cli", "doctor", "--self-test"], env
    )
    assert status == 0, screen[-3000:]
    plan = re.search(rf"crewai {re.escape(NEWER)}: (\d+) checks", screen)
    assert plan, screen[-3000:]
    total = int(plan.group(1))
    assert "━" in screen and f"{total}/{total}" in screen  # the bar, and its count at the end
    assert screen.count("  pass  ") == total
    assert "self-test passed in " in screen and "verdict kept in " in screen
    (run,) = _runs(cache)
    assert run["passed"] and run["by"] == "doctor --self-test"

    (worker,) = _workers(overlay, tmp_path, cache, ["inv-1"])
    assert worker["first"] is None and worker["result"]  # allowed at its first call
    assert len(_runs(cache)) == 1
