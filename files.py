"""File helpers: gzip-aware reading and all-or-nothing writing (temporary file, then rename)."""

from __future__ import annotations

import gzip
import json
import os
import secrets
import zlib
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.limits import MAX_INPUT_BYTES, LimitError
from memplan.units import MiB, human_bytes

READ_CHUNK = 16 * MiB  # bytes read at a time, so a file past its limit is never held whole
TEMPORARY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)  # a new file, never another's


class OutputError(MemplanError):
    """An output file cannot be written (no such folder, no permission, disk full)."""


def read_bytes(path: str | os.PathLike, limit: int = MAX_INPUT_BYTES) -> bytes:
    """Return the file's bytes, decompressed when the name ends in .gz, reading at most `limit` bytes (LimitError
    past it: a gzip bomb or /dev/zero stops there); a damaged gzip stream raises gzip.BadGzipFile (an OSError,
    like every other unreadable file)."""
    path = Path(path)
    zipped = path.suffix == ".gz"
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if zipped else raw
        try:
            data = _read_at_most(stream, limit)
        except (EOFError, zlib.error) as e:
            raise gzip.BadGzipFile(f"truncated or corrupt gzip data: {e}") from None
    if data is None:
        what = "decompresses to" if zipped else "holds"
        raise LimitError(f"{path}: {what} more than {human_bytes(limit)}, the most memplan reads (limits.py)")
    return data


def read_input(path: str | os.PathLike, error: type[MemplanError], limit: int = MAX_INPUT_BYTES) -> bytes:
    """`read_bytes` of an input file, its faults one line of `error` naming the file: no such file, or cannot read."""
    name = os.fspath(path)
    try:
        return read_bytes(path, limit)
    except FileNotFoundError:
        raise error(f"{name}: no such file") from None
    except OSError as e:
        raise error(f"{name}: cannot read ({e.strerror or e})") from None


def read_json(path: str | os.PathLike, error: type[MemplanError]) -> Any:
    """The JSON document of an input file (`read_input`, then `decode_json`), its faults one line of `error`."""
    raw = read_input(path, error)
    try:
        return decode_json(raw)
    except ValueError as e:
        raise error(f"{os.fspath(path)}: {e}") from None


def _read_at_most(stream, limit: int) -> bytearray | None:
    """The stream's bytes to its end (a bytearray: no second copy of a big file), or None once more than `limit`
    bytes came."""
    data = bytearray()
    while True:
        chunk = stream.read(min(READ_CHUNK, limit + 1 - len(data)))
        if not chunk:
            return data
        data += chunk
        if len(data) > limit:
            return None


def decode_json(raw: bytes | bytearray) -> Any:
    """The JSON document in `raw`; ValueError with a one-line reason for bytes that are not JSON, a NaN or Infinity
    (not JSON, and no figure memplan reads may be one), a number of thousands of digits, or nesting deeper than
    Python's decoder goes."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON at line {e.lineno} column {e.colno} (truncated?)") from None
    except UnicodeDecodeError:
        raise ValueError("not valid JSON (not UTF-8 text)") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
    except ValueError as e:  # Python's cap on the digits of an integer, or a constant refused
        reason = str(e) if isinstance(e, _ConstantError) else "a number with more digits than Python reads"
        raise ValueError(f"not valid JSON ({reason})") from None


class _ConstantError(ValueError):
    """NaN, Infinity or -Infinity in a JSON document."""


def _refuse_constant(name: str):
    raise _ConstantError(f"{name} is not a number JSON allows")


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (gzipped when the name ends in .gz) so that `path` is complete or absent; OutputError names the
    file when it cannot be written. Whatever stops the write (an error, Ctrl-C's KeyboardInterrupt, the CLI's
    SIGTERM) removes the hidden temporary file it was writing: its name is known before it is created."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=6, mtime=0)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = None
        while fd is None:
            tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"  # named before it exists: always removable
            try:
                fd = os.open(tmp, TEMPORARY_FLAGS, 0o666)  # the mode open() gives a new file (less the umask)
            except FileExistsError:
                tmp = None  # another file's name: not ours to remove
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{path}: cannot write ({e.strerror or e})") from None
        raise
