"""Files and directories only their owner can open: 0600 and 0700, whatever the umask.

Blocks on disk are prompts in another form, so what kvtier creates is private
by default. A mode given to ``open``/``mkdir`` is filtered by the process umask,
and ``os.makedirs`` creates intermediate directories with the umask's default
(0755 under the usual 022); so every directory created here is ``chmod``'d to
0700 explicitly. Directories that already exist are left as they are: their
mode is their owner's choice (a shared mount an operator set up, say).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from kvtier.errors import ConfigError

#: mode of every file kvtier creates (blocks, temp files, state, secrets); a umask
#: can only clear bits of it, so a file created with it is never readable by others
FILE_MODE = 0o600
#: mode of every directory kvtier creates
DIR_MODE = 0o700


def make_private_dirs(path: str | os.PathLike) -> None:
    """Create ``path`` and any missing parents, each 0700; existing ones are left alone."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # another process made it first: theirs to set up
        _chmod_new_dir(directory)  # mkdir's mode went through the umask


def _chmod_new_dir(directory: str) -> None:
    """``chmod 0700`` the directory just made at ``directory``, never through a symbolic link: in
    a parent others may write to, the new directory could be renamed away and a link planted in
    its place before the chmod, which would then open up the link's target instead."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except PermissionError:
        # a umask that took the owner's read bit: a path descriptor, changed through /proc
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.chmod(f"/proc/self/fd/{fd}", DIR_MODE)
        finally:
            os.close(fd)
        return
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames and unlinks done in directory ``path`` survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_private_file(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` at once: readers see the old file or the new, whole.

    The bytes go to a new 0600 temp file beside it (:func:`_written_temp`), renamed over ``path``.
    If anything fails the temp file is removed (it may hold secrets); a crash before the rename
    leaves it for the owner to sweep. The caller syncs the directory (:func:`fsync_dir`) when the
    rename must survive a crash."""
    tmp = _written_temp(path, data)
    try:
        os.rename(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def create_private_file(path: str | os.PathLike, data: bytes) -> bool:
    """Create ``path`` holding ``data``, whole, unless something is there already; returns whether
    it did. Unlike ``O_CREAT|O_EXCL`` then a write, no crash or full disk ever leaves ``path``
    empty or cut short: the bytes go to a temp file beside it (:func:`_written_temp`), which is
    hard-linked into place (the link fails where another creator won) and then removed. The
    directory is synced: a file created is there after a power cut."""
    tmp = _written_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        _unlink_quietly(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return True


def _written_temp(path: str | os.PathLike, data: bytes) -> str:
    """A new 0600 file beside ``path``, ``<stem>.tmp<pid>.<random>``, holding ``data`` whole and
    fsync'd (a write the disk cuts short raises, ENOSPC); returns its name. The name is
    unpredictable and opened with ``O_EXCL|O_NOFOLLOW``: a file or link planted there is never
    written through. If anything fails it is removed (it may hold secrets)."""
    stem = os.path.splitext(os.fspath(path))[0]
    tmp = f"{stem}.tmp{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:  # (a buffered write loops over short writes)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_private_file(path: str, what: str, fix: str, why: str = "it authenticates blocks") -> int:
    """A read-only descriptor of the secret at ``path`` (``what`` names it in errors, ``why`` says
    what it guards), refused unless it is a regular file owned by this user that nobody else may
    read or write, and never through a symbolic link. ``fix``: what the error tells the operator
    to do besides ``chmod 600``. The caller closes the descriptor."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer, before the check below
        # could refuse it
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path!r} ({exc}); {fix}") from None
    return _checked_private(fd, path, what, fix, why)


def open_private_log(path: str, what: str, fix: str, why: str) -> int:
    """A write-only, append-mode descriptor of the log at ``path`` (``what`` names it in errors,
    ``why`` says what its lines reveal), created 0600 if absent. One that exists is refused
    (:class:`ConfigError`) as :func:`open_private_file` refuses a secret -- unless it is a regular
    file owned by this user that nobody else may read or write -- and is never opened through a
    symbolic link: lines appended to a 0644 file, or to wherever a link planted there leads, are
    every local user's. ``fix``: what the error tells the operator to do besides ``chmod 600``.
    A path that cannot be opened at all (no such directory: a typo is not made into one) raises
    OSError as ``os.open`` does. The caller closes the descriptor."""
    try:
        # O_NONBLOCK: a FIFO with no reader fails to open (ENXIO) instead of waiting for one
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     FILE_MODE)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symbolic link; a FIFO or socket with no reader
            raise _not_private(path, what, fix, why) from None
        raise
    return _checked_private(fd, path, what, fix, why)


def _checked_private(fd: int, path: str, what: str, fix: str, why: str) -> int:
    """``fd``, made blocking, if it is a regular file owned by this user that nobody else may read
    or write; else closed, and :func:`_not_private` raised."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise _not_private(path, what, fix, why)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_private(path: str, what: str, fix: str, why: str) -> ConfigError:
    return ConfigError(f"{what} {path!r} must be a regular file owned by this user with mode 0600 ({why}); "
                       f"fix it with chmod 600 {path}, or {fix}")


def refuse_readable_secrets(fd: int, path: str, secrets: list[str], fix: str) -> None:
    """Refuse the configuration file open at ``fd`` (read from ``path``) if it holds secret settings
    (``secrets``: their names; none, nothing to refuse) and another user owns it or anyone but its
    owner may read or write it: a secret in a 0644 file is every local user's. ``fix``: where
    else the secrets may go. Unlike :func:`open_private_file`, a link to the file or a pipe
    (``--config <(…)``) is taken: the file opened is the one judged."""
    if not secrets:
        return
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        who = "another user owns it" if st.st_uid != os.getuid() else f"its mode is {stat.S_IMODE(st.st_mode):04o}"
        raise ConfigError(f"config file {path!r} holds {', '.join(sorted(secrets))} but {who}: it must be this "
                          f"user's with mode 0600 (whoever reads it holds the secrets); fix it with chmod 600 {path} "
                          f"(and chown, if another user owns it), or {fix}")


#: the most :func:`read_private_file` reads: a secret is bytes (32 for the spill secret), and a
#: path pointed at a large file by mistake is refused before it is read into memory
MAX_SECRET_BYTES = 1 << 16


def read_private_file(path: str, what: str, fix: str, why: str = "it authenticates blocks") -> bytes:
    """The bytes of the secret at ``path`` (``what`` names it in errors), refused unless it is a
    regular file owned by this user that nobody else may read or write, of at most
    :data:`MAX_SECRET_BYTES`, and never through a symbolic link: whoever reads it can name, read
    or forge the blocks it keys. ``fix``: what the error tells the operator to do besides
    ``chmod 600``; ``why``: what the secret guards, as the error says it."""
    fd = open_private_file(path, what, fix, why)
    try:
        chunks = []
        size = 0
        # bounded by what is read, not by fstat's size: the file may grow while it is read
        while size <= MAX_SECRET_BYTES and (chunk := os.read(fd, MAX_SECRET_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_SECRET_BYTES:
            raise ConfigError(f"{what} {path!r} is larger than {MAX_SECRET_BYTES} bytes: not a secret; {fix}")
        return b"".join(chunks)
    finally:
        os.close(fd)
