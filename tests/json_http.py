"""One JSON request over loopback HTTP, for the tests of servers kvoffload runs beside an
engine (the session control endpoint, vLLM's OpenAI server): ``(status, decoded body)``."""

from __future__ import annotations

import http.client
import json
from typing import Any


def call(
    port: int, method: str, path: str, body: Any = None, headers: dict | None = None, timeout: float = 120
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            method,
            path,
            None if body is None else json.dumps(body),
            {"Content-Type": "application/json", **(headers or {})},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()
