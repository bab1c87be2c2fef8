"""The picker's command line: endpoint specs and their errors, parsed without gRPC."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radixcache.picker.args import parse_args, parse_endpoint, read_endpoints_file
from radixcache.picker.local_index import EndpointSpec

pytestmark = pytest.mark.core_independent


def test_endpoint_specs_and_their_errors(tmp_path):
    assert parse_endpoint("10.0.0.1:8000=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558") == \
        EndpointSpec("10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    assert parse_endpoint("[::1]:8000=tcp://h:1").replay is None
    for bad, words in (("10.0.0.1:8000", "ip:port=tcp://"), ("10.0.0.1=tcp://h:1", "ip:port"),
                       ("::1:80=tcp://h:1", "[ip]:port"), ("h:99999=tcp://h:1", "ip:port"),
                       ("h:80=h:1", "ZeroMQ address")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_endpoint(bad)
    path = tmp_path / "endpoints.json"
    path.write_text(json.dumps([{"endpoint": "10.0.0.1:8000", "events": "tcp://a:1",
                                 "replay_endpoint": "tcp://a:2"}]))
    assert read_endpoints_file(str(path)) == [EndpointSpec("10.0.0.1:8000", "tcp://a:1",
                                                           "tcp://a:2")]
    path.write_text(json.dumps([{"endpoint": "10.0.0.1:8000"}]))
    with pytest.raises(ValueError, match="entry 0: 'events'"):
        read_endpoints_file(str(path))


def test_parse_args_checks_the_pool():
    spec = "127.0.0.1:1=tcp://127.0.0.1:2,tcp://127.0.0.1:3"
    args = parse_args(["--tokenizer", "d", "--endpoint", spec, "--max-endpoints", "2"])
    assert args.endpoints == [parse_endpoint(spec)] and args.max_endpoints == 2
    for argv, words in ((["--tokenizer", "d"], "--endpoint"),
                        (["--tokenizer", "d", "--endpoint", spec, "--endpoint", spec], "twice"),
                        (["--tokenizer", "d", "--endpoint", spec, "--shed-load", "5"],
                         "--sheddable"),
                        (["--tokenizer", "d", "--endpoint", "x"], "ip:port=")):
        done = subprocess.run([sys.executable, "-m", "radixcache.picker", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr, done.stderr
