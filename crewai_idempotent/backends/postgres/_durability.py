"""Whether a PostgreSQL server keeps the commits it acknowledges: the settings to read,
and what each one that does not risks.

A claim is the ledger's promise that a body has not started elsewhere; if the server
acknowledges the claim and then loses it (an OS crash with fsync off, a commit
acknowledged before it reached the disk, a failover to a standby that never had it), the
body can run again. The store reads these settings on first use and warns; `doctor`
prints the same problems and exits 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

# The settings that decide whether an acknowledged commit survives, as this session sees
# them, and how many standbys stream from the server (a failover target).
_DURABILITY = (
    "SELECT current_setting('fsync'), current_setting('synchronous_commit'), "
    "current_setting('full_page_writes'), current_setting('synchronous_standby_names'), "
    "(SELECT count(*) FROM pg_stat_replication)"
)


def read_durability(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """The settings as the session of `conn` sees them (see `_DURABILITY`)."""
    row = conn.execute(_DURABILITY).fetchone()
    assert row is not None
    fsync, synchronous_commit, full_page_writes, standby_names, standbys = row
    return {
        "fsync": str(fsync),
        "synchronous_commit": str(synchronous_commit),
        "full_page_writes": str(full_page_writes),
        "synchronous_standby_names": str(standby_names),
        "standbys": str(standbys),
    }


def durability_problems(settings: dict[str, str]) -> list[tuple[str, str]]:
    """Each setting (as `name=value`) that can lose a commit the server acknowledged, with
    what it risks: a claim lost after its body started lets the body run again."""
    found: list[tuple[str, str]] = []
    on = {"on", "true", "yes", "1"}
    if settings.get("fsync", "on").lower() not in on:
        found.append((
            "fsync=off",
            "the server never forces its writes to disk: an operating-system crash or a "
            "power loss can lose or corrupt acknowledged claims and receipts, and those "
            "tools then run again. Set fsync=on",
        ))  # fmt: skip
    commit = settings.get("synchronous_commit", "on").lower()
    if commit == "off":
        found.append((
            "synchronous_commit=off",
            "commits are acknowledged before they reach the disk: a crash of the server "
            "loses the last acknowledged claims (up to three times wal_writer_delay), and "
            "those tools then run again. Set it on for the ledger's role or database "
            "(ALTER ROLE ... SET synchronous_commit = on)",
        ))  # fmt: skip
    if settings.get("full_page_writes", "on").lower() not in on:
        found.append((
            "full_page_writes=off",
            "an operating-system crash in the middle of a page write can leave the ledger "
            "table torn beyond what the WAL can repair, losing acknowledged claims, and "
            "those tools then run again. Leave it on unless the filesystem guarantees "
            "atomic page writes",
        ))  # fmt: skip
    standbys = int(settings.get("standbys", "0") or 0)
    names = settings.get("synchronous_standby_names", "").strip()
    if standbys and not names:
        found.append((
            "synchronous_standby_names=''",
            f"{standbys} standby server(s) replicate from this one asynchronously: a "
            "failover to one can lose claims the primary acknowledged, and those tools "
            "then run again. Name them in synchronous_standby_names (or accept the risk "
            "of a failover)",
        ))  # fmt: skip
    elif standbys and names and commit == "local":
        found.append((
            "synchronous_commit=local",
            f"commits do not wait for the synchronous standbys ({names}): a failover can "
            "lose acknowledged claims. Use on or remote_apply for the ledger's role",
        ))  # fmt: skip
    return found
