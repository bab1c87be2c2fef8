"""``ServicePicker``: the ``Picker`` over the index service's state (``IndexService``), so that
``radixcache serve --epp PORT`` picks from the same registrations, subscriptions, indexes and
load table as its HTTP API.

- **Endpoints** are the registered instances with a serving address (``address`` in
  ``/register`` or in a static publisher's spec): the picker answers with those addresses.
  An instance registered without one is answered for by ``/query`` but never picked.
- **Eligibility**: registered for the request's model (in the picker's tenant) with an
  address, allowed by the gateway's subset, and live: with ``--instance-timeout`` its
  subscription must have caught up from its first replay and its publisher must have been
  heard from within it (a batch, or an answer to the
  subscription's probes of its replay socket, which an idle engine still gives); it is
  eligible again as soon as it is heard from.
- **Ranking** is the service's (``IndexService.place``): the configured policy, the index's
  overlaps, the blocks of earlier placements not yet confirmed by events, the load table.
- **Load**: a pick counts the request (its prompt and ``max_tokens``: the tokens its KV
  cache will span) on the first endpoint, in the same table as ``/select`` and ``/load``;
  ``served`` moves it, ``finished`` releases it.
- **Models**: a request names a registered model, or a LoRA adapter given to the picker
  (then the adapter's base model's instances serve it, its blocks in the adapter's
  namespace). A model no instance is registered for is a 404. A request the picker does not
  read (another path, no body) goes to the picker's own model's instances, on load alone.
"""

from __future__ import annotations

import itertools
from typing import Any, Collection, Optional, Sequence

from ..service.identity import DEFAULT_TENANT
from .openai import RequestError
from .picking import Pick, check_max_endpoints

__all__ = ["ServicePicker"]


class ServicePicker:
    """A ``Picker`` over an ``IndexService`` (module docstring).

    Args:
        service: The ``IndexService`` (started and closed by its owner).
        model: The model of requests that name none (paths the picker does not read).
        policy: The ranking policy (a ``SELECT_POLICIES`` name; None: the service's).
        loras: ``{adapter name: base model}`` of the LoRA adapters requests may name.
        tenant: The tenant whose registrations the picker routes among.
    """

    def __init__(self, service: Any, model: str, *, policy: Optional[str] = None,
                 loras: Optional[dict] = None, tenant: str = DEFAULT_TENANT) -> None:
        self.service = service
        self.model = model
        self.policy = policy
        self.loras = dict(loras or {})
        self.tenant = tenant
        self._ids = itertools.count()
        self._synced = False

    def pick(self, model: str, token_ids: Sequence[int], *, lora: Optional[str] = None,
             salt: Optional[str] = None, candidates: Optional[Collection[str]] = None,
             output_tokens: int = 0, max_endpoints: int = 1) -> Pick:
        """See ``Picker.pick``.

        Raises:
            RequestError: 404 for a model no instance is registered for; 503 when the
                service cannot rank for it (its instances registered with several block
                sizes).
        """
        from ..service import Query, ServiceError

        max_endpoints = check_max_endpoints(max_endpoints)
        base = self.loras.get(lora, model) if lora is not None else (model or self.model)
        handle = ("picker", next(self._ids))
        query = Query(base, tokens=token_ids, tenant=self.tenant, lora=lora, salt=salt)
        try:
            chosen = self.service.place(query, self.policy, request_id=handle,
                                        output_tokens=output_tokens, addressed=True,
                                        addresses=None if candidates is None
                                        else frozenset(candidates),
                                        limit=max_endpoints)
        except ServiceError as exc:
            if exc.status == 404:
                raise RequestError(404, f"the model {model!r} does not exist here",
                                   "NotFoundError", "model_not_found") from None
            raise RequestError(503, str(exc), "unavailable", "no_endpoint") from None
        prompt = len(token_ids)
        if not chosen.ranked:
            return Pick((), (), prompt, 0)
        address = self.service.address
        pick = Pick([address(i) for i in chosen.ranked], chosen.ranked_tokens, prompt,
                    chosen.added_load, chosen.least_load)
        pick.handle = handle
        return pick

    def served(self, pick: Pick, endpoint: str) -> None:
        """See ``Picker.served``."""
        if pick.holder is None or endpoint == pick.holder:
            return
        instance = self.service.instance_at(endpoint)
        if instance is not None and self.service.move_request(pick.handle, instance):
            pick.holder = endpoint

    def finished(self, pick: Pick) -> None:
        """See ``Picker.finished``."""
        holder, pick.holder = pick.holder, None
        if holder is not None:
            self.service.end_request(pick.handle)

    def ready(self) -> bool:
        """The service ready (its subscriptions running, its store reachable), every
        subscription of the start caught up from its first replay (a restarted picker
        routes on the whole index, not on part of it), and an endpoint eligible."""
        if not self._synced:  # once: a publisher registered later does not flap readiness
            self._synced = self.service.caught_up()
        return self._synced and self.service.ready()[0] and any(
            e["live"] for e in self.service.endpoints().values())

    def status(self) -> dict:
        """See ``Picker.status``."""
        return {address: {"eligible": e["live"], "events_seq": e["events_seq"],
                          "blocks": e["blocks"], "load": e["load"]}
                for address, e in self.service.endpoints().items()}

    def close(self) -> None:
        """Nothing: the service is its owner's to close."""
