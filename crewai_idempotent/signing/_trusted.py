"""The trusted keys a process checks decisions against: lines given to configure(), or a
file deployed with the workers (its path given to configure(), or in
`$CREWAI_IDEMPOTENCY_TRUSTED_KEYS`). Never keys read from the ledger.

Read strictly: one line that does not parse, one key listed twice, a file another user
could change, or a file with no key at all is a `SigningConfigurationError` when it is
loaded (configure time), never a process that quietly trusts fewer keys or none.

A file is read again when it changes, so that removing a key stops it the next time a
worker uses its configuration. Each use costs one `stat` of the file: a different size,
inode, modification or change time reads it again (checked as at load; a file that no
longer passes raises where it is used, so nothing is obeyed on it). A file changed within
a moment of being read could keep the same size and times (their resolution is coarse), so
until it is two seconds older than when it was read, each use compares its bytes too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .._errors import SigningConfigurationError
from ._encoding import from_b64url
from ._files import read_checked
from ._keys import TrustedKey, parse_line

ENV = "CREWAI_IDEMPOTENCY_TRUSTED_KEYS"
_RACY_NS = 2_000_000_000


@dataclass(frozen=True, slots=True)
class _Loaded:
    keys: Mapping[str, TrustedKey]  # by key id
    signature: tuple[int, ...] | None  # the file's stat when read
    data: bytes | None
    racy_until_ns: int  # while now is before this, a use also compares the bytes


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _parse(lines: Iterable[str], where: str) -> dict[str, TrustedKey]:
    keys: dict[str, TrustedKey] = {}
    for number, text in enumerate(lines, 1):
        key = parse_line(text, f"{where} line {number}")
        if key is None:
            continue
        twice = keys.get(key.key_id)
        if twice is not None:
            raise SigningConfigurationError(
                f"{key.source}: the same {key.algorithm} key as {twice.source} ({key.key_id}); "
                "list each key once (one key for several identities would let one person "
                "count as two)"
            )
        keys[key.key_id] = key
    if not keys:
        raise SigningConfigurationError(
            f"{where} holds no trusted key: every signed decision would be refused (a line "
            "is `<roles> <algorithm> <public key> <identity> [options]`)"
        )
    return keys


class TrustedKeys:
    """The keys decisions are checked against (make one with `from_file`, `from_lines`,
    `from_env` or `load`). A file is read again when it changes. Raises nothing itself;
    each method says what it raises."""

    def __init__(self, keys: Mapping[str, TrustedKey], *, path: Path | None = None) -> None:
        """`keys` by key id, read from `path` (None: lines given directly); use the
        classmethods instead. Raises nothing."""
        self.path = path
        self._loaded = _Loaded(dict(keys), None, None, 0)

    # -- making one ----------------------------------------------------------------------

    @classmethod
    def from_lines(cls, lines: str | Iterable[str], source: str = "trusted keys") -> TrustedKeys:
        """The keys `lines` hold (one string of lines, or an iterable of lines); `source`
        names them in errors. Raises `SigningConfigurationError` for a line that does not
        parse, a key listed twice, or no key at all."""
        text = lines.splitlines() if isinstance(lines, str) else list(lines)
        bad = [line for line in text if not isinstance(line, str)]
        if bad:
            raise SigningConfigurationError(f"{source}: a line is text, not {bad[0]!r:.60}")
        return cls(_parse(text, source))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TrustedKeys:
        """The keys in the file at `path`, read again whenever it changes. Raises
        `SigningConfigurationError` for a file that is missing, that another user could
        change, that is not UTF-8, or whose lines do not parse (as `from_lines`)."""
        trusted = cls({}, path=Path(path).expanduser().absolute())
        trusted._loaded = trusted._read()
        return trusted

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrustedKeys | None:
        """The keys in the file `$CREWAI_IDEMPOTENCY_TRUSTED_KEYS` names (in `environ`,
        by default the process's), or None when it is unset or blank. Raises what
        `from_file` raises, naming the variable."""
        value = (os.environ if environ is None else environ).get(ENV, "").strip()
        if not value:
            return None
        try:
            return cls.from_file(value)
        except SigningConfigurationError as exc:
            raise SigningConfigurationError(f"${ENV}: {exc}") from None

    @classmethod
    def load(cls, source: TrustedKeys | str | os.PathLike[str] | Iterable[str]) -> TrustedKeys:
        """The keys `source` names, as configure() is given them: `TrustedKeys` as they
        are, a path (str or Path) to a file, or lines (a list or tuple of str, or one str
        holding a newline). Raises
        `SigningConfigurationError` as `from_file` or `from_lines` does, and `TypeError`
        for anything else."""
        if isinstance(source, TrustedKeys):
            return source
        if isinstance(source, str) and "\n" in source:
            return cls.from_lines(source, "trusted keys given to configure()")
        if isinstance(source, str | os.PathLike):
            return cls.from_file(source)
        if isinstance(source, Iterable) and not isinstance(source, bytes | Mapping):
            return cls.from_lines(list(source), "trusted keys given to configure()")
        raise TypeError(
            "trusted keys are a file's path, a list of lines or TrustedKeys, not "
            f"{type(source).__name__}"
        )

    # -- reading them --------------------------------------------------------------------

    def _read(self) -> _Loaded:
        assert self.path is not None
        what = "trusted keys file"
        now = time.time_ns()
        data, path, st = read_checked(self.path, what, private=False)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SigningConfigurationError(f"{what} {path} is not UTF-8 text: {exc}") from None
        keys = _parse(text.splitlines(), f"{what} {path}")
        racy = st.st_mtime_ns + _RACY_NS if st.st_mtime_ns + _RACY_NS > now else 0
        return _Loaded(keys, _signature(st), data, racy)

    def _current(self) -> Mapping[str, TrustedKey]:
        loaded = self._loaded
        if self.path is None:
            return loaded.keys
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise SigningConfigurationError(
                f"trusted keys file {self.path} cannot be read any more ({exc.strerror}): "
                "nothing is trusted"
            ) from None
        changed = _signature(st) != loaded.signature
        if not changed and loaded.racy_until_ns:
            try:
                changed = self.path.read_bytes() != loaded.data
            except OSError:
                changed = True  # read again below, which says why
            if not changed and time.time_ns() >= loaded.racy_until_ns:
                loaded = self._loaded = _Loaded(loaded.keys, loaded.signature, loaded.data, 0)
        if changed:
            # No lock: two threads that see the change both read the file, and either
            # reading is right; a lock held across fork() would hang the child instead.
            loaded = self._loaded = self._read()
        return loaded.keys

    def get(self, key_id: str) -> TrustedKey | None:
        """The trusted key whose id is `key_id`, or None (the file is checked for a change
        first). Raises `SigningConfigurationError` if a changed file no longer passes."""
        return self._current().get(key_id)

    def by_credential(self, credential_id: bytes | str) -> TrustedKey | None:
        """The trusted passkey whose credential id is `credential_id` (bytes, or
        base64url as a browser sends it), or None. Raises `SigningConfigurationError` as
        `get` does, and `ValueError` for text that is not base64url."""
        wanted = from_b64url(credential_id) if isinstance(credential_id, str) else credential_id
        for key in self._current().values():
            if key.algorithm == "webauthn" and key.credential_id == wanted:
                return key
        return None

    def identities(self, role: str | None = None) -> set[str]:
        """The identities trusted keys belong to (those with `role`, when given): the
        most approvers a two-person rule can count. Raises `SigningConfigurationError`
        as `get` does."""
        return {k.identity for k in self._current().values() if role is None or role in k.roles}

    def refresh(self) -> None:
        """Check the file for a change now and read it again if it changed. Raises
        `SigningConfigurationError` if it no longer passes."""
        self._current()

    def __iter__(self) -> Iterator[TrustedKey]:
        return iter(list(self._current().values()))

    def __len__(self) -> int:
        return len(self._current())

    def __repr__(self) -> str:
        where = str(self.path) if self.path is not None else "lines"
        return f"TrustedKeys({where}: {len(self._loaded.keys)} keys)"
