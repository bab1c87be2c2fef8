"""The one interface between the Endpoint Picker's protocol side and the index: ``Picker``.

The ext_proc server (``radixcache.picker.extproc``) reads a request, tokenizes it, and asks a
``Picker`` for the endpoints, best first; it reports back which endpoint served it and when
it ended. Everything that knows which blocks each endpoint holds, which endpoints are alive
and how loaded they are lives behind this interface: ``ServicePicker``
(``radixcache.picker.service_picker``) implements it over the index service's state, the
same registrations, subscriptions, indexes and load table its HTTP API serves.
"""

from __future__ import annotations

from typing import Any, Collection, Optional, Protocol, Sequence

__all__ = ["Pick", "Picker"]


class Pick:
    """One request's answer: the endpoints to try, best first, with what the index predicts.

    Attributes:
        endpoints: The endpoints (``ip:port``), best first; empty when none is eligible.
        cached_tokens: The prompt tokens each listed endpoint is predicted to hold, in the
            same order.
        prompt_tokens: The prompt's length in tokens.
        load_tokens: The load the request adds to the endpoint serving it, in tokens (its
            prompt and the output it may generate).
        least_load: The lowest load among the eligible endpoints before this request, in
            tokens (a sheddable request is shed when even that one is saturated).
        holder: The endpoint its load is counted on now (the first until ``served`` says
            otherwise), None once ``finished`` (or when nothing was picked).
        handle: What the ``Picker`` knows the request by (its own; None until set).
    """

    __slots__ = ("cached_tokens", "endpoints", "handle", "holder", "least_load", "load_tokens",
                 "prompt_tokens")

    def __init__(self, endpoints: Sequence[str], cached_tokens: Sequence[int],
                 prompt_tokens: int, load_tokens: int, least_load: int = 0) -> None:
        self.endpoints = tuple(endpoints)
        self.cached_tokens = tuple(cached_tokens)
        self.prompt_tokens = prompt_tokens
        self.load_tokens = load_tokens
        self.least_load = least_load
        self.holder: Optional[str] = self.endpoints[0] if self.endpoints else None
        self.handle: Any = None

    def __repr__(self) -> str:
        return (f"Pick(endpoints={list(self.endpoints)}, cached_tokens="
                f"{list(self.cached_tokens)}, prompt_tokens={self.prompt_tokens}, "
                f"holder={self.holder!r})")


class Picker(Protocol):
    """What the ext_proc server needs of an index (see the module docstring).

    ``pick`` is called from the server's event loop, once per request; ``served`` at most
    once and ``finished`` exactly once per ``Pick`` (also after a failed request), in that
    order. Implementations serialise these with their own event ingestion.
    """

    def pick(self, model: str, token_ids: Sequence[int], *, lora: Optional[str] = None,
             salt: Optional[str] = None, candidates: Optional[Collection[str]] = None,
             output_tokens: int = 0, max_endpoints: int = 1) -> Pick:
        """Choose the endpoints for a request and count its load on the first.

        The load is what the request brings the first endpoint, in tokens: its prompt and
        ``output_tokens`` (the tokens its KV cache will span).

        Args:
            model: The model the request names (the base model's name for an adapter).
            token_ids: The prompt's token ids, as the engine tokenizes it.
            lora: The LoRA adapter, or None.
            salt: The request's cache salt, or None.
            candidates: The endpoints the gateway allows (its subset), or None for all.
            output_tokens: The tokens it may generate (its ``max_tokens``; 0: not given).
            max_endpoints: How many endpoints to list at most (the first and its fallbacks).

        Returns:
            A ``Pick``; its ``endpoints`` are empty when no allowed endpoint is eligible.
        """
        ...

    def served(self, pick: Pick, endpoint: str) -> None:
        """The gateway reports that ``endpoint`` served the request (a fallback when it is
        not the first): its load moves there."""
        ...

    def finished(self, pick: Pick) -> None:
        """The request ended (or failed): its load is released. Idempotent."""
        ...

    def ready(self) -> bool:
        """Whether the index has synced with the endpoints (readiness)."""
        ...

    def status(self) -> dict:
        """Per endpoint: ``{"eligible": bool, "events_seq": int or None, "blocks": int,
        "load": int}`` (for metrics)."""
        ...

    def close(self) -> None:
        """Stop ingesting events and release what the picker holds."""
        ...


def check_max_endpoints(value: Any) -> int:
    """``max_endpoints`` as an int >= 1."""
    if type(value) is not int or value < 1:
        raise ValueError(f"max_endpoints must be an int >= 1, got {value!r}")
    return value
