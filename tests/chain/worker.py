"""A worker process of the forgery tests: one guarded charge, or one resolution, on a
ledger it opens from a URL, with or without trusted keys, printing what came of it as one
JSON line.

    python -m tests.chain.worker charge URL PROVIDER KEY [--trusted FILE] [--uncertain]
    python -m tests.chain.worker resolve URL KEY [--trusted FILE] [--key FILE] [--by NAME]
"""

from __future__ import annotations

import argparse
import json
import sys

from crewai_idempotent import (
    DecisionRefused,
    IdempotencyError,
    Ledger,
    OutcomeUnknown,
    backend_from_url,
)
from crewai_idempotent.signing import Signer, TrustedKeys
from tests.support.faults.provider import Provider


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["charge", "resolve"])
    parser.add_argument("url")
    parser.add_argument("rest", nargs="+")
    parser.add_argument("--trusted")
    parser.add_argument("--uncertain", action="store_true")
    parser.add_argument("--key")
    parser.add_argument("--by")
    args = parser.parse_args()
    trusted = TrustedKeys.from_file(args.trusted) if args.trusted else None
    ledger = Ledger(backend_from_url(args.url), trusted_keys=trusted)
    said: dict[str, object]
    try:
        if args.what == "charge":
            provider_path, key = args.rest
            provider = Provider(provider_path)

            def charge() -> str:
                receipt = provider.charge(key)
                if args.uncertain:
                    raise OutcomeUnknown("the provider timed out after charging")
                return receipt

            outcome = ledger.execute(key, charge)
            said = {"outcome": "replayed" if outcome.replayed else "ran", "value": outcome.value}
        else:
            (key,) = args.rest
            signer = Signer.from_file(args.key) if args.key else None
            record = ledger.resolve(
                key, absent=True, by=args.by, reason="no charge at the provider", signer=signer
            )
            said = {"outcome": "resolved", "status": record.status.value}
    except DecisionRefused as exc:
        said = {"outcome": "refused", "reason": exc.reason, "message": str(exc)}
    except (IdempotencyError, OutcomeUnknown) as exc:
        said = {"outcome": type(exc).__name__, "message": str(exc)}
    finally:
        ledger.close()
    json.dump(said, sys.stdout)


if __name__ == "__main__":
    main()
