"""Which instance a request should go to (``/select``, the Endpoint Picker's ranking), and
the load: each instance's tokens of work started and not yet ended, as placements and the
gateway (``/load``) report it.

``cache-aware`` scores an instance as ``Router``'s cache-aware policy scores a worker:
``prefill_weight * (prompt tokens - cached tokens) + load_weight * load``, the lowest
winning (ties: lower load, then fewer requests sent there, then the instance id); an
instance's cached tokens are its device hit plus ``host_weight`` of each further token it
reaches through its host tier (the query's ``CPU`` figure beyond ``GPU``). ``rank`` orders
every candidate so (the first is the choice, the others its fallbacks, best first).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

from .config import SELECT_POLICIES


@dataclass
class Selection:
    """A selection: the instance, its best rank, what it has cached of the prompt (tokens)
    and the policy that chose it."""

    instance_id: Any
    dp_rank: int
    overlap_tokens: int
    cached_tokens: float
    policy: str
    load: int
    #: every candidate, best first (the first is ``instance_id``)
    ranked: tuple = ()
    #: the device tokens each ranked instance is credited with (its hit in the index, or
    #: what placements not yet confirmed by its events credit it, if more)
    ranked_tokens: tuple = ()
    #: the load this request added to ``instance_id`` (0 without a request id)
    added_load: int = 0
    #: the lowest load among the candidates before this request
    least_load: int = 0


class Loads:
    """Each instance's load in tokens, and the requests that make it up. Not thread-safe
    (the service's lock guards it)."""

    MAX_REQUESTS = 1_000_000

    def __init__(self) -> None:
        self.tokens: dict = {}  # instance id -> tokens started, not ended
        self.routed: dict = {}  # instance id -> requests sent there
        self._requests: dict = {}  # request id -> (instance id, tokens)

    def start(self, request_id: str, instance: Any, tokens: int) -> None:
        """Count ``tokens`` of work on ``instance`` until ``end(request_id)``.

        Raises:
            ValueError: ``request_id`` is already running, or too many are.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if len(self._requests) >= self.MAX_REQUESTS:
            raise ValueError(f"more than {self.MAX_REQUESTS} requests running: end some")
        self._requests[request_id] = (instance, tokens)
        self.tokens[instance] = self.tokens.get(instance, 0) + tokens
        self.routed[instance] = self.routed.get(instance, 0) + 1

    def end(self, request_id: str) -> Optional[tuple]:
        """The request ended: its tokens leave its instance; ``(instance, tokens)``, or None
        for an unknown request."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            instance, tokens = entry
            left = self.tokens.get(instance, 0) - tokens
            if left > 0:
                self.tokens[instance] = left
            else:
                self.tokens.pop(instance, None)
        return entry

    def move(self, request_id: Any, instance: Any) -> bool:
        """A running request's tokens move to ``instance`` (it was served elsewhere than
        where it was placed); False for an unknown request."""
        entry = self._requests.get(request_id)
        if entry is None:
            return False
        old, tokens = entry
        if old == instance:
            return True
        self.end(request_id)
        self._requests[request_id] = (instance, tokens)
        self.tokens[instance] = self.tokens.get(instance, 0) + tokens
        return True

    def forget(self, instance: Any) -> None:
        """An instance left: its requests and load go."""
        for request_id in [r for r, (i, _) in self._requests.items() if i == instance]:
            del self._requests[request_id]
        self.tokens.pop(instance, None)
        self.routed.pop(instance, None)

    def running(self) -> int:
        return len(self._requests)


class Chooser:
    """Picks among candidates by policy; holds round-robin's position and ``random``'s
    generator."""

    def __init__(self, prefill_weight: float, load_weight: float, host_weight: float,
                 seed: int = 0) -> None:
        self.prefill_weight, self.load_weight = prefill_weight, load_weight
        self.host_weight = host_weight
        self._rng = random.Random(seed)
        self._next = 0

    def choose(self, policy: str, candidates: dict, prompt_tokens: int, loads: Loads) -> Any:
        """The chosen instance id among ``candidates`` (``{instance id: Hits}``, not
        empty): the first of ``rank``.

        Raises:
            ValueError: an unknown policy.
        """
        return self.rank(policy, candidates, prompt_tokens, loads)[0]

    def rank(self, policy: str, candidates: dict, prompt_tokens: int, loads: Loads) -> list:
        """Every instance id of ``candidates`` (``{instance id: Hits}``, not empty), best
        first: ``cache-aware`` and ``least-loaded`` by their scores, ``round-robin`` in turn
        from the one whose turn it is, ``random`` in turn after a random first.

        Raises:
            ValueError: an unknown policy.
        """
        if policy not in SELECT_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(SELECT_POLICIES)}")
        ids = sorted(candidates, key=str)
        load, routed = loads.tokens, loads.routed
        if policy == "round-robin":
            first = self._next % len(ids)
            self._next += 1
            return ids[first:] + ids[:first]
        if policy == "random":
            first = self._rng.randrange(len(ids))
            return ids[first:] + ids[:first]
        if policy == "least-loaded":
            return sorted(ids, key=lambda i: (load.get(i, 0), routed.get(i, 0), str(i)))
        return sorted(ids, key=lambda i: (self.score(candidates[i], prompt_tokens,
                                                     load.get(i, 0)),
                                          load.get(i, 0), routed.get(i, 0), str(i)))

    def cached(self, hits: Any) -> float:
        return hits.gpu + self.host_weight * max(hits.cpu - hits.gpu, 0)

    def score(self, hits: Any, prompt_tokens: int, load: int) -> float:
        return (self.prefill_weight * (prompt_tokens - self.cached(hits))
                + self.load_weight * load)
