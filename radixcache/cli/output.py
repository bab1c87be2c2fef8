"""What the command writes: tables, progress bars, warnings, and files written atomically
(JSON rows; the plots write through ``atomic_write`` too)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

from .errors import UsageError


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(temp_path)`` then move the file onto ``path``: never a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                     suffix=".tmp")
    os.close(fd)
    try:
        write(temp_path)
        # mkstemp makes the file private (0600); give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp_path, 0o666 & ~umask)
        os.replace(temp_path, path)
    except BaseException:
        try:
            os.unlink(temp_path)
        except OSError:
            pass
        raise


def check_output_path(path: str | None, option: str) -> None:
    """Fail before a long replay when an output file could never be written."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{option}: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{option}: {path!r} is a directory")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{option}: directory {directory!r} is not writable")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 left: Sequence[int] = ()) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def progress_bar(quiet: bool, **options: Any) -> Any:
    """A tqdm bar on stderr (``options`` go to ``tqdm``), or None when quiet, not a terminal,
    or tqdm is missing."""
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm  # only needed on a terminal
    except ImportError:
        return None
    return tqdm(file=sys.stderr, leave=False, **options)


def write_json(path: str, rows: list[dict]) -> None:
    """The rows as indented JSON, written atomically."""

    def write(temp_path: str) -> None:
        with open(temp_path, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
            out.write("\n")

    atomic_write(path, write)


def short_count(n: int) -> str:
    """1536 -> '1.5k', 4194304 -> '4.19M' (powers of 1000, up to 3 significant digits)."""
    for factor, unit in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= factor:
            return f"{n / factor:.3g}{unit}"
    return str(n)


def warn(message: str) -> None:
    """One warning line on stderr."""
    print(f"radixcache: warning: {message}", file=sys.stderr)
