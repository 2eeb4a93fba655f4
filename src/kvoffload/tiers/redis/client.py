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
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("redis", "rediss", "unix")


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def check_url(url: object) -> str:
    """``url`` if it is a Redis URL; ``ValueError`` naming the (redacted) value otherwise."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise ValueError(f"url {redact(url)!r} is not a valid URL: {exc}") from None
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


def connect(settings: ServerSettings):
    """A client for ``settings`` (no network traffic until its first call)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options = {
        "socket_connect_timeout": settings.connect_timeout,
        "socket_timeout": settings.timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    password = settings.password()
    if password is not None:
        options["password"] = password
    if settings.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(settings.url, **options)
    return redis.Redis.from_url(settings.url, **options)
