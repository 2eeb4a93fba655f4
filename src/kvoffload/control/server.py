"""The HTTP control endpoint beside an engine: retain, release, prefetch and inspect sessions.

JSON in and out; every session is named with its tenant (the requests' ``cache_salt``,
``""`` for none), which is required::

    POST /sessions/{id}/retain    {"tenant": "", "ttl_s": 300}  -> retained, trimmed, absent
    POST /sessions/{id}/release   {"tenant": ""}                -> released
    POST /sessions/{id}/prefetch  {"tenant": ""}                -> prefetching
    GET  /sessions/{id}?tenant=                                 -> blocks per tier, expiries
    POST /prefetch                {"tenant": "", "token_ids": [...]}  (with a key function)

Tokens: ``token`` (the operator's) opens every tenant; a token of ``tenant_tokens`` opens
its own tenant only, so that tenants sharing an engine cannot hold, drop or inspect each
other's sessions. With neither, no token is asked for.

Answers: 200 with the result; 400 a bad request (the message names the value); 401 a
missing or wrong bearer token (when one is configured); 403 a tenant's token naming another
tenant; 404 an unknown path or session; 503 the engine did not run the command within
``timeout_s``. Served by a stdlib
``ThreadingHTTPServer`` on a daemon thread, bound to 127.0.0.1 unless told otherwise; each
command runs through the ``ControlQueue`` (``kvoffload.control.queue``).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from kvoffload.control import sessions
from kvoffload.control.queue import ControlQueue
from kvoffload.control.sessions import ControlError
from kvoffload.directives import TTL
from kvoffload.keys import OffloadKey
from kvoffload.sessions import SessionId

if TYPE_CHECKING:
    from kvoffload.scheduler.sessions import SessionRegistry

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 5.0
MAX_BODY = 16 << 20
EVERY_TENANT = None  # the scope of the operator's token (or of no token configured)


class ControlServer:
    """Serves the controls of ``registry`` until ``close``. ``keys_of(tenant, token_ids)``:
    a token prefix's keys (``POST /prefetch`` is 404 without it). ``port`` 0 takes a free
    port (``address`` says which). ``tenant_tokens``: tenant -> the token that opens only it."""

    def __init__(
        self,
        queue: ControlQueue,
        registry: SessionRegistry,
        host: str = DEFAULT_HOST,
        port: int = 0,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        keys_of: Callable[[str, list[int]], list[OffloadKey]] | None = None,
        tenant_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.queue, self.registry = queue, registry
        self._scopes = tenant_scopes(token, tenant_tokens or {})
        self.timeout_s, self.keys_of = timeout_s, keys_of
        handler = type("Handler", (_Handler,), {"control": self})
        try:
            self._http = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise OSError(f"kvoffload control endpoint: cannot listen on {host}:{port}: {exc}") from None
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="kvoffload-control", daemon=True
        )
        self._thread.start()
        logger.info("kvoffload: session control endpoint on http://%s:%d", *self.address)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._http.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    def handle(
        self,
        method: str,
        path: str,
        query: dict[str, list[str]],
        body: dict[str, Any],
        scope: str | None = EVERY_TENANT,
    ) -> Any:
        """One request's answer (a JSON value); ``ControlError`` for a refusal. ``scope``: the
        tenant the request's token opens (``EVERY_TENANT``: all of them)."""

        def _tenant(value: Any) -> str:
            return _tenant_within(value, scope)

        parts = [unquote(p) for p in path.strip("/").split("/")]
        if method == "POST" and parts == ["prefetch"] and self.keys_of is not None:
            tenant, tokens = _tenant(body.get("tenant")), _token_ids(body.get("token_ids"))
            return self._run(lambda: sessions.prefetch_prefix(self.registry, self.keys_of, tenant, tokens))
        if len(parts) not in (2, 3) or parts[0] != "sessions" or not parts[1]:
            raise ControlError(404, f"no such path {path!r}")
        action = parts[2] if len(parts) == 3 else None
        if method == "GET" and action is None:
            session = SessionId(_tenant((query.get("tenant") or [None])[0]), parts[1])
            return self._run(lambda: sessions.inspect(self.registry, session))
        if method != "POST" or action not in ("retain", "release", "prefetch"):
            raise ControlError(404, f"no such path {method} {path!r}")
        session = SessionId(_tenant(body.get("tenant")), parts[1])
        if action == "retain":
            try:
                ttl_s = TTL("ttl_s", body.get("ttl_s"))
            except ValueError as exc:
                raise ControlError(400, str(exc)) from None
            return self._run(lambda: sessions.retain(self.registry, session, ttl_s))
        control = sessions.release if action == "release" else sessions.prefetch
        return self._run(lambda: control(self.registry, session))

    def _run(self, fn: Callable[[], Any]) -> Any:
        try:
            return self.queue.submit(fn, self.timeout_s)
        except TimeoutError as exc:
            raise ControlError(503, str(exc)) from None

    def scope(self, header: str | None) -> str | None:
        """The tenant an ``Authorization`` header opens (``EVERY_TENANT``: all);
        ``ControlError`` 401 for a missing or unknown token when tokens are configured."""
        if not self._scopes:
            return EVERY_TENANT
        scheme, _, given = (header or "").partition(" ")
        found, scope = False, EVERY_TENANT
        for token, tenant in self._scopes:  # every token compared, in constant time each
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
                found, scope = True, tenant
        if not found:
            raise ControlError(401, "a valid bearer token is required")
        return scope


