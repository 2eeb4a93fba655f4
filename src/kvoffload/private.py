"""Files and folders kvoffload creates are its user's alone: folders 0700, files 0600,
whatever the process umask.

KV blocks are prompts in another form, so a cache on disk must not be readable by other
users of the machine. The umask can only take permission bits away, so each helper sets
the mode explicitly after creating (``chmod``/``fchmod``), which also tightens what an
earlier, laxer version left behind.

* ``make_private_dirs(path)`` creates the missing folders of ``path`` with 0700; folders
  that already exist are left as they are (a ``root_dir`` chosen by the operator may be
  shared on purpose).
* ``private_dir(path)`` is ``make_private_dirs`` and then makes ``path`` itself 0700: for a
  folder kvoffload owns (a disk tier's namespace).
* ``open_private(path, flags)`` opens (creating if needed) a file with mode 0600 and
  returns the descriptor.
* ``chmod_private(path)`` makes an existing file 0600 (e.g. a socket file a library
  created).

A file or folder that belongs to another user, or lies on a read-only file system,
cannot be changed; it is left as it is (writing it then fails on its own, with the error
naming it).
"""

from __future__ import annotations

import errno
import os
import stat

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dirs(path: str | os.PathLike) -> None:
    """Create the missing folders of ``path``, each with mode 0700."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            continue  # made by someone else meanwhile: not ours to change
        _chmod(folder, DIR_MODE)


def private_dir(path: str | os.PathLike) -> None:
    """``path`` exists and is a 0700 folder."""
    make_private_dirs(path)
    _chmod(os.fspath(path), DIR_MODE)


def open_private(path: str | os.PathLike, flags: int) -> int:
    """``os.open(path, flags | O_CREAT)`` with the file's mode 0600."""
    fd = os.open(path, flags | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except PermissionError:
        pass  # another user's file: left as it is
    except BaseException:
        os.close(fd)
        raise
    return fd


def chmod_private(path: str | os.PathLike) -> None:
    """Make the existing file ``path`` 0600."""
    _chmod(os.fspath(path), FILE_MODE)


def _chmod(path: str, mode: int) -> None:
    try:
        if stat.S_IMODE(os.stat(path).st_mode) != mode:
            os.chmod(path, mode)
    except PermissionError:
        pass  # another user's: left as it is
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        # a read-only file system: the write that follows fails and says so
