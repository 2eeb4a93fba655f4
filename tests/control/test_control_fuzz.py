"""Fuzzing the parsers of outside input of the session controls: requests' kv_hints
payloads and kv_transfer_params, and the control endpoint's paths, queries and bodies.
Whatever comes in, the answer is a reading or a refusal, never another exception."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_control_endpoint import make_registry

from fuzzing import TIMEOUT, fuzz
from kvoffload.control.queue import ControlQueue
from kvoffload.control.server import ControlServer
from kvoffload.control.sessions import ControlError
from kvoffload.directives import ACTIONS, PARAMS_KEY, DirectiveReader

pytestmark = pytest.mark.timeout(TIMEOUT)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
NAMES = st.sampled_from([*ACTIONS, "kvoffload.other", "else.retain"]) | st.text(max_size=12)
KEYS = st.sampled_from(["ttl_s", "load_from", "store_to", "session_id", "retain_s", "release", "prefetch"])
PAYLOAD = st.dictionaries(KEYS | st.text(max_size=6), JSON, max_size=4) | JSON


@dataclass(frozen=True)
class Action:
    action_id: str
    action_type: Any
    action_version: Any
    payload: Any


ACTIONS_IN = st.lists(
    st.builds(Action, st.text(max_size=4), NAMES, st.sampled_from(["1", "2", 1, None]), PAYLOAD), max_size=5
)


PARAMS_IN = st.none() | st.dictionaries(st.just(PARAMS_KEY) | KEYS, PAYLOAD, max_size=3)
MAYBE_TEXT = st.none() | st.text(max_size=5)


@fuzz(200)
@given(actions=ACTIONS_IN, params=PARAMS_IN, session=MAYBE_TEXT, salt=MAYBE_TEXT)
def test_any_hint_is_read_counted_or_refused(actions, params, session, salt):
    reader = DirectiveReader(frozenset({"CPU", "DISK"}))
    reading = reader.read("r", session, salt, params, actions)
    counts = reader.counts
    read_params = int(bool(params) and PARAMS_KEY in params and params[PARAMS_KEY] is not None)
    sorted_out = len(reading.applied) + len(reading.unknown) + len(reading.invalid)
    assert counts.applied + counts.unknown + counts.invalid == sorted_out
    assert (
        len(actions) + read_params <= sorted_out <= len(actions) + read_params + 3
    )  # + controls w/o session
    d = reading.directives
    assert d.retain_s is None or d.retain_s > 0
    assert d.tiers.load_from is None or d.tiers.load_from <= {"CPU", "DISK"}


SHAPED = st.builds(
    "/sessions/{}{}".format,
    st.sampled_from(["chat", "%2F", "x%20y"]) | st.text(max_size=6),
    st.sampled_from(["", "/retain", "/release", "/prefetch", "/x", "/retain/x"]),
)
PATHS = (
    SHAPED
    | st.just("/prefetch")
    | st.lists(
        st.sampled_from(["sessions", "chat", "retain", "release", "prefetch", "", "%2F", "x y"])
        | st.text(max_size=6),
        max_size=4,
    ).map(lambda parts: "/" + "/".join(parts))
)


QUERY = st.dictionaries(st.sampled_from(["tenant", "x"]), st.lists(st.text(max_size=5), max_size=2))
BODY = st.dictionaries(st.sampled_from(["tenant", "ttl_s", "token_ids", "x"]), JSON, max_size=3)


@pytest.fixture(scope="module")
def server():
    registry = make_registry()
    served = ControlServer(ControlQueue(threading.Lock(), grace_s=0), registry, port=0, timeout_s=2.0,
                           keys_of=lambda tenant, tokens: [])  # fmt: skip
    yield served
    served.close()


@fuzz(200)
@given(method=st.sampled_from(["GET", "POST"]), path=PATHS, query=QUERY, body=BODY)
def test_any_control_request_is_answered_or_refused(server, method, path, query, body):
    try:
        answer = server.handle(method, path, query, body)
    except ControlError as exc:
        assert exc.status in (400, 404)
    except ValueError:  # a session id SessionId refuses: the server answers 400
        pass
    else:
        assert isinstance(answer, dict)


TENANTS = st.sampled_from(["tenant-a", "tenant-b", ""])


@fuzz(200)
@given(
    method=st.sampled_from(["GET", "POST"]),
    path=SHAPED | st.just("/prefetch"),
    named=TENANTS,
    scope=TENANTS,
    body=BODY,
)
def test_a_tenants_token_reaches_its_own_tenant_only(server, method, path, named, scope, body):
    """Whatever the request, one made with tenant ``scope``'s token that names another tenant is
    refused 403, and anything it is answered names ``scope``."""
    body = {**body, "tenant": named}
    query = {"tenant": [named]}
    try:
        answer = server.handle(method, path, query, body, scope)
    except ControlError as exc:
        assert exc.status in (400, 403, 404)
        assert (exc.status == 403) == (named != scope) or exc.status == 404 and "no such path" in str(exc)
    except ValueError:  # a session id SessionId refuses, after the tenant was let through
        assert named == scope
    else:
        assert named == scope and answer["tenant"] == scope
