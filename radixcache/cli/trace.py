"""``radixcache trace``: list the public Mooncake traces and download them (checked against
their published size and sha256)."""

from __future__ import annotations

import argparse
import sys

from .output import format_table, progress_bar


def _download_progress(name: str, quiet: bool):
    """A bar for a download and the ``progress`` callback that moves it (None, None when
    quiet, not a terminal, or tqdm is missing)."""
    bar = progress_bar(quiet, desc=name, unit="B", unit_scale=True)
    if bar is None:
        return None, None

    def update(done: int, total: int | None) -> None:
        if total is not None and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    return bar, update


def run(args: argparse.Namespace) -> int:
    """``radixcache trace list`` and ``radixcache trace download NAME``."""
    from .. import download  # standard library only

    directory = args.dir
    if args.trace_command == "list":
        where = download.default_dir() if directory is None else directory
        print(f"traces in {where}:")
        rows = []
        for name, info in download.TRACES.items():
            problem = download.verify(name, directory)
            state = "present" if problem is None else (
                "-" if problem == "not downloaded" else f"invalid: {problem}")
            size = f"{info.size / 1e6:.1f} MB" if info.size else "a few MB"
            rows.append([name, f"{info.requests:,}", size, state, info.description])
        print(format_table(["name", "requests", "size", "here", "description"], rows,
                            left=(0, 3, 4)))
        print("get one with: radixcache trace download NAME")
        return 0
    info = download.TRACES[args.name]
    bar, progress = _download_progress(args.name, args.quiet)
    try:
        path, fetched = download.download(args.name, directory, force=args.force,
                                          progress=progress)
    except download.DownloadError as exc:
        print(f"radixcache: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    if not fetched:
        print(f"{path} (already present and valid)")
    else:
        if info.sha256 is None:
            print(f"note: no published checksum for the {args.name} trace is recorded; its "
                  f"size and format were checked. sha256: {download._sha256(path)}",
                  file=sys.stderr)
        print(path)
    return 0