def tenant_scopes(token: str | None, tenant_tokens: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """(token, the tenant it opens or ``EVERY_TENANT``) for each configured token; a token
    given twice is refused, since it would open two scopes."""
    scopes: list[tuple[str, str | None]] = [] if token is None else [(token, EVERY_TENANT)]
    scopes += [(tenant_token, tenant) for tenant, tenant_token in tenant_tokens.items()]
    holders: dict[str, list[str]] = {}
    for given, scope in scopes:
        holders.setdefault(given, []).append("the operator" if scope is None else repr(scope))
    for shared in (names for names in holders.values() if len(names) > 1):
        raise ValueError(f"one control token is given to {' and '.join(shared)}: each token opens one scope")
    return scopes


def _tenant_within(value: Any, scope: str | None) -> str:
    if not isinstance(value, str):
        raise ControlError(400, f'tenant is required: the requests\' cache_salt, "" for none; got {value!r}')
    if scope is not EVERY_TENANT and value != scope:
        raise ControlError(403, f"this token opens tenant {scope!r} only, not {value!r}")
    return value


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not value or not all(type(t) is int and t >= 0 for t in value):
        raise ControlError(400, f"token_ids must be a non-empty list of token ids, got {str(value)[:80]}")
    return value


class _Handler(BaseHTTPRequestHandler):
    control: ControlServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        try:
            body = self._body()  # read whatever is sent, so the connection stays usable
            scope = self.control.scope(self.headers.get("Authorization"))
            url = urlsplit(self.path)
            query = parse_qs(url.query, keep_blank_values=True)
            status, answer = 200, self.control.handle(method, url.path, query, body, scope)
        except ControlError as exc:
            status, answer = exc.status, {"error": str(exc)}
        except ValueError as exc:  # a bad session id
            status, answer = 400, {"error": str(exc)}
        except Exception as exc:  # the registry's: said, never a dropped connection
            logger.exception("kvoffload control endpoint: %s %s failed", method, self.path)
            status, answer = 500, {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            raise ControlError(400, f"a body of {length} bytes is over {MAX_BODY}")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            raise ControlError(400, f"the body is not JSON: {raw[:80]!r}") from None
        if not isinstance(body, dict):
            raise ControlError(400, f"the body must be a JSON object, got {raw[:80]!r}")
        return body

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("kvoffload control endpoint: " + format, *args)
