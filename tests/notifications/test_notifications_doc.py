"""docs/notifications.md, followed top to bottom: every command of its ```console blocks
runs as printed, pasted into one shell in a fresh folder (so its `export`s hold for the
commands after them), against a local receiver where the walkthrough says one listens;
each exits 0, and the output printed under it is what it prints (ids, names made of
digests, dispatcher names and ages aside; a `…` line stands for any lines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.notify import Receiver

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "notifications.md"
FENCE = re.compile(r"^```console\n(.*?)^```", re.S | re.M)
PORT = 8787  # where the walkthrough says its receiver listens
# The docs' own secret (docs/notifications.md "Try it"), for the receiver to verify with.
SECRET = "whsec_c2VjcmV0IG9mIHRoZSBkb2NzJyB3ZWJob29rcw=="
# What differs from one run to the next, as printed in the docs and as matched here.
VARIABLE = [
    r"ob_[0-9a-f]{24}",
    r"ap_[0-9a-f]{20}",
    r"(?:webhook|slack|apprise)-[0-9a-f]{10}",
    r"pay_invoice:[0-9a-f]{64}",
    r"[\w.-]+:\d+:[0-9a-f]{6}",  # a dispatcher's name: host:pid:random
    r"\d+ (?:s|min|h|d) ago",
]
MARK = "@@crewai-idempotent-doc-step@@"


def _steps() -> list[tuple[str, list[str]]]:
    """(command, the output printed under it) for every `$ ` line, in the doc's order."""
    steps: list[tuple[str, list[str]]] = []
    for block in FENCE.finditer(DOC.read_text(encoding="utf-8")):
        for line in block.group(1).splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            elif steps:
                steps[-1][1].append(line)
    return steps


def _pattern(printed: str) -> re.Pattern[str]:
    """A line as printed, with what varies between runs matched by its shape."""
    out, at = [], 0
    for found in re.finditer("|".join(VARIABLE), printed):
        out.append(re.escape(printed[at : found.start()]))
        shape = next(v for v in VARIABLE if re.fullmatch(v, found.group()))
        out.append(shape)
        at = found.end()
    out.append(re.escape(printed[at:]))
    return re.compile(re.sub(r"(\\ )+", r"\\s+", "".join(out)) + r"\s*$")


def _printed_in(printed: list[str], got: list[str]) -> str | None:
    """Whether the lines printed in the docs are in what the command printed, in order
    (a `…` line stands for any lines, none included); else the first line that is not."""
    at = 0
    loose = False
    for line in printed:
        if line.strip() == "…":
            loose = True
            continue
        pattern = _pattern(line)
        while at < len(got) and not pattern.match(got[at]):
            if not loose:
                return line
            at += 1
        if at == len(got):
            return line
        at += 1
        loose = False
    return None if loose or at == len(got) else f"(more lines than printed: {got[at]!r})"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    try:
        r = Receiver(secret=SECRET, port=PORT).start()
    except OSError as exc:  # the walkthrough's port is taken on this machine
        pytest.skip(f"127.0.0.1:{PORT} is in use ({exc})")
    yield r
    r.stop()


def test_the_commands_of_the_notifications_doc_run_as_printed(
    tmp_path: Path, receiver: Receiver
) -> None:
    steps = _steps()
    assert len(steps) >= 8, steps  # the walkthrough is there
    script = "".join(f"{command}\necho {MARK} $?\n" for command, _ in steps)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CREWAI_IDEMPOTENCY") and k != "CREWAI_HOOK_SECRET"
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "200"
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    # stderr (the dispatcher's line) and stdout, kept apart: each step's stdout is split
    # at the marks; stderr lines are matched against the steps that print them as well.
    chunks = done.stdout.split(f"{MARK} ")
    assert len(chunks) == len(steps) + 1, (done.stdout, done.stderr)
    outputs = [chunks[0]] + [c.split("\n", 1)[1] if "\n" in c else "" for c in chunks[1:]]
    codes = [int(c.split("\n", 1)[0]) for c in chunks[1:]]
    errors = done.stderr.splitlines()
    for (command, printed), code, out in zip(steps, codes, outputs, strict=False):
        assert code == 0, (command, out, done.stderr)
        got = out.splitlines()
        printed_err = [line for line in printed if line.startswith("dispatcher ")]
        for line in printed_err:  # what notify says of itself goes to stderr
            assert any(_pattern(line).match(e) for e in errors), (command, line, errors)
        missing = _printed_in([p for p in printed if p not in printed_err], got)
        assert missing is None, (command, missing, got)
    verified = [r["verified"] for r in receiver.received]
    assert verified and all(verified), [r["error"] for r in receiver.received]
    kinds = sorted(r["json"]["type"] for r in receiver.received)
    assert kinds == ["approval.approved", "approval.requested", "spend.refused"]


def test_the_walkthrough_s_matching_can_fail() -> None:
    printed = ["sent ob_29c5e9207311d08cfc48d99e approval.requested to webhook-d77ac5b1b3: x"]
    assert (
        _printed_in(
            printed, ["sent ob_" + "a" * 24 + " approval.requested to webhook-" + "b" * 10 + ": x"]
        )
        is None
    )
    assert _printed_in(printed, ["failed ob_" + "a" * 24 + " approval.requested"]) is not None
    assert _printed_in(["…", "b"], ["a", "b", "c"]) is not None
    assert _printed_in(["…", "b", "…"], ["a", "b", "c"]) is None
