"""``ObjectStore``: the one owner of an S3 client (``obstore``); every call of the tier
goes through it, and every answer comes back as one of a few outcomes.

``S3Settings`` is what a client is built from: the endpoint URL, the bucket, the region,
the names of the environment variables holding the credentials (read when the store is
built: an unset one is a ``ValueError`` naming the variable, never showing a value), the
bounds of a call and its retries. obstore's own defaults (a 30 s request timeout, 10
retries over up to 3 minutes, with backoff) would turn a dead or frozen endpoint into
minutes of blocked I/O threads; here a call is bounded by ``connect_timeout`` and
``timeout`` and is retried ``retries`` times (default 0): the tier's answer to a failed
call is a miss or a declined store, and the breaker, not the client, decides when to try
again.

Outcomes (``classify``): ``OK``; ``MISSING`` (404: no such object, or bucket);
``EXISTS`` (412/409: a conditional put found the name taken, the first writer won);
``DENIED`` (401/403: the credentials are refused or lack the permission, e.g. a read-only
identity storing); ``SHORT`` (416: a ranged read found no byte in its range, an empty
object); ``REJECTED`` (any other HTTP error: the server answered, e.g. a full
SeaweedFS answers a put with 500); ``DOWN`` (no HTTP answer: refused, reset, timed out).
Only ``DOWN`` feeds the ``CircuitBreaker`` as a failure; while it is open a call returns
``DOWN`` at once without touching the network, but for one now and then that finds out
whether the endpoint answers again. Every other outcome is an answer, and closes it.

A call that timed out may still be applied by the server later (a put that was in flight
when a frozen server resumed was stored): ``DOWN`` means *unknown*, never *absent*.

Error texts are one line: the method, URL and status (or transport error) of the call,
and S3's error code when the body has one; the secret never appears in them (scrubbed,
should a server ever echo it).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from kvoffload.tiers.redis.breaker import CircuitBreaker

log = logging.getLogger("kvoffload.tiers.s3")

OK, MISSING, EXISTS, DENIED, REJECTED, DOWN = "ok", "missing", "exists", "denied", "rejected", "down"
SHORT = "short"  # 416: a ranged read of an object with no byte in the range (an empty one)
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")


@dataclass(frozen=True)
class S3Settings:
    """What a client is built from (see the module docstring)."""

    endpoint: str  # http(s)://host[:port], no path, no credentials
    bucket: str
    region: str = "us-east-1"
    access_key_env: str = "AWS_ACCESS_KEY_ID"
    secret_key_env: str = "AWS_SECRET_ACCESS_KEY"
    session_token_env: str | None = None
    virtual_hosted: bool = False  # bucket.host (AWS) instead of host/bucket (most others)
    connect_timeout: float = 1.0
    timeout: float = 5.0
    retries: int = 0

    @property
    def shown(self) -> str:
        """The store as errors and logs name it: endpoint and bucket."""
        return f"{self.endpoint} bucket {self.bucket!r}"

    def credentials(self) -> tuple[str, str, str | None]:
        """``(access key id, secret, session token)`` from the environment; a
        ``ValueError`` naming the variable that is unset or empty."""
        values = []
        for variable in (self.access_key_env, self.secret_key_env, self.session_token_env):
            if variable is None:
                values.append(None)
                continue
            value = os.environ.get(variable)
            if not value:
                raise ValueError(
                    f"s3 tier {self.shown}: the environment variable {variable} (credentials) is not set"
                )
            values.append(value)
        return values[0], values[1], values[2]


def classify(exc: BaseException) -> str:
    """The outcome an exception of obstore (or of its transport) stands for."""
    from obstore import exceptions as errors

    if isinstance(exc, (FileNotFoundError, errors.NotFoundError)):
        return MISSING
    if isinstance(exc, (errors.AlreadyExistsError, errors.PreconditionError)):
        return EXISTS
    if isinstance(exc, (PermissionError, errors.PermissionDeniedError, errors.UnauthenticatedError)):
        return DENIED
    match = _STATUS.search(str(exc))
    if match is None:
        return DOWN
    status = int(match[1])
    if status == 404:
        return MISSING
    if status in (409, 412):
        return EXISTS
    if status in (401, 403):
        return DENIED
    if status == 416:
        return SHORT
    return REJECTED


class ObjectStore:
    """An S3 bucket behind a breaker. ``name`` names it in logs (endpoint, bucket, side)."""

    def __init__(self, settings: S3Settings, name: str, *, max_delay: float = 10.0) -> None:
        from kvoffload.extras import require

        require("obstore", "s3", "the s3 tier")
        from obstore.store import S3Store

        self.settings = settings
        self.name = name
        access, secret, token = settings.credentials()
        self._secret = secret
        bound = timedelta(seconds=settings.timeout)
        self._client = S3Store(
            settings.bucket,
            endpoint=settings.endpoint,
            region=settings.region,
            access_key_id=access,
            secret_access_key=secret,
            **({"session_token": token} if token else {}),
            virtual_hosted_style_request=settings.virtual_hosted,
            client_options={
                "allow_http": settings.endpoint.startswith("http://"),
                "connect_timeout": timedelta(seconds=settings.connect_timeout),
                "timeout": bound,
            },
            retry_config={
                "max_retries": settings.retries,
                "retry_timeout": bound,
                "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": bound, "base": 2},
            },
        )
        self.breaker = CircuitBreaker(name, base_delay=min(0.5, max_delay), max_delay=max_delay)

    @property
    def down(self) -> bool:
        """Whether calls fail at once now (the breaker is open)."""
        return self.breaker.is_open

    def why(self, exc: BaseException) -> str:
        """One line about a failed call, without the secret."""
        text = str(exc)
        first = text.splitlines()[0] if text else type(exc).__name__
        code = _CODE.search(text)
        line = first.split(": <?xml")[0][:300] + (f" ({code[1]})" if code else "")
        return line.replace(self._secret, "***") if self._secret else line

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """``(outcome, value)``: ``(OK, what method(client, ...) returned)``, or the failed
        call's outcome and its error text; ``DOWN`` at once while the breaker is open."""
        if not self.breaker.allow():
            return DOWN, f"{self.name}: the endpoint is down (waiting to try again)"
        try:
            value = method(self._client, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome, never raised
            outcome = classify(exc)
            why = self.why(exc)
            if outcome == DOWN:
                self.breaker.failure(why)
            else:
                self.breaker.success()
            return outcome, why
        self.breaker.success()
        return OK, value

    # -- the calls the tier makes --------------------------------------------------------

    def head(self, name: str) -> tuple[str, Any]:
        """``(OK, meta)`` with ``meta["size"]`` and ``meta["last_modified"]``."""
        import obstore

        return self.call(obstore.head, name)

    def put_new(self, name: str, body: Any) -> tuple[str, Any]:
        """Create ``name`` from the buffer ``body`` unless it exists (``If-None-Match: *``):
        ``EXISTS`` when another writer was first."""
        import obstore

        return self.call(obstore.put, name, body, mode="create", use_multipart=False)

    def get(self, name: str, most: int) -> tuple[str, Any]:
        """``(OK, (meta, body))``: the object's metadata and its first ``most`` bytes (one
        buffer; a ranged read, so an object larger than expected costs no more than
        ``most`` bytes: ask one more than expected to tell it apart)."""
        import obstore

        def read(client, path):
            result = obstore.get(client, path, options={"range": (0, most)})
            return result.meta, result.bytes()

        return self.call(read, name)

    def delete(self, names: list[str]) -> tuple[str, Any]:
        """Delete ``names`` (absent ones too), in as few calls as S3 allows."""
        import obstore

        if not names:
            return OK, None
        return self.call(obstore.delete, names)

    def listing(self, folder: str) -> tuple[str, Any]:
        """``(OK, [meta, ...])`` of every object under ``folder/``."""
        import obstore

        def every(client, prefix):
            return [meta for chunk in obstore.list(client, prefix=prefix, chunk_size=1000) for meta in chunk]

        return self.call(every, folder)

    def check_access(self, folder: str) -> None:
        """At start-up: ``ValueError`` (naming the endpoint and bucket, never the secret)
        when the bucket does not exist or refuses the credentials; a logged warning when
        the endpoint does not answer (a degraded start: the tier misses until it does)."""
        import obstore

        def first(client, prefix):
            return next(iter(obstore.list(client, prefix=prefix, chunk_size=1)), None)

        outcome, value = self.call(first, folder)
        if outcome == DENIED:
            raise ValueError(
                f"s3 tier {self.settings.shown} refused the credentials "
                f"(from ${self.settings.access_key_env} and ${self.settings.secret_key_env}): {value}"
            )
        if outcome == MISSING:
            raise ValueError(f"s3 tier: bucket {self.settings.bucket!r} does not exist at "
                             f"{self.settings.endpoint} ({value})")  # fmt: skip
        if outcome != OK:
            log.warning(
                "s3 tier: %s does not answer at start-up (%s); starting without it, it serves once it "
                "answers",
                self.settings.shown, value,
            )  # fmt: skip

    def __repr__(self) -> str:
        return f"ObjectStore({self.name!r}, {'down' if self.down else 'up'})"
