"""``radixcache trace download`` against a local HTTP server (no test reaches the internet)."""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
from pathlib import Path

import pytest

from radixcache import download
from radixcache.cli import main
from conftest import TRACE_DIRS

#: Downloads only: no tree core runs, so the pure-core CI run leaves these out.
pytestmark = pytest.mark.core_independent

LINE = b'{"timestamp": %d, "input_length": 600, "output_length": 3, "hash_ids": [%d, %d]}\n'
BODY = b"".join(LINE % (i, i, i + 1) for i in range(50))


class Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.routes[path] = (status, body, declared length or None)``."""

    def do_GET(self):  # http.server's spelling
        self.server.hits.append(self.path)
        status, body, declared = self.server.routes.get(self.path, (404, b"not found", None))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if declared is None else declared))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture
def server(monkeypatch, tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.routes = {}
    httpd.hits = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("RADIXCACHE_TRACE_URL", f"http://127.0.0.1:{httpd.server_port}/traces/")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # A small stand-in for the published file: the real catalogue's names, this body's size
    # and checksum.
    info = download.TRACES["synthetic"]
    monkeypatch.setitem(download.TRACES, "synthetic", download.TraceInfo(
        info.name, info.remote, info.filename, 50, info.description, size=len(BODY),
        sha256=hashlib.sha256(BODY).hexdigest()))
    monkeypatch.setitem(download.TRACES, "toolagent", download.TraceInfo(
        "toolagent", "toolagent_trace.jsonl", "mooncake_toolagent_trace.jsonl", 50, "tools",
        min_size=100, max_size=100_000))
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def leftovers(directory: Path) -> list:
    return sorted(p.name for p in directory.glob(".*")) if directory.exists() else []


def test_download_success_and_already_present(server, tmp_path, capsys):
    server.routes["/traces/synthetic_trace.jsonl"] = (200, BODY, None)
    assert main(["trace", "download", "synthetic"]) == 0
    target = tmp_path / "xdg" / "radixcache" / "traces" / "mooncake_synthetic_trace.jsonl"
    out = capsys.readouterr().out
    assert out == f"{target}\n"
    assert target.read_bytes() == BODY
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert not leftovers(target.parent)
    # Again: the valid copy is kept, nothing is fetched.
    assert main(["trace", "download", "synthetic"]) == 0
    assert "already present and valid" in capsys.readouterr().out
    assert server.hits == ["/traces/synthetic_trace.jsonl"]
    # --force fetches it again.
    assert main(["trace", "download", "synthetic", "--force"]) == 0
    assert len(server.hits) == 2 and target.read_bytes() == BODY


def test_download_into_dir_and_list(server, tmp_path, capsys):
    server.routes["/traces/synthetic_trace.jsonl"] = (200, BODY, None)
    where = tmp_path / "some" / "dir"
    assert main(["trace", "download", "synthetic", "--dir", str(where), "--quiet"]) == 0
    assert (where / "mooncake_synthetic_trace.jsonl").read_bytes() == BODY
    capsys.readouterr()
    assert main(["trace", "list", "--dir", str(where)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"traces in {where}:"
    rows = {line.split()[0]: line for line in lines[3:] if line.strip()}
    assert "present" in rows["synthetic"]
    assert rows["conversation"].split()[4] == "-" and "3.0 MB" in rows["conversation"]
    # A damaged copy shows as invalid, and a download replaces it.
    (where / "mooncake_synthetic_trace.jsonl").write_bytes(BODY[:-1] + b"X")
    assert download.verify("synthetic", where).startswith("sha256 ")
    assert main(["trace", "download", "synthetic", "--dir", str(where)]) == 0
    assert (where / "mooncake_synthetic_trace.jsonl").read_bytes() == BODY


@pytest.mark.parametrize("route, message", [
    ((200, BODY[:-2] + b"]}", None), "does not match the published trace (sha256 "),
    ((200, BODY[:100], None), f"does not match the published trace (100 bytes, expected "
                              f"{len(BODY):,})"),
    ((200, BODY[:100], len(BODY)), f"connection closed after 100 of {len(BODY):,} bytes"),
    ((404, b"no", None), "HTTP 404"),
    ((500, b"oops", None), "HTTP 500"),
])
def test_download_failures_leave_nothing(server, tmp_path, capsys, route, message):
    server.routes["/traces/synthetic_trace.jsonl"] = route
    where = tmp_path / "d"
    assert main(["trace", "download", "synthetic", "--dir", str(where)]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("radixcache: error: ")
    assert message in err
    assert not (where / "mooncake_synthetic_trace.jsonl").exists()
    assert not leftovers(where)


@pytest.mark.parametrize("depth", [1, 3])
def test_failed_download_removes_the_directories_it_made(server, tmp_path, capsys, depth):
    server.routes["/traces/synthetic_trace.jsonl"] = (404, b"no", None)
    where = tmp_path.joinpath(*[f"new{i}" for i in range(depth)])
    assert main(["trace", "download", "synthetic", "--dir", str(where)]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # every directory it made is gone, tmp_path stays
    # The default directory too (made under XDG_CACHE_HOME), but not XDG_CACHE_HOME itself.
    (tmp_path / "xdg").mkdir()
    with pytest.raises(download.DownloadError, match="HTTP 404"):
        download.download("synthetic")
    assert not list((tmp_path / "xdg").iterdir())


def test_failed_download_keeps_directories_that_were_there_or_got_files(server, tmp_path,
                                                                         monkeypatch):
    server.routes["/traces/synthetic_trace.jsonl"] = (404, b"no", None)
    (tmp_path / "old").mkdir()
    with pytest.raises(download.DownloadError):
        download.download("synthetic", tmp_path / "old")
    assert (tmp_path / "old").is_dir()
    # A file someone else writes into a made directory while the download runs stays, and
    # so does its directory.
    fetch = download._fetch

    def fetch_while_another_writes(url, out, progress):
        (tmp_path / "new" / "theirs.txt").write_text("keep")
        fetch(url, out, progress)

    monkeypatch.setattr(download, "_fetch", fetch_while_another_writes)
    with pytest.raises(download.DownloadError):
        download.download("synthetic", tmp_path / "new" / "deeper")
    assert (tmp_path / "new" / "theirs.txt").read_text() == "keep"
    assert not (tmp_path / "new" / "deeper").exists()


def test_failed_download_keeps_the_existing_file(server, tmp_path):
    where = tmp_path / "d"
    where.mkdir()
    damaged = where / "mooncake_synthetic_trace.jsonl"
    damaged.write_bytes(b"old")
    server.routes["/traces/synthetic_trace.jsonl"] = (404, b"no", None)
    with pytest.raises(download.DownloadError, match="HTTP 404"):
        download.download("synthetic", where)
    assert damaged.read_bytes() == b"old" and not leftovers(where)


def test_unreachable_server(monkeypatch, tmp_path, capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("RADIXCACHE_TRACE_URL", f"http://127.0.0.1:{port}")
    assert main(["trace", "download", "conversation", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("radixcache: error: cannot reach http://127.0.0.1:") and len(
        err.splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_trace_without_a_recorded_checksum(server, tmp_path, capsys):
    server.routes["/traces/toolagent_trace.jsonl"] = (200, BODY, None)
    assert main(["trace", "download", "toolagent", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{tmp_path / 'mooncake_toolagent_trace.jsonl'}\n"
    assert f"sha256: {hashlib.sha256(BODY).hexdigest()}" in captured.err
    # Not a trace at all, or far from the expected size: refused.
    for body, message in ((b"<html>" + b"x" * 200, "does not look like a Mooncake trace"),
                          (BODY[:50], "50 bytes, expected 100 to 100,000")):
        server.routes["/traces/toolagent_trace.jsonl"] = (200, body, None)
        with pytest.raises(download.DownloadError, match=message):
            download.download("toolagent", tmp_path / "other")


def test_default_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert download.default_dir() == tmp_path / "radixcache" / "traces"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert download.default_dir() == tmp_path / "home" / ".cache" / "radixcache" / "traces"
    with pytest.raises(ValueError, match="unknown trace 'nope'; known: conversation"):
        download.trace_path("nope")


def test_catalogue_matches_the_shared_copies():
    # The recorded sizes and checksums were taken from these copies of the published files.
    present = [(name, folder) for folder in TRACE_DIRS for name in ("conversation", "synthetic")
               if (folder / download.TRACES[name].filename).is_file()]
    if not present:
        pytest.skip(f"no trace copies in RADIXCACHE_TRACE_DIR ({list(map(str, TRACE_DIRS))})")
    for name, folder in present:
        assert download.verify(name, folder) is None


def test_find_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path, why = download.find("synthetic", tmp_path / "shared")
    assert path is None
    assert why == ("Mooncake synthetic trace not found (looked for "
                   f"mooncake_synthetic_trace.jsonl in {tmp_path / 'shared'}, "
                   f"{tmp_path / 'xdg' / 'radixcache' / 'traces'}); get it with: "
                   "radixcache trace download synthetic")
    # The download directory counts too.
    target = download.trace_path("synthetic")
    target.parent.mkdir(parents=True)
    target.write_bytes(BODY)
    assert download.find("synthetic", tmp_path / "shared") == (target, "")
