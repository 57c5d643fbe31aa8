"""Refusing ledger locations that another local user could tamper with."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ._errors import LedgerUnavailable

_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def _check_folder(folder: Path, allow_insecure: bool) -> None:
    mode = folder.stat().st_mode
    if not stat.S_ISDIR(mode):
        raise LedgerUnavailable(f"ledger folder {folder} is not a directory")
    if mode & _UNSAFE_BITS and not allow_insecure:
        raise LedgerUnavailable(
            f"ledger folder {folder} is writable by group or others (mode {stat.filemode(mode)}): "
            "another user could replace the ledger. Use a private folder, or pass "
            "allow_insecure_path=True if you accept that risk"
        )


def private_folder(folder: Path, allow_insecure: bool) -> Path:
    """Create `folder` 0700 if absent; refuse a symlink or a group/other-writable folder."""
    folder = folder.expanduser().absolute()
    if folder.is_symlink() and not allow_insecure:
        raise LedgerUnavailable(
            f"ledger folder {folder} is a symlink; refusing it (pass allow_insecure_path=True)"
        )
    try:
        if not folder.exists():
            os.makedirs(folder, mode=0o700, exist_ok=True)
        _check_folder(folder, allow_insecure)
    except OSError as exc:
        raise LedgerUnavailable(f"cannot prepare ledger folder {folder}: {exc}") from exc
    return folder


def private_file(path: Path, allow_insecure: bool) -> Path:
    """Create the ledger file 0600 if absent; refuse a symlinked path or an unsafe folder."""
    path = path.expanduser().absolute()
    if path.is_symlink() and not allow_insecure:
        raise LedgerUnavailable(
            f"ledger path {path} is a symlink; refusing it (pass allow_insecure_path=True)"
        )
    private_folder(path.parent, allow_insecure)
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600
        )
    except FileExistsError:
        if not path.is_file():
            raise LedgerUnavailable(
                f"ledger path {path} exists and is not a regular file"
            ) from None
    except OSError as exc:
        raise LedgerUnavailable(f"cannot create ledger file {path}: {exc}") from exc
    else:
        os.close(fd)
    return path
