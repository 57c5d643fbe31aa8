"""The errors beneath the ledger's records: `IdempotencyError` (the base every error of the
package shares, and how they all pickle), and the two a store raises when it cannot read
or write a record, `LedgerUnavailable` and `CorruptRecord`.

Here, not in `_errors`, because `ledger/_record` raises these two while `_errors`' errors
that carry a record (`OutcomeUncertain`, `OperationInProgress`, `BodyFailed`) name its
`Record`: below `_record`, above nothing of the package. `_errors` re-exports all three,
and they say they belong to it (`__module__`): every error is imported from `_errors` (or
the package), and a pickled error names the module the previous release's workers find
it in.
"""

from __future__ import annotations

from typing import Any

_HOME = "crewai_idempotent._errors"


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls, *args)
    BaseException.__init__(error, *args)
    error.__dict__.update(state)
    return error


class IdempotencyError(Exception):
    """Base class of every error the guard raises.

    Picklable whatever a subclass's constructor takes (Celery and multiprocessing pickle
    exceptions): unpickling restores the message and the attributes without calling
    `__init__` again.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class LedgerUnavailable(IdempotencyError):
    """The ledger could not be read or written; the guarded body did not run."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class CorruptRecord(LedgerUnavailable):
    """A stored record cannot be read back: the file, row or key `where` names holds
    something that is not a record this version can read (`detail` says what failed).
    The guarded body did not run."""

    def __init__(self, where: str, detail: str) -> None:
        self.where = where
        self.detail = detail
        super().__init__(f"{where} holds a corrupt record: {detail}")


for _moved in (_rebuild, IdempotencyError, LedgerUnavailable, CorruptRecord):
    _moved.__module__ = _HOME
del _moved
