"""The HTTP front end of the hot endpoints: uvicorn's httptools protocol, with ``/query`` and
``/query_by_hash`` answered from the parser's own callbacks.

An ASGI request costs a task, a scope, an event per body part and two ``send`` messages:
on an 8,192-token ``/query`` that is more than reading its body (docs/service.md). Here a
plain request to a fast endpoint is answered as soon as its last byte is parsed, by the
same ``App.answer`` the ASGI route runs (the same handler, token check, refusals, metrics),
and written to the socket at once. Everything else goes the ASGI way, unchanged: the
other routes, and any request to a fast endpoint that is not plain:

- not ``POST`` over HTTP/1.1 with the path written exactly (a query string, escapes);
- a body framed otherwise than by one ``Content-Length`` within ``--max-body``
  (chunked, none, several, too large: the ASGI route counts it and refuses it);
- ``Expect: 100-continue``, an ``Upgrade``; uvicorn's access log or concurrency limit on;
- an earlier request of the connection still being answered the ASGI way (a pipelined
  request is answered in order), or the client not reading its answers (the socket's write
  buffer full: the ASGI route waits for it to drain, and stops reading meanwhile).

Keep-alive, its timeout, ``Connection: close``, pipelining and malformed requests are
uvicorn's own handling: this class only adds the fast answer.
"""

from __future__ import annotations

import time
from typing import Any, Optional

#: The endpoints answered from the parser's callbacks (when the application serves them).
FAST_PATHS = ("/query", "/query_by_hash")


def protocol_class(app: Any) -> Optional[type]:
    """uvicorn's httptools protocol with ``app``'s fast endpoints answered in it (pass it as
    ``uvicorn.Config(http=...)``); None without httptools (then uvicorn's own serves all)."""
    try:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:
        return None
    # What this class extends of uvicorn's protocol (stable since uvicorn 0.30): a uvicorn
    # without it serves every request the ASGI way.
    if not all(hasattr(HttpToolsProtocol, name) for name in (
            "on_headers_complete", "on_body", "on_message_complete",
            "_unset_keepalive_if_required", "timeout_keep_alive_handler")):
        return None
    routes = {path.encode(): app.routes[("POST", path)] for path in FAST_PATHS
              if ("POST", path) in app.routes}
    # Only a route that answers in the loop and changes nothing (no executor, no token).
    routes = {path: route for path, route in routes.items()
              if route[1] is False and not route[2]}
    from .app import response_headers

    max_body = app.config.max_body
    answer, observe = app.answer, app.observe

    class FastProtocol(HttpToolsProtocol):
        """See the module docstring."""

        _fast: Optional[tuple] = None
        _fast_body: list

        def on_headers_complete(self) -> None:
            route = routes.get(self.url)
            if route is not None and self._plain():
                self._fast = route
                self._fast_path = self.url.decode()
                self._fast_body = []
                self._fast_started = time.perf_counter()
                return
            self._fast = None
            super().on_headers_complete()

        def _plain(self) -> bool:
            parser = self.parser
            if parser.get_method() != b"POST" or parser.get_http_version() != "1.1" \
                    or self.expect_100_continue or parser.should_upgrade() \
                    or self.limit_concurrency is not None or self.access_log \
                    or not (self.cycle is None or self.cycle.response_complete) \
                    or self.flow.write_paused:
                return False
            length = None
            for name, value in self.headers:
                if name == b"content-length":
                    if length is not None:
                        return False
                    length = value
                elif name == b"transfer-encoding":
                    return False
            return length is not None and length.isdigit() and int(length) <= max_body

        def on_body(self, body: bytes) -> None:
            if self._fast is None:
                super().on_body(body)
            else:
                self._fast_body.append(body)

        def on_message_complete(self) -> None:
            route = self._fast
            if route is None:
                super().on_message_complete()
                return
            self._fast = None
            chunks = self._fast_body
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            status, out, headers = answer(route, body, self.headers, "POST", self._fast_path)
            keep_alive = self.parser.should_keep_alive()
            self._write(status, out, headers, keep_alive)
            observe(route[3], status, self._fast_started)
            self.server_state.total_requests += 1
            if not keep_alive:
                self.transport.close()
            elif not self.transport.is_closing():
                self._unset_keepalive_if_required()
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def _write(self, status: int, out: bytes, headers: list, keep_alive: bool) -> None:
            content = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                content += (name, b": ", value, b"\r\n")
            for name, value in response_headers(headers, out):
                content += (name, b": ", value, b"\r\n")
            if not keep_alive:
                content.append(b"connection: close\r\n")
            content += (b"\r\n", out)
            self.transport.write(b"".join(content))

    return FastProtocol
