"""What a crewAI release newer than the newest tested costs before its verdict is known.

    python bench/verify.py [--runs 20]

1. The digest of the installed files (crewai, crewai_core, crewai_idempotent) that names a
   verdict: hashed in full (no stat cache: a fresh cache folder each run) and from the
   stat cache (the files unchanged since the cache was written), medians. A process pays
   one of the two, once, at its first guarded call on such a release.
2. A guarded call's look while there is no passing verdict yet (read the verdict, try the
   lock): what every refused call costs, median per call.

The cache folder is a temporary one; nothing of the user's is read or written.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import tempfile
import time
from pathlib import Path

from crewai_idempotent.integration import _verify


def _ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        full, cached = [], []
        for run in range(args.runs):
            folder = Path(tmp) / f"cache-{run}"
            folder.mkdir(mode=0o700)
            os.environ[_verify.CACHE_ENV] = str(folder)
            started = time.perf_counter()
            subject = _verify.subject()
            full.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert _verify.subject() == subject
            cached.append(time.perf_counter() - started)
        files = sum(
            len(_verify._files(root))
            for name in _verify.PACKAGES
            if (root := _verify.package_root(name)) is not None
        )
        print(f"files hashed: {files}")
        print(f"digest, hashed in full: {_ms(full)}")
        print(f"digest, from the stat cache: {_ms(cached)}")
        # A run in progress: the subject's lock held on another open file description.
        holder = os.open(_verify.cache_dir() / f"{subject.name}.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(holder, fcntl.LOCK_EX)
        looks = []
        for _ in range(args.runs * 50):
            started = time.perf_counter()
            _verify.read(subject)
            _verify.running(subject)
            looks.append(time.perf_counter() - started)
        os.close(holder)
        print(f"a refused call's look (verdict read, lock tried): {_ms(looks)}")


if __name__ == "__main__":
    main()
