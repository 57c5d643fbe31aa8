"""Reading the files signing trusts, refusing those another local user could have changed.

The trusted keys file decides who may approve: another user who can write it, or its
folder, could add a key of theirs. It is judged as a ledger file is
(`backends/_paths.tamper_risk`): owned by this user or root, writable by nobody else, in
a folder no one else can write (a sticky one such as /tmp is safe for a file this user
or root owns). A private key file must also be unreadable by group and others, as SSH
asks of its keys.

Symlinks are followed (a Kubernetes secret or config map is a symlink into a folder the
kubelet swaps): what is checked is the file opened, by `fstat` of the descriptor that is
then read, so a file swapped between the check and the read is not the one read. The
folder checked is the real one the file is in, and the one the given path names.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

from .._errors import SigningConfigurationError
from ..backends._paths import tamper_risk

_PRIVATE_BITS = stat.S_IRWXG | stat.S_IRWXO
_LIMIT = 1 << 20  # a trusted keys file holds lines, not megabytes


def _sticky_safe(folder: os.stat_result, file: os.stat_result) -> bool:
    """A sticky shared folder (/tmp): safe for a file this user or root owns, which the
    sticky bit stops others from deleting or renaming."""
    return bool(folder.st_mode & stat.S_ISVTX) and file.st_uid in (os.geteuid(), 0)


def _check_folder(folder: Path, file: os.stat_result, what: str, path: Path) -> None:
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise SigningConfigurationError(
            f"cannot inspect the folder of {what} {path}: {exc.strerror}"
        ) from None
    risk = tamper_risk(st, folder, "folder")
    if risk is not None and not _sticky_safe(st, file):
        raise SigningConfigurationError(
            f"{what} {path} is in a folder another user could change ({risk}): they could "
            "replace the file with one of their own; nothing is trusted from it"
        )


def read_checked(
    path: str | os.PathLike[str], what: str, *, private: bool
) -> tuple[bytes, Path, os.stat_result]:
    """The bytes of the file at `path` (`what` names it in errors), its absolute path and
    the `fstat` of what was read, after checking that no other user could have changed it
    (and, when `private`, read it). Raises `SigningConfigurationError` for a file that is
    missing, not a regular file, too large, or fails those checks."""
    given = Path(path).expanduser().absolute()
    quoted = shlex.quote(str(given))
    try:
        fd = os.open(given, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise SigningConfigurationError(f"{what} {given} does not exist") from None
    except OSError as exc:
        raise SigningConfigurationError(f"cannot open {what} {given}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SigningConfigurationError(f"{what} {given} is not a regular file")
        risk = tamper_risk(st, given, what)
        if risk is not None:
            fix = f" (`chmod go-w {quoted}`)" if st.st_uid in (os.geteuid(), 0) else ""
            raise SigningConfigurationError(
                f"{risk}: another user could change it{fix}; nothing is trusted from it"
            )
        if private and st.st_mode & _PRIVATE_BITS:
            raise SigningConfigurationError(
                f"{what} {given} may be read or written by group or others (mode "
                f"{stat.filemode(st.st_mode)}): a private key must be this user's alone "
                f"(`chmod 600 {quoted}`)"
            )
        data = file.read(_LIMIT + 1)
    if len(data) > _LIMIT:
        raise SigningConfigurationError(f"{what} {given} is larger than {_LIMIT} bytes")
    if not private:
        real = Path(os.path.realpath(given))
        for folder in dict.fromkeys((given.parent, real.parent)):
            _check_folder(folder, st, what, given)
    return data, given, st


def create_private(path: str | os.PathLike[str], data: bytes, what: str) -> Path:
    """Write `data` to a new file at `path`, 0600 from its first byte, and sync it.
    Raises `SigningConfigurationError` for a file that exists already (a key is never
    overwritten), a missing folder, or a write that fails."""
    given = Path(path).expanduser().absolute()
    if not given.parent.is_dir():
        raise SigningConfigurationError(
            f"the folder {given.parent} for {what} {given} does not exist"
        )
    try:
        fd = os.open(
            given, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        raise SigningConfigurationError(
            f"{what} {given} exists already: a key is never overwritten (choose another file, "
            "or remove this one once no trusted keys line names it)"
        ) from None
    except OSError as exc:
        raise SigningConfigurationError(f"cannot create {what} {given}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        given.unlink(missing_ok=True)
        raise SigningConfigurationError(f"cannot write {what} {given}: {exc.strerror}") from None
    return given
