"""What signed decisions cost where they are used, and that a replay pays nothing for them.

    python bench/signing.py [--mode NORMAL] [--calls 300] [--rounds 3] [--dir DIR]

Each round makes one SQLite ledger in a temp folder (made under DIR if given, removed at
the end) and two `Ledger`s on it: unsigned (no trusted keys: today's default) and signed
(the workers' trusted keys file, read with `TrustedKeys.from_file`, on the ledger and in
the approval plan; approvals and resolutions signed by Ed25519 key files made with
`Signer.create`). Everything a timed call needs (the request asked, the approvals made,
the record made UNCERTAIN and resolved) is done before the clock starts; the clock times
only the call that uses the decision. The loops run in alternating blocks of 25 calls (a
noisy neighbour hits every loop alike; every other block in reverse order, so no loop
always follows another), CPU time per call (user + system, this process): the fastest
of a round's blocks, then the median of the rounds. Each loop runs unsigned and signed:

1. granted call, 1 or 2 approvers: a fresh key per call, asked (`Ledger.run` with an
   approval plan raised `ApprovalRequired`) and approved by one approver, or by two (the
   two-person rule), unsigned (`Approvals(store).approve(rid, by=...)`) or signed
   (`Approvals(store, signer, trusted_keys=...).approve(rid)`). Timed: the call that
   takes over the asked key, uses the grant (signed: verifies each approval against the
   trusted keys) and runs the body and commits.
2. replay of a granted call: the two-approver keys again, the stored receipt.
3. resolved absent, next call runs: a fresh key per call whose body raised
   `OutcomeUnknown` (UNCERTAIN), then `Ledger.resolve(key, absent=True, by=...)` or with
   `signer=`. Timed: the next call, which obeys the resolution (signed: verifies it),
   takes the key over and runs the body and commits.
4. resolved happened, replay: the same, resolved with `result=` (the charge was found).
   Timed: a call that replays the receipt the resolution stored. A receipt a resolution
   found is a use of that resolution: with trusted keys every such replay verifies it.

And, run among the first loops, `cryptography`'s Ed25519 verification of one signature
over a decision's canonical bytes alone: what no bookkeeping around the check can remove.

The approval plan is the stage the crewAI guard builds for a flagged tool
(`gates._plan.Plan`, as tests/signed_approvals/test_gate.py drives it); the rest is the
public API. The signed/unsigned ratio of each loop is what a signature check costs where
the decision is used. A seam counts the verifications each loop made: it wraps
`crewai_idempotent.signing.verify` (the approvals' check) and the module function the
ledger's resolution check imports, and the printed figure is verifications per timed call
(2 for a two-person grant, 0 for every ordinary replay). The seam's own cost (one Python
call) is inside the signed figures.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = 25
MODES = ("unsigned", "signed")


def _cpu() -> float:
    return time.process_time()


class Verifications:
    """The seam: every call of `signing.verify` counted under the loop running."""

    def __init__(self) -> None:
        self.loop: str | None = None  # None: setup, not counted
        self.counts: dict[str, int] = {}

    def install(self) -> None:
        from crewai_idempotent import signing
        from crewai_idempotent.signing import _verify

        real = signing.verify

        def counting(*args: Any, **kwargs: Any) -> Any:
            if self.loop is not None:
                self.counts[self.loop] = self.counts.get(self.loop, 0) + 1
            return real(*args, **kwargs)

        # The approvals look `verify` up on the package, the ledger's resolution check
        # on its module: one wrapper in both places, around the one function.
        signing.verify = counting
        _verify.verify = counting


def _per_call(
    loops: dict[str, Callable[[int], Any]], calls: int, seam: Verifications
) -> dict[str, float]:
    """CPU seconds per call of each loop, run in alternating blocks of BLOCK calls: the
    fastest block's, as `timeit` advises. Load on a shared machine only ever adds time,
    so the least disturbed block is the closest reading of what a call costs; every loop
    is read the same way. Every other block runs the loops in reverse order: a loop run
    right after another reads a few percent faster or slower than in its own place (the
    unsigned replay, always run first, read 4-9 % slower than the signed one, and as fast
    with the order swapped), which hides a difference of that size. The seam is told
    which loop runs (once per block)."""
    spent: dict[str, list[float]] = {name: [] for name in loops}
    forward = list(loops.items())
    for start in range(0, calls, BLOCK):
        stop = min(start + BLOCK, calls)
        for name, loop in forward if start // BLOCK % 2 == 0 else forward[::-1]:
            seam.loop = name
            begin = _cpu()
            for i in range(start, stop):
                loop(i)
            spent[name].append((_cpu() - begin) / (stop - start))
    seam.loop = None
    return {name: min(blocks) for name, blocks in spent.items()}


class Keys:
    """The operators' Ed25519 key files and the workers' trusted keys file."""

    def __init__(self, folder: Path) -> None:
        from crewai_idempotent.signing import Signer, TrustedKeys

        folder.mkdir(mode=0o700)
        self.alice = Signer.create(folder / "alice.key", identity="alice@example.com")
        self.bob = Signer.create(folder / "bob.key", identity="bob@example.com")
        self.operator = Signer.create(
            folder / "operator.key", identity="operator@example.com", roles=["resolve"]
        )
        trusted = folder / "trusted_keys"
        trusted.write_text(
            "".join(f"{s.trusted_line()}\n" for s in (self.alice, self.bob, self.operator))
        )
        trusted.chmod(0o644)
        # Deployed with the workers, not just written: a file changed in the last two
        # seconds is read again on every use (`TrustedKeys`: a change within the mtime's
        # resolution), which no worker pays once the file has settled.
        hour_ago = time.time() - 3600
        os.utime(trusted, (hour_ago, hour_ago))
        self.trusted = TrustedKeys.from_file(trusted)


class Round:
    """One round's ledger, its two modes, and the calls each loop makes."""

    def __init__(self, store: Any, keys: Keys, tag: str, calls: int) -> None:
        from crewai_idempotent import Ledger

        self.store, self.keys, self.tag, self.calls = store, keys, tag, calls
        self.ledgers = {
            "unsigned": Ledger(store),
            "signed": Ledger(store, trusted_keys=keys.trusted),
        }

    def key(self, loop: str, mode: str, i: int) -> tuple[str, str]:
        key = f"pay:{self.tag}:{loop}:{mode[0]}:{i}"  # u or s: keys of one length
        return key, hashlib.sha256(key.encode()).hexdigest()

    def plan(self, mode: str, fingerprint: str, approvers: int) -> Any:
        from crewai_idempotent.gates._plan import Plan

        trusted = self.keys.trusted if mode == "signed" else None
        return Plan(
            tool="pay_invoice", fingerprint=fingerprint, approval=True, approvers=approvers,
            summary={"invoice": "INV-7"}, trusted_keys=trusted,
        )  # fmt: skip

    def granted(self, mode: str, approvers: int, loop: str) -> Callable[[int], Any]:
        """Asks and approves every call of `loop` now; the call that uses the grant."""
        from crewai_idempotent import ApprovalRequired, Approvals

        ledger = self.ledgers[mode]
        calls: list[tuple[str, str, Any]] = []
        for i in range(self.calls):
            key, digest = self.key(loop, mode, i)
            plan = self.plan(mode, digest, approvers)
            try:
                ledger.run(key, _unreachable, fingerprint=digest, stage=plan)
                raise AssertionError(f"{key}: ran without an approval")
            except ApprovalRequired as asked:
                rid = asked.request_id
            for signer in (self.keys.alice, self.keys.bob)[:approvers]:
                if mode == "signed":
                    Approvals(self.store, signer, trusted_keys=self.keys.trusted).approve(rid)
                else:
                    Approvals(self.store).approve(rid, by=signer.identity)
            calls.append((key, digest, plan))

        def call(i: int) -> Any:
            key, digest, plan = calls[i]
            return ledger.run(key, lambda: f"ch_{i}", fingerprint=digest, stage=plan)

        return call

    def resolved(self, mode: str, loop: str, *, absent: bool) -> Callable[[int], Any]:
        """Makes every call of `loop` UNCERTAIN and resolves it now; the next call."""
        from crewai_idempotent import OutcomeUnknown

        ledger = self.ledgers[mode]
        calls: list[tuple[str, str]] = []
        for i in range(self.calls):
            key, digest = self.key(loop, mode, i)
            try:
                ledger.run(key, _timed_out, fingerprint=digest)
                raise AssertionError(f"{key}: the body did not raise")
            except OutcomeUnknown:
                pass
            settled: dict[str, Any] = {"absent": True} if absent else {"result": f"ch_{i}"}
            if mode == "signed":
                ledger.resolve(key, signer=self.keys.operator, reason="checked", **settled)
            else:
                ledger.resolve(key, by=self.keys.operator.identity, reason="checked", **settled)
            calls.append((key, digest))

        def call(i: int) -> Any:
            key, digest = calls[i]
            return ledger.run(key, lambda: f"ch_{i}", fingerprint=digest)

        return call


