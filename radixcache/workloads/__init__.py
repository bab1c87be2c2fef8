"""Workloads and the serving loop shared by the ``radixcache`` command and the benchmarks.

- ``Request``: one prompt and its output (given tokens, or a length the loop fills with fresh ids).
- ``synthetic_chat``: a deterministic multi-turn chat workload (shared system prompts).
- ``exercise_ops``: a stream of insert/exists calls with long shared prefixes (a shallow tree).
- ``deep_exercise_ops``: the same calls over prefixes of random length of shared bases (a
  tree about 100 nodes deep).
- ``time_cached_calls``: the in-cache cost of ``match_prefix`` + ``insert`` per request with
  every prompt cached, split into the core's bare tree walk and the rest, per input type.
- ``walk_cost``: time of ``exists`` per node visited on a built tree.
- ``KVPool`` and ``serve``: a KV pool of token slots and the serving loop that replays requests
  against a cache the way an inference server does (match, lock, evict, insert, unlock).
- ``HostPool``: a host-memory pool of token slots for a cache with a host tier; ``serve`` and
  ``ServingLoop`` back evicted prefixes up into it and load host hits back
  (``host_capacity=``).

Token ids of prompts must lie in ``[0, FRESH_TOKEN_BASE)``: ``serve`` numbers the fresh output
tokens it generates from ``FRESH_TOKEN_BASE`` up, so they never equal a prompt token.

The names live in submodules, imported here: ``requests`` (``Request``), ``generators``,
``timing``, ``pools`` and ``serving`` (the loop).
"""

# In the order the API reference lists them.
from .requests import FRESH_TOKEN_BASE, Request
from .generators import synthetic_chat, exercise_ops, deep_exercise_ops
from .timing import INPUT_TYPES, as_input_type, InCacheTiming, time_cached_calls, walk_cost
from .pools import KVPool, HostPool
from .serving import ServeResult, Admission, ServingLoop, serve

__all__ = [
    "FRESH_TOKEN_BASE",
    "Admission",
    "HostPool",
    "KVPool",
    "Request",
    "ServeResult",
    "INPUT_TYPES",
    "InCacheTiming",
    "ServingLoop",
    "as_input_type",
    "deep_exercise_ops",
    "exercise_ops",
    "time_cached_calls",
    "walk_cost",
    "serve",
    "synthetic_chat",
]
