"""More host memory never lowers the simulator's hit rate.

The serving loop (``radixcache.workloads.serve``) over a small grid of host capacities, for
every write policy, on both cores: on the embedded chat workload and on the start of the
Mooncake conversation trace (skipped without it). The prompt tokens found in the cache
(device and host) must never decrease as the host grows, and the host tier never changes
which device entries are evicted first, so it can only add hits.
"""

from __future__ import annotations

import pytest
from conftest import mooncake_trace

from radixcache import RadixCache
from radixcache.traces import read_trace
from radixcache.workloads import serve, synthetic_chat

POLICIES = ("write_back", "write_through", "write_through_selective")
CONVERSATION, CONVERSATION_MISSING = mooncake_trace("conversation")


def cached_tokens(core_name, requests, device, host, policy, page_size):
    cache = RadixCache(core=core_name, page_size=page_size, host_tier=True,
                       write_policy=policy)
    return serve(cache, requests, device, host_capacity=host).cached_tokens


def check_monotone(core_name, requests, device, hosts, page_size=1):
    one_tier = serve(RadixCache(core=core_name, page_size=page_size), requests,
                     device).cached_tokens
    for policy in POLICIES:
        hits = [cached_tokens(core_name, requests, device, host, policy, page_size)
                for host in hosts]
        assert hits[0] == one_tier, policy  # host 0: the one-tier loop
        assert hits == sorted(hits), (policy, list(zip(hosts, hits)))
    return hits


def test_embedded_workload(core_name):
    hits = check_monotone(core_name, synthetic_chat(), 16384,
                          (0, 2048, 4096, 8192, 16384, 65536))
    assert hits[-1] > hits[0]  # the host adds hits at all


@pytest.mark.skipif(CONVERSATION is None, reason=CONVERSATION_MISSING or "no trace")
def test_mooncake_conversation_trace(core_name):
    requests = read_trace(CONVERSATION, limit=3000)
    check_monotone(core_name, requests, 250_000, (0, 16_000, 32_000, 128_000, 1_000_000),
                   page_size=16)
