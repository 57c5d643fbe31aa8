"""Many processes race on one key, round after round: exactly one runs the body each round.

    python -m tests.support.faults.race --ledger URL --provider FILE

is one racer: it answers each key read from stdin with one guarded charge (at the fake
provider) and prints one JSON line about it. `run_race` starts the racers and releases
them together on every round's key.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crewai_idempotent import Ledger, backend_from_url
from tests.support.faults.provider import Provider

ROOT = Path(__file__).resolve().parents[3]


def racer(ledger_url: str, provider_path: str) -> None:  # pragma: no cover - a racer process
    provider = Provider(provider_path)
    ledger = Ledger(backend_from_url(ledger_url), wait_s=60.0)
    ledger.get("warm-up")  # connect and migrate before the first round
    rng = random.Random()
    print("ready", flush=True)
    for line in sys.stdin:
        key = line.strip()

        def charge(key: str = key) -> str:
            receipt = provider.charge(key)
            time.sleep(rng.uniform(0, 0.002))  # widen the window a second racer could use
            return receipt

        try:
            outcome = ledger.execute(key, charge)
            answer = {"key": key, "value": outcome.value, "replayed": outcome.replayed}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            answer = {"key": key, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    ledger.close()


def run_race(url: str, workdir: Path, *, rounds: int, racers: int = 16) -> None:
    """`racers` processes, each with its own backend, all call the same fresh key each
    round, released together; exactly one of them runs the body every round, and every
    racer gets that run's receipt."""
    workdir.mkdir(parents=True, exist_ok=True)
    provider = Provider.create(workdir / "provider.jsonl")
    # Files, not pipes, for stderr: they never fill up and block a racer.
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(racers)]  # noqa: SIM115
    command = [sys.executable, "-m", "tests.support.faults.race", "--ledger", url,
               "--provider", str(provider.path)]  # fmt: skip
    procs = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
        )
        for log in logs
    ]

    def log_of(n: int) -> str:
        logs[n].seek(0)
        return logs[n].read()[-4000:]

    try:
        for n, proc in enumerate(procs):
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line == "ready", f"racer did not start: {line!r} {log_of(n)}"
        tag = secrets.token_hex(4)
        keys = [f"race-{tag}-{round_}" for round_ in range(rounds)]
        for round_, key in enumerate(keys):
            for proc in procs:  # released together: one short write to each stdin
                assert proc.stdin is not None
                proc.stdin.write(key + "\n")
                proc.stdin.flush()
            answers = [json.loads(proc.stdout.readline()) for proc in procs]  # type: ignore[union-attr]
            errors = [a["error"] for a in answers if "error" in a]
            assert not errors, f"round {round_}: {errors}"
            ran = [a for a in answers if not a["replayed"]]
            assert len(ran) == 1, f"round {round_}: {len(ran)} racers ran the body"
            assert {a["value"] for a in answers} == {ran[0]["value"]}, "a racer saw another receipt"
            assert provider.receipts(key) == [ran[0]["value"]], f"round {round_}: provider"
    finally:
        for proc in procs:
            if proc.stdin:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.faults.race", description=__doc__
    )
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--provider", required=True)
    args = parser.parse_args(argv)
    racer(args.ledger, args.provider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