def _unreachable() -> str:
    raise AssertionError("the body ran before its approval")


def _timed_out() -> str:
    from crewai_idempotent import OutcomeUnknown

    raise OutcomeUnknown("the provider timed out")


def _ed25519_alone() -> Callable[[int], Any]:
    """`cryptography`'s Ed25519 check of one signature over a resolution's canonical
    bytes, and nothing else: the part of a signature check no bookkeeping can remove."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from crewai_idempotent.signing import Decision

    decision = Decision.absent(
        key="pay:r0:ra:s:0", token=2, by="operator@example.com", via="api",
        at=time.time(), reason="checked",
    )  # fmt: skip
    message = decision.canonical()
    private = Ed25519PrivateKey.generate()
    signature, public = private.sign(message), private.public_key()
    return lambda i: public.verify(signature, message)


def _round(one: Round, seam: Verifications) -> dict[str, float]:
    """One round: the calls that use a fresh decision side by side, then the replays."""
    fresh: dict[str, Callable[[int], Any]] = {}
    granted2: dict[str, Callable[[int], Any]] = {}
    for mode in MODES:
        fresh[f"granted, 1 approver {mode}"] = one.granted(mode, 1, "g1")
        granted2[mode] = one.granted(mode, 2, "g2")
        fresh[f"granted, 2 approvers {mode}"] = granted2[mode]
        fresh[f"resolved absent, next call {mode}"] = one.resolved(mode, "ra", absent=True)
    fresh["Ed25519 verify alone"] = _ed25519_alone()
    measured = _per_call(fresh, one.calls, seam)
    replays: dict[str, Callable[[int], Any]] = {}
    for mode in MODES:
        replays[f"replay of a granted call {mode}"] = granted2[mode]
        replays[f"resolved happened, replay {mode}"] = one.resolved(mode, "rf", absent=False)
    return {**measured, **_per_call(replays, one.calls, seam)}


ROWS = (
    "granted, 1 approver",
    "granted, 2 approvers",
    "replay of a granted call",
    "resolved absent, next call",
    "resolved happened, replay",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="NORMAL", choices=["FULL", "NORMAL", "CLAIMS"])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the ledger files go (a local disk)")
    options = parser.parse_args()

    import crewai_idempotent
    from crewai_idempotent import SQLiteCacheBackend

    folder = Path(tempfile.mkdtemp(prefix="signing-", dir=options.dir))
    seam = Verifications()
    seam.install()
    rows: dict[str, list[float]] = {}
    try:
        keys = Keys(folder / "keys")
        for round_no in range(options.rounds):
            path = folder / f"ledger-{round_no}.db"
            store = SQLiteCacheBackend(path, synchronous=options.mode)
            try:
                measured = _round(Round(store, keys, f"r{round_no}", options.calls), seam)
            finally:
                store.close()
            for name, value in measured.items():
                rows.setdefault(name, []).append(value)
    finally:
        shutil.rmtree(folder)  # some 40 MB a round at the defaults, and private keys

    median = {name: statistics.median(values) * 1e6 for name, values in rows.items()}
    timed = options.calls * options.rounds
    print(f"crewai_idempotent {crewai_idempotent.__file__}")
    print(f"SQLite synchronous={options.mode}, {options.calls} calls x {options.rounds} rounds")
    print(f"{'CPU us per call':28} {'unsigned':>9} {'signed':>9} {'ratio':>6}  verifications")
    for row in ROWS:
        unsigned, signed = median[f"{row} unsigned"], median[f"{row} signed"]
        counted = [seam.counts.get(f"{row} {mode}", 0) / timed for mode in MODES]
        print(
            f"{row:28} {unsigned:9.1f} {signed:9.1f} {signed / unsigned:6.2f}"
            f"  {counted[0]:g} / {counted[1]:g} per call"
        )
    alone = median["Ed25519 verify alone"]
    print(f"{'Ed25519 verify alone':28} {'':9} {alone:9.1f}  (cryptography: the signature only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
