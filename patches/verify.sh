#!/usr/bin/env bash
# Prove patches/crewai-<version>-idempotent-tools.patch against the installed crewai
# (<version> is its version; today's patch is for 1.15.30):
#   1. lay the installed crewai package out as crewAI's repository does
#      (lib/crewai/src/crewai, plus an empty lib/crewai/tests/tools),
#   2. `git apply --check`, then `git apply` the patch there,
#   3. run the patch's tests against the patched source, offline, with the
#      crewai-idempotent plugin switched off and checked to be absent,
#   4. run this repository's ledger conformance suite (tests/core/test_ledger_conformance.py)
#      on the patched core's SQLite store (patches/conformance_core.py), so the patch and
#      the package cannot drift apart,
#   5. run the patched core's ledger with a worker whose wall clock is stepped (faketime,
#      patches/clock_step.py): it must not take over a live claim.
# Exits non-zero on any failure. Usage: patches/verify.sh [scratch-dir]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-$repo/.venv/bin/python}"
if [[ $# -ge 1 ]]; then
    scratch="$1"  # kept afterwards, to look at
else
    scratch="$(mktemp -d /tmp/upstream-verify.XXXXXX)"
    trap 'rm -rf "$scratch"' EXIT  # a folder of our own making goes when we do
fi

# The plugin's .pth hook must not activate, and nothing below may import it.
export CREWAI_IDEMPOTENT_AUTOLOAD=0
# Offline: no telemetry, no tracing, no network-backed defaults.
export CREWAI_DISABLE_TELEMETRY=true CREWAI_DISABLE_TRACKING=true OTEL_SDK_DISABLED=true
export CREWAI_TRACING_ENABLED=false CREWAI_TESTING=true
export OPENAI_API_KEY="${OPENAI_API_KEY:-sk-fake-not-used}"

installed="$(cd / && "$python" -c '
import importlib.util, pathlib
spec = importlib.util.find_spec("crewai")
print(pathlib.Path(spec.origin).parent)
')"
version="$(cd / && "$python" -c 'import importlib.metadata as m; print(m.version("crewai"))')"
patch="$here/crewai-$version-idempotent-tools.patch"
if [[ ! -f "$patch" ]]; then
    echo "verify.sh: crewai $version is installed and patches/ has no patch for it" \
        "(see patches/README.md, 'Another crewAI release')" >&2
    exit 1
fi

echo "== scratch checkout: $scratch (crewai $version from $installed)"
rm -rf "$scratch/lib"
mkdir -p "$scratch/lib/crewai/src" "$scratch/lib/crewai/tests/tools"
cp -r "$installed" "$scratch/lib/crewai/src/crewai"
find "$scratch/lib" -name __pycache__ -prune -exec rm -rf {} +
cd "$scratch"
git init -q .  # git apply needs no commit, but a repository keeps paths exact

echo "== git apply --check"
git apply --check --verbose "$patch"
echo "== git apply"
git apply "$patch"

echo "== pytest (PYTHONPATH=lib/crewai/src)"
cd "$scratch/lib/crewai"
# The conftest-free run: a tiny plugin asserts, after the session, that crewai came
# from the patched tree and that crewai_idempotent was never imported.
cat > "$scratch/verify_guard.py" <<'EOF'
import sys


def pytest_sessionfinish(session, exitstatus):
    import crewai

    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "crewai_idempotent")
    where = crewai.__file__
    print(f"\nverify: crewai imported from {where}")
    print(f"verify: crewai_idempotent modules loaded: {loaded or 'none'}")
    if loaded or not where.startswith(session.config.getoption("--patched-root")):
        session.exitstatus = 3


def pytest_addoption(parser):
    parser.addoption("--patched-root", default="")
EOF
status=0
PYTHONPATH="$scratch/lib/crewai/src:$scratch" "$python" -m pytest \
    -p verify_guard --patched-root "$scratch/lib/crewai/src/crewai" \
    -p no:cacheprovider -W ignore::DeprecationWarning -v \
    tests/tools/test_idempotent_tools.py || status=$?
if [[ $status -ne 0 ]]; then
    echo "verify.sh: FAILED (pytest exit $status)" >&2
    exit "$status"
fi

echo "== ledger conformance suite on the patched core's store"
cd "$repo"
# The plugin's Ledger drives crewAI core's SQLiteIdempotencyBackend through every
# transition; records cross between them as their shared JSON document.
status=0
CONFORMANCE_BACKENDS=crewai-core PYTHONPATH="$scratch/lib/crewai/src:$repo" "$python" -m pytest \
    -p patches.conformance_core -p no:cacheprovider -q -n 0 \
    -W ignore::DeprecationWarning -W ignore::RuntimeWarning \
    tests/core/test_ledger_conformance.py || status=$?
if [[ $status -ne 0 ]]; then
    # 5 ("no tests collected") would mean the core's store was never exercised.
    echo "verify.sh: FAILED (conformance suite exit $status)" >&2
    exit "$status"
fi
echo "== clock steps: the patched core's ledger, a worker's wall clock stepped (faketime)"
# A worker whose wall clock reads an hour or a day ahead must not take over a live claim
# (on_stale="retry") and run the body a second time: leases are judged by the host's
# monotonic clock, as the plugin judges them (docs/backends.md, "Clocks").
status=0
PYTHONPATH="$scratch/lib/crewai/src" "$python" "$here/clock_step.py" "$scratch" || status=$?
if [[ $status -ne 0 ]]; then
    echo "verify.sh: FAILED (clock steps exit $status)" >&2
    exit "$status"
fi
echo "verify.sh: OK"
