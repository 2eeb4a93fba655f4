"""Connections to the shared store: URL checks, credentials, bounded timeouts.

``ServerSettings`` holds what a connection needs; ``connect(settings)`` returns a
redis-py client (``redis.Redis``, or ``redis.cluster.RedisCluster`` with ``cluster``)
whose every call is bounded by the timeouts and is never retried inside redis-py (the
tier's circuit breaker decides when to try again). Credentials come from the URL or from
an environment variable named by ``password_env``; ``redact(url)`` is the only form of
a URL that goes into logs and errors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvoffload.extras import require

SCHEMES = ("redis", "rediss", "unix")


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_QUERY_SECRET = re.compile(r"(?i)([?&;]password=)[^&;#]*")


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``; in any other text, every URL in it.

    Works on the text, not on a parse: a password with an unescaped ``#``, ``/``, ``?``,
    ``@`` or space (which a URL parser splits elsewhere) is hidden whole. Everything
    before the last ``@`` of the URL is credentials; the user name stays when a ``:``
    follows it, otherwise the whole of it is hidden. A ``password=`` query value too.
    """
    if not isinstance(url, str):
        return "<not a url>"
    if _URL.match(url):
        return _redact_one(url)
    return _URL_IN_TEXT.sub(lambda m: _redact_one(m.group(0)), url)


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        rest = (f"{user}:***" if colon else "***") + rest[at:]
    return scheme + sep + _QUERY_SECRET.sub(r"\1***", rest)


def check_url(url: object) -> str:
    """``url`` if it is a Redis URL; ``ValueError`` naming the (redacted) value otherwise."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        # not urllib's message: it quotes what it took for the port, which may be part of
        # a password with an unescaped '#', '/' or '?'
        raise ValueError(
            f"url {redact(url)!r} is not a valid URL (bad host or port; percent-encode "
            "reserved characters in a password)"
        ) from None
    if parts.scheme not in SCHEMES:
        schemes = ", ".join(s + "://" for s in SCHEMES)
        raise ValueError(f"url {redact(url)!r} must start with one of {schemes}")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"url {redact(url)!r} names no socket path")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"url {redact(url)!r} names no host")
    return url


@dataclass(frozen=True)
class ServerSettings:
    url: str
    cluster: bool = False
    password_env: str | None = None
    connect_timeout: float = 1.0
    timeout: float = 2.0

    def password(self) -> str | None:
        """The password from ``password_env``, if one is named (``ValueError`` naming the
        variable when it is not set)."""
        if self.password_env is None:
            return None
        value = os.environ.get(self.password_env)
        if value is None:
            raise ValueError(f"password_env names {self.password_env!r}, which is not set")
        return value

    @property
    def shown(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:  # the generated one would show the URL with its password
        return (
            f"ServerSettings(url={self.shown!r}, cluster={self.cluster}, password_env={self.password_env!r}, "
            f"connect_timeout={self.connect_timeout}, timeout={self.timeout})"
        )


def connect(settings: ServerSettings):
    """A client for ``settings`` (no network traffic until its first call)."""
    redis = require("redis", "redis", "the Redis tier")
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options = {
        "socket_connect_timeout": settings.connect_timeout,
        "socket_timeout": settings.timeout,
        "retry": Retry(NoBackoff(), 0),
        # replies of whole blocks: read them in large pieces (each read gives up the GIL)
        "socket_read_size": 1 << 20,
    }
    password = settings.password()
    if password is not None:
        options["password"] = password
    if settings.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(settings.url, **options)
    return redis.Redis.from_url(settings.url, **options)
