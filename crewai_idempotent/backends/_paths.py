"""Refusing ledger files and folders that another local user could tamper with.

A ledger is only as trustworthy as the files it lives in: a receipt that another user can
erase is a body that runs twice. Every file and folder of a ledger, new or pre-existing,
must be owned by this user (or root) and writable by nobody else. A world-writable folder
is refused, except a sticky one such as /tmp, which is safe for a file this user owns:
the sticky bit stops other users from deleting or renaming it, and a file they planted
first (or a symlink) is refused by owner and type. `allow_insecure_path=True` waives
every check.

A ledger creates at most its own file or folder: a missing parent folder is a
`LedgerConfigurationError` naming it, unless `create_parents=True` (a deployment script
that lays out a fresh host). A typo in a path must not start an empty ledger beside the
real one, and a run body then run again.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .._errors import LedgerConfigurationError, LedgerUnavailable

_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH
_OVERRIDE = "allow_insecure_path=True accepts that risk"


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def tamper_risk(st: os.stat_result, path: Path, what: str) -> str | None:
    """Why another local user could change `path` (described by `st`): it is theirs, or
    group or others may write to it. None when neither. (The signing keys' files are
    judged by the same rule: `signing/_files`.)"""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return (
            f"{what} {path} is owned by {_owner_name(st.st_uid)}, not by this user "
            f"({_owner_name(me)}) or root"
        )
    if st.st_mode & _UNSAFE_BITS:
        return f"{what} {path} is writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def check_trusted(st: os.stat_result, path: Path, what: str) -> None:
    """Refuse `path` (described by `st`) if another user owns it or may write to it."""
    risk = tamper_risk(st, path, what)
    if risk is not None:
        who = "another user" if st.st_uid in (os.geteuid(), 0) else "its owner"
        raise LedgerUnavailable(f"{risk}: {who} could rewrite or erase receipts ({_OVERRIDE})")


def check_existing_file(path: Path, what: str, allow_insecure: bool) -> os.stat_result | None:
    """Check a ledger file that may exist (a -wal, a -shm, a record): None if absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerUnavailable(f"cannot inspect {what} {path}: {exc}") from exc
    if allow_insecure:
        return st
    if stat.S_ISLNK(st.st_mode):
        raise LedgerUnavailable(f"{what} {path} is a symlink; refusing it ({_OVERRIDE})")
    if not stat.S_ISREG(st.st_mode):
        raise LedgerUnavailable(f"{what} {path} is not a regular file")
    check_trusted(st, path, what)
    return st


def _check_folder(folder: Path, allow_insecure: bool) -> None:
    st = folder.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise LedgerUnavailable(f"ledger folder {folder} is not a directory")
    if allow_insecure:
        return
    check_trusted(st, folder, "ledger folder")


def require_parent(path: Path, what: str, create_parents: bool) -> None:
    """Refuse `path` when its parent folder does not exist, unless `create_parents`."""
    parent = path.parent
    if create_parents or parent.is_dir():
        return
    missing = parent
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    nearest = f" ({missing} is missing)" if missing != parent else ""
    raise LedgerConfigurationError(
        f"the folder {parent} for the {what} {path} does not exist{nearest}; "
        "a ledger creates only its own file or folder, so that a typo cannot start an empty "
        "ledger beside the real one (create_parents=True, or create_parents=true in a URL, "
        "makes the missing folders)"
    )


def private_folder(folder: Path, allow_insecure: bool, *, create_parents: bool = False) -> Path:
    """Create `folder` 0700 if absent (its parents too only with `create_parents`); refuse a
    symlink, or a folder another user owns or may write to."""
    folder = folder.expanduser().absolute()
    if folder.is_symlink() and not allow_insecure:
        raise LedgerUnavailable(
            f"ledger folder {folder} is a symlink, which is refused ({_OVERRIDE})"
        )
    if not folder.exists():
        require_parent(folder, "ledger folder", create_parents)
    try:
        if not folder.exists():
            os.makedirs(folder, mode=0o700, exist_ok=True)
        _check_folder(folder, allow_insecure)
    except OSError as exc:
        raise LedgerUnavailable(f"cannot prepare ledger folder {folder}: {exc}") from exc
    return folder


def _shared_sticky(folder: Path) -> bool:
    """True for a folder like /tmp: writable by others, sticky, owned by root or this user
    (a sticky folder's owner may still delete anything in it)."""
    st = folder.stat()
    return (
        stat.S_ISDIR(st.st_mode)
        and bool(st.st_mode & _UNSAFE_BITS)
        and bool(st.st_mode & stat.S_ISVTX)
        and st.st_uid in (os.geteuid(), 0)
    )


def private_file(
    path: Path, allow_insecure: bool, *, create_parents: bool = False
) -> tuple[Path, os.stat_result]:
    """Create the ledger file 0600 if absent, or check the one that exists. Its folder must
    exist already unless `create_parents` (then it is made 0700).

    Returns the absolute path and the file's identity (its stat), which the backend
    compares later to notice the file being deleted or replaced under it.
    """
    path = path.expanduser().absolute()
    require_parent(path, "ledger file", create_parents)
    if path.is_symlink() and not allow_insecure:
        raise LedgerUnavailable(f"ledger path {path} is a symlink, which is refused ({_OVERRIDE})")
    try:
        sticky = not allow_insecure and path.parent.is_dir() and _shared_sticky(path.parent)
    except OSError as exc:
        raise LedgerUnavailable(f"cannot inspect ledger folder {path.parent}: {exc}") from exc
    if not sticky:
        private_folder(path.parent, allow_insecure, create_parents=True)
    try:
        # O_EXCL and O_NOFOLLOW: in a shared folder the file is either created here, by
        # this user, or it already existed and is checked below like any other.
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        pass
    except OSError as exc:
        raise LedgerUnavailable(f"cannot create ledger file {path}: {exc}") from exc
    else:
        os.close(fd)
    try:
        st = os.stat(path) if allow_insecure else os.lstat(path)
    except OSError as exc:
        raise LedgerUnavailable(f"cannot inspect ledger file {path}: {exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise LedgerUnavailable(f"ledger path {path} is a symlink, which is refused ({_OVERRIDE})")
    if not stat.S_ISREG(st.st_mode):
        raise LedgerUnavailable(f"ledger path {path} exists and is not a regular file")
    if not allow_insecure:
        check_trusted(st, path, "ledger file")
    return path, st
