"""The Redis ledger's key layout, and the secondary index entries a record calls for.

Under the ledger's prefix `p`:

- `p r:<key>`: the record, a hash: `status`, `token`, `revision`, `doc` (every release),
  and, written by this one, `x` (the `<token>:<revision>` the record's secondary entries
  were made for) and `xn` `xe` `xs` `xt` `xk` (which of them it has: the scripts remove
  exactly those when the record changes).
- `p i:<STATUS>`: a sorted set per status, keys scored by last update (every release).
- `p docs`: the package's documents' keys, all scored 0, for ZRANGEBYLEX (every release).
- `p x:n`: the keys flagged for an operator, scored by last update.
- `p x:e`: the COMMITTED keys with an expiry, scored by `expires_at`.
- `p x:s:<bucket>`: documents of one kind in one state, all scored 0 (key order).
- `p x:t:<bucket>`: documents of one kind in one state (or with none), by last update.
- `p x:k:<subject>`: documents about one call (their `key` field), all scored 0.
- `p x:buckets`: the buckets that have ever held a document, to find those of a prefix.
- `p x:changes`: a counter every write of this release increments (`changes()`).
- `p x:ready`, `p x:fill`: whether the `x:` indexes hold every record, and the backfill's
  progress (`_backfill`).

A bucket is a document kind (the path segment after `DOCUMENTS`, `approval/`) and a state
(`=PENDING`), or `-` for a document with no text `state`: `<len(kind)>:<kind><tag>`, so a
kind or a state can hold any character and two buckets never share a name.

Only the previous release's keys (`r:`, `i:`, `docs`) are kept by its scripts; the `x:`
ones are this release's, and `_select` and `_backfill` say what that means for a ledger
both write.
"""

from __future__ import annotations

from typing import NamedTuple

from ...ledger._backend import DOCUMENTS
from ...ledger._record import Record, Status
from ...ledger._select import document_field

STATUSES = (Status.PENDING, Status.COMMITTED, Status.FAILED, Status.UNCERTAIN)
# A longer first path segment is not a kind of the package's: such documents share the
# bucket of no kind, so a key of someone's cannot make a bucket per key.
_KIND_MAX = 64


class Entries(NamedTuple):
    """The secondary entries of one version of a record, as the scripts take them (text,
    "" for none; `list(entries)` is the scripts' arguments)."""

    stamp: str  # "<token>:<revision>": the version these entries are for
    needs: str  # "1": in x:n
    expiry: str  # the x:e score (expires_at), or ""
    state: str  # the x:s key, or ""
    timed: str  # the x:t key, or ""
    bucket: str  # the bucket of `timed` (a member of x:buckets), or ""
    subject: str  # the x:k key, or ""

    def args(self) -> list[str]:
        return [self.stamp, self.needs, self.expiry, self.state, self.timed, self.bucket,
                self.subject]  # fmt: skip

    def holds(self, index: str, layout: Layout) -> bool:
        """True when these entries put the record in the sorted set `index`."""
        if index == layout.needs:
            return bool(self.needs)
        if index == layout.expiry:
            return bool(self.expiry)
        return index in (self.state, self.timed, self.subject)


def stamp(token: object, revision: object) -> str:
    return f"{token}:{revision}"


def kind_of(key: str) -> str:
    """The document kind of a key under `DOCUMENTS`: its next path segment with the slash
    (`approval/`), or "" for none (no slash, or a segment too long to be one of ours)."""
    head, slash, _ = key[len(DOCUMENTS) :].partition("/")
    return head + slash if slash and len(head) < _KIND_MAX else ""


def bucket(kind: str, state: object) -> str:
    tag = f"={state}" if isinstance(state, str) else "-"
    return f"{len(kind)}:{kind}{tag}"


def parse_bucket(name: str) -> tuple[str, str | None]:
    """(kind, state) of a bucket's name; state None for `-`."""
    size, _, rest = name.partition(":")
    kind, tag = rest[: int(size)], rest[int(size) :]
    return kind, (tag[1:] if tag.startswith("=") else None)


def kinds_under(kind: str, prefix: str) -> bool:
    """True when documents of `kind` can have keys starting with `prefix` (under
    `DOCUMENTS`): the kind of no name holds any."""
    rest = prefix[len(DOCUMENTS) :]
    return not kind or kind.startswith(rest) or rest.startswith(kind)


class Layout:
    """The names of a ledger's keys, for one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.records = f"{prefix}r:"
        self.indexes = [f"{prefix}i:{status.value}" for status in STATUSES]
        self.documents = f"{prefix}docs"
        self.needs = f"{prefix}x:n"
        self.expiry = f"{prefix}x:e"
        self.buckets = f"{prefix}x:buckets"
        self.changes = f"{prefix}x:changes"
        self.ready = f"{prefix}x:ready"
        self.fill = f"{prefix}x:fill"

    def record(self, key: str) -> str:
        return self.records + key

    def index(self, status: Status) -> str:
        return f"{self.prefix}i:{status.value}"

    def state_set(self, bucket: str) -> str:
        return f"{self.prefix}x:s:{bucket}"

    def time_set(self, bucket: str) -> str:
        return f"{self.prefix}x:t:{bucket}"

    def subject_set(self, subject: str) -> str:
        return f"{self.prefix}x:k:{subject}"

    def entries(self, record: Record) -> Entries:
        """The secondary entries `record` calls for. Read from the record as decoded, so
        a document's content (NaN, keys named like ours) can only decide what its own
        fields say, never make a write fail."""
        expires = record.expires_at
        # NaN is at or before no time: such a receipt is never expired_by anything.
        expiry = ""
        if expires is not None and record.status is Status.COMMITTED and expires == expires:
            expiry = repr(float(expires))
        needs = "1" if record.needs_operator else ""
        key = record.key
        if not key.startswith(DOCUMENTS):  # the claim path: no document to look into
            return Entries(f"{record.token}:{record.revision}", needs, expiry, "", "", "", "")
        found = document_field(record, "state")
        group = bucket(kind_of(key), found)
        about = document_field(record, "key")
        return Entries(
            stamp(record.token, record.revision),
            needs,
            expiry,
            self.state_set(group) if isinstance(found, str) else "",
            self.time_set(group),
            group,
            self.subject_set(about) if isinstance(about, str) else "",
        )
