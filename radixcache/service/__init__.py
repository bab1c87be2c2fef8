"""``radixcache serve``: the router index as a long-lived HTTP service speaking the indexer
API of Mooncake's RFC #1403 (Mooncake Conductor) and the dialect of NVIDIA Dynamo's
standalone indexer, plus ``/select``, ``/load``, ``/metrics``, ``/health`` and ``/ready``
(see docs/service.md). Needs ``pip install 'radixcache[serve]'``; importing this package
imports none of it.

Modules: ``config`` (settings, static publishers, the endpoint allow-list), ``identity``
(registrations, scopes and groups), ``stdhash`` (the standard XXH3-64 block hashes),
``rfc1527`` (RFC #1527 event maps), ``pool`` (blocks known by their standard hashes only),
``hashindex`` (``--hash-index``: the engines' blocks by their standard hashes too),
``ingest`` (a subscription's thread), ``query`` (what a query answers), ``select`` (load and
``/select``'s policies), ``shared`` (what replicas share in the store), ``state``
(``IndexService``: all of it, without HTTP), ``metrics`` (Prometheus), ``api`` (the
dialects' bodies and answers) and ``app`` (the ASGI application).
"""

from .config import ServiceConfig
from .identity import Registration
from .state import IndexService, Query, ServiceError

__all__ = ["IndexService", "Query", "Registration", "ServiceConfig", "ServiceError"]
