"""File helpers: gzip-aware reading and all-or-nothing writing (temporary file, then rename)."""
from __future__ import annotations

import gzip
import os
import tempfile
from pathlib import Path


def read_bytes(path: str | os.PathLike) -> bytes:
    """Return the file's bytes, decompressed when the name ends in .gz."""
    path = Path(path)
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (gzipped when the name ends in .gz) so that `path` is complete or absent."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=6, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
