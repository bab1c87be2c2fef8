"""What replicas on one ``--index redis://...`` share besides the index itself: the
registrations (so that every replica subscribes to every publisher, and the one holding a
publisher's lease applies its batches) and which publishers have blocks on other tiers than
the device. Keys: ``rcsvc:{namespace}:registrations`` (a hash: the registration's key to
its fields, as JSON) and ``rcsvc:{namespace}:tiered`` (a set). Needs the ``redis`` client.
"""

from __future__ import annotations

import json
from typing import Any

from .identity import Registration


class SharedRegistry:
    """The registrations in the store; every call raises ``ConnectionError`` when the store
    cannot be reached (``ping`` answers False instead)."""

    def __init__(self, url: str, namespace: str) -> None:
        try:
            import redis
        except ImportError:
            raise ImportError("a shared index needs the redis client: "
                              "pip install 'radixcache[serve]'") from None
        self._errors = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)
        self._redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._regs = f"rcsvc:{{{namespace}}}:registrations"
        self._tiered = f"rcsvc:{{{namespace}}}:tiered"

    def _do(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._redis, method)(*args)
        except self._errors as exc:
            raise ConnectionError(f"the index store failed: {exc}") from None

    @staticmethod
    def _field(reg: Registration) -> str:
        return json.dumps(list(reg.key))

    def put(self, reg: Registration) -> None:
        self._do("hset", self._regs, self._field(reg), json.dumps(reg.as_record()))

    def delete(self, reg: Registration) -> None:
        self._do("hdel", self._regs, self._field(reg))

    def all(self) -> list:
        out = []
        for value in self._do("hgetall", self._regs).values():
            try:
                out.append(Registration(**json.loads(value)))
            except (ValueError, TypeError):
                continue  # written by another version: left to it
        return out

    def mark_tiered(self, group: tuple, worker: tuple) -> None:
        self._do("sadd", self._tiered, json.dumps([list(group), list(worker)]))

    def tiered(self) -> set:
        out = set()
        for value in self._do("smembers", self._tiered):
            try:
                group, worker = json.loads(value)
                out.add((tuple(group), tuple(worker)))
            except (ValueError, TypeError):
                continue
        return out

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except self._errors:
            return False

    def close(self) -> None:
        self._redis.close()
