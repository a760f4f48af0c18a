"""A file written whole or not at all: what a program's outputs (bundles, traces, tables as JSON,
configs) are written with, so that a run stopped halfway (Ctrl-C, a failed peer) leaves the
previous file or none, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["write_whole", "whole_file"]


@contextlib.contextmanager
def whole_file(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path in ``path``'s folder for the block to write (``with whole_file(p) as tmp:
    prof.export_chrome_trace(str(tmp))``), renamed to ``path`` when the block ends: a reader sees
    the old file or the new one. On any exception, Ctrl-C included, the temporary file is removed
    and ``path`` is left as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would have made it, not mkstemp's 0o600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_whole(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through :func:`whole_file`; return
    ``path`` as a :class:`~pathlib.Path`."""
    with whole_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def _umask() -> int:
    """The process's umask (read by setting it, then put back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
