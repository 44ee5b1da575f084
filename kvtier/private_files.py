"""Files and directories only their owner can open: 0600 and 0700, whatever the umask.

Blocks on disk are prompts in another form, so what kvtier creates is private
by default. A mode given to ``open``/``mkdir`` is filtered by the process umask,
and ``os.makedirs`` creates intermediate directories with the umask's default
(0755 under the usual 022); so every directory created here is ``chmod``'d to
0700 explicitly. Directories that already exist are left as they are: their
mode is their owner's choice (a shared mount an operator set up, say).
"""

from __future__ import annotations

import os

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
        os.chmod(directory, DIR_MODE)  # mkdir's mode went through the umask

