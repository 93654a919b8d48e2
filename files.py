"""File helpers: gzip-aware reading and all-or-nothing writing (temporary file, then rename)."""

from __future__ import annotations

import gzip
import os
import tempfile
import zlib
from pathlib import Path

from memplan.errors import MemplanError


class OutputError(MemplanError):
    """An output file cannot be written (no such folder, no permission, disk full)."""


def read_bytes(path: str | os.PathLike) -> bytes:
    """Return the file's bytes, decompressed when the name ends in .gz; a damaged gzip stream raises
    gzip.BadGzipFile (an OSError, like every other unreadable file)."""
    path = Path(path)
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (EOFError, zlib.error) as e:
            raise gzip.BadGzipFile(f"truncated or corrupt gzip data: {e}") from None
    return data


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (gzipped when the name ends in .gz) so that `path` is complete or absent;
    OutputError names the file when it cannot be written."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=6, mtime=0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OutputError(f"{path}: cannot write ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{path}: cannot write ({e.strerror or e})") from None
        raise


def _umask() -> int:
    """The process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
