"""Fetch the public Mooncake FAST'25 request traces (``radixcache trace download NAME``).

The traces are published by the Mooncake project (Apache-2.0) in the ``FAST25-release/traces``
directory of https://github.com/kvcache-ai/Mooncake. A download goes to a temporary file in
the target directory, is checked (size and sha256 where known) and only then renamed into
place, so a failed or interrupted download never leaves a file that looks complete.

Standard library only (``urllib``); ``RADIXCACHE_TRACE_URL`` replaces the base URL (a mirror,
or a local server in tests).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

__all__ = ["TRACES", "DownloadError", "TraceInfo", "default_dir", "download", "trace_path",
           "verify"]

#: Where the traces are published (``RADIXCACHE_TRACE_URL`` overrides it).
BASE_URL = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces"
_CHUNK = 1 << 16
_TIMEOUT_S = 60


@dataclass(frozen=True)
class TraceInfo:
    """One downloadable trace: its ``name``, the published ``remote`` file name, the local
    ``filename``, and its expected ``size`` (bytes) and ``sha256`` -- None where they were not
    known when this release was made (then only a size range is checked: ``min_size`` to
    ``max_size``)."""

    name: str
    remote: str
    filename: str
    requests: int
    description: str
    size: Optional[int] = None
    sha256: Optional[str] = None
    min_size: int = 0
    max_size: int = 1 << 30


#: The traces ``radixcache trace download`` knows, by name.
TRACES = {
    "conversation": TraceInfo(
        "conversation", "conversation_trace.jsonl", "mooncake_conversation_trace.jsonl",
        12031, "Mooncake FAST'25 conversation workload",
        size=3029533,
        sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"),
    "synthetic": TraceInfo(
        "synthetic", "synthetic_trace.jsonl", "mooncake_synthetic_trace.jsonl",
        3993, "Mooncake FAST'25 synthetic workload",
        size=1136313,
        sha256="bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"),
    # Exact size not recorded: checked by its published sha256 and a size range.
    "toolagent": TraceInfo(
        "toolagent", "toolagent_trace.jsonl", "mooncake_toolagent_trace.jsonl",
        23608, "Mooncake FAST'25 tool-and-agent workload",
        sha256="48a2db1a13d3bc05e6330140c64f604ba366df20d3c9e128b5c35a01c1fa5f71",
        min_size=1 << 20, max_size=64 << 20),
}


class DownloadError(Exception):
    """A download that failed: network, HTTP status, size or checksum (one-line message)."""


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/radixcache/traces``, or ``~/.cache/radixcache/traces``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixcache" / "traces"


def base_url() -> str:
    """The URL the trace files are fetched from (``RADIXCACHE_TRACE_URL`` or ``BASE_URL``)."""
    return (os.environ.get("RADIXCACHE_TRACE_URL") or BASE_URL).rstrip("/")


def trace_path(name: str, directory: str | os.PathLike | None = None) -> Path:
    """Where trace ``name`` lives (or would) in ``directory`` (default ``default_dir()``)."""
    info = _info(name)
    return Path(default_dir() if directory is None else directory) / info.filename


def _info(name: str) -> TraceInfo:
    try:
        return TRACES[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}") from None


def _sha256(path: Path) -> str:
    import hashlib  # the command's start-up does not need it

    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _problem(info: TraceInfo, path: Path) -> Optional[str]:
    """Why the file at ``path`` is not a good copy of ``info`` (None: it is)."""
    size = path.stat().st_size
    if info.size is not None:
        if size != info.size:
            return f"{size:,} bytes, expected {info.size:,}"
    elif not info.min_size <= size <= info.max_size:
        return (f"{size:,} bytes, expected {info.min_size:,} to {info.max_size:,} "
                "for this trace")
    if info.sha256 is not None:
        actual = _sha256(path)
        if actual != info.sha256:
            return f"sha256 {actual}, expected {info.sha256}"
    else:
        with open(path, "rb") as stream:
            first = stream.readline(1 << 20)
        if not (first.startswith(b"{") and b'"hash_ids"' in first):
            return "it does not look like a Mooncake trace (JSON lines with hash_ids)"
    return None


def verify(name: str, directory: str | os.PathLike | None = None) -> Optional[str]:
    """None when trace ``name`` is present in ``directory`` and checks out; otherwise why
    not (``"not downloaded"`` or the mismatch)."""
    path = trace_path(name, directory)
    if not path.is_file():
        return "not downloaded"
    return _problem(_info(name), path)


def download(name: str, directory: str | os.PathLike | None = None, *, force: bool = False,
             progress: Callable[[int, Optional[int]], None] | None = None) -> tuple[Path, bool]:
    """Fetch trace ``name`` into ``directory`` (default ``default_dir()``, created if needed).

    Returns ``(path, fetched)``: ``fetched`` is False when a valid copy was there already
    (``force`` fetches it again). ``progress(bytes_so_far, total_or_None)`` is called as the
    data arrives. Raises ``ValueError`` for an unknown name and ``DownloadError`` for a
    network failure, an HTTP error, or a file whose size or sha256 is not the published one;
    then nothing is left behind (nor the directories it made) and an existing file is
    untouched.
    """
    info = _info(name)
    path = trace_path(name, directory)
    if not force and path.is_file() and _problem(info, path) is None:
        return path, False
    created = _missing_dirs(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_dirs(created)
        raise DownloadError(f"cannot create {str(path.parent)!r}: {exc.strerror or exc}") from None
    url = f"{base_url()}/{info.remote}"
    try:
        fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{info.filename}.",
                                         suffix=".part")
    except BaseException:
        _remove_dirs(created)
        raise
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            _fetch(url, out, progress)
        problem = _problem(info, temp)
        if problem is not None:
            raise DownloadError(f"{url}: the download does not match the published trace "
                                f"({problem}); nothing was saved")
        umask = os.umask(0)  # mkstemp makes the file private; give it a plain file's mode
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)
        os.replace(temp, path)
    except BaseException:
        try:
            temp.unlink()
        except OSError:
            pass
        _remove_dirs(created)
        raise
    return path, True


def _missing_dirs(directory: Path) -> list[Path]:
    """``directory`` and those above it that do not exist yet, the topmost first."""
    missing = []
    while not directory.exists() and directory.parent != directory:
        missing.append(directory)
        directory = directory.parent
    return missing[::-1]


def _remove_dirs(created: list[Path]) -> None:
    """Remove the directories a failed download made (the deepest first), each only while
    it is empty: what anyone else put there stays."""
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            return


def _fetch(url: str, out, progress) -> None:
    """Stream ``url`` into ``out``; DownloadError (one line) for any failure."""
    # Imported here: the command's start-up (which names the traces) does not need them.
    import http.client
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"User-Agent": "radixcache"})
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            while True:
                try:
                    chunk = response.read(_CHUNK)
                except http.client.IncompleteRead as exc:  # some versions raise, some return
                    done += len(exc.partial)
                    chunk = b""
                if not chunk:
                    break
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
            if total is not None and done != total:
                raise DownloadError(f"{url}: connection closed after {done:,} of {total:,} "
                                    "bytes; nothing was saved")
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise DownloadError(f"cannot reach {url}: {exc.reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # timeouts, resets,
        # a body cut short
        raise DownloadError(f"{url}: download failed: {exc}") from None


def find(name: str, *directories: str | os.PathLike) -> tuple[Optional[Path], str]:
    """Trace ``name`` in the first of ``directories`` (then the download directory) that
    holds it: ``(path, "")``, or ``(None, why)`` with a message that says where it looked and
    how to get it (for tests and benchmarks that skip without it)."""
    info = _info(name)
    places = [Path(d) for d in directories] + [default_dir()]
    for place in places:
        candidate = place / info.filename
        if candidate.is_file():
            return candidate, ""
    return None, (f"Mooncake {name} trace not found (looked for {info.filename} in "
                  + ", ".join(str(p) for p in places)
                  + f"); get it with: radixcache trace download {name}")
