"""kvoffload's kv_hints actions and kv_transfer_params key, read into SessionDirectives."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest

from kvoffload.directives import ACTION_VERSION, ACTIONS, DirectiveReader
from kvoffload.sessions import NO_DIRECTIVES, SessionId, TierChoice


@dataclass(frozen=True)
class Action:  # vLLM's KvHintAction's fields
    action_id: str
    action_type: str
    action_version: str
    payload: Any


def act(kind: str, payload: Any = None, version: str = ACTION_VERSION, action_id: str = "a1") -> Action:
    return Action(action_id, kind, version, {} if payload is None else payload)


def read(reader=None, session="s1", salt=None, params=None, actions=()):
    return (reader or DirectiveReader(frozenset({"CPU", "DISK"}))).read("r1", session, salt, params, actions)


def test_every_action_of_version_1():
    reading = read(
        actions=[
            act("kvoffload.retain", {"ttl_s": 30}, action_id="a"),
            act("kvoffload.release", action_id="b"),
            act("kvoffload.prefetch", action_id="c"),
            act("kvoffload.tiers", {"load_from": ["cpu"], "store_to": []}, action_id="d"),
        ]
    )
    d = reading.directives
    assert d.session == SessionId("", "s1")
    assert (d.retain_s, d.release, d.prefetch) == (30.0, True, True)
    assert d.tiers == TierChoice(frozenset({"CPU"}), frozenset()) and d.tiers.stores_nowhere
    assert reading.applied == ("a", "b", "c", "d") and not reading.unknown and not reading.invalid
    assert set(ACTIONS) == {"kvoffload.retain", "kvoffload.release", "kvoffload.prefetch", "kvoffload.tiers"}


def test_the_tenant_is_the_cache_salt():
    assert read(salt="tenant-a", actions=[act("kvoffload.prefetch")]).directives.session == SessionId(
        "tenant-a", "s1"
    )


def test_unknown_types_and_versions_are_counted_and_ignored(caplog):
    reader = DirectiveReader()
    with caplog.at_level(logging.WARNING):
        reading = read(
            reader,
            actions=[
                act("kvoffload.retain", {"ttl_s": 5}, version="2", action_id="v2"),
                act("kvcr.pin", {"x": 1}, action_id="other"),
                act("kvoffload.evict_now", action_id="nope"),
                act("kvoffload.prefetch", action_id="ok"),
            ],
        )
    assert reading.unknown == ("v2", "other", "nope") and reading.applied == ("ok",)
    assert reading.directives.retain_s is None and reading.directives.prefetch
    assert (reader.counts.applied, reader.counts.unknown, reader.counts.invalid) == (1, 3, 0)
    assert not caplog.records  # someone else's actions are no reason to warn


@pytest.mark.parametrize(
    ("action", "named"),
    [
        (act("kvoffload.retain", {"ttl_s": -1}), "-1"),
        (act("kvoffload.retain", {"ttl_s": "30"}), "'30'"),
        (act("kvoffload.retain", {"ttl_s": float("inf")}), "inf"),
        (act("kvoffload.retain", {"ttl_s": True}), "True"),
        (act("kvoffload.retain", {}), "ttl_s"),
        (act("kvoffload.retain", {"ttl_s": 1, "pin": True}), "pin"),
        (act("kvoffload.retain", [30]), "[30]"),
        (act("kvoffload.tiers", {"load_from": "CPU"}), "'CPU'"),
        (act("kvoffload.tiers", {"store_to": ["NVME"]}), "NVME"),
        (act("kvoffload.release", {"now": True}), "now"),
    ],
)
def test_a_bad_payload_is_one_warning_naming_it_and_has_no_effect(caplog, action, named):
    reader = DirectiveReader(frozenset({"CPU", "DISK"}))
    with caplog.at_level(logging.WARNING):
        reading = read(reader, actions=[action, act("kvoffload.prefetch", action_id="fine")])
    (record,) = caplog.records
    assert named in record.getMessage() and "r1" in record.getMessage() and "a1" in record.getMessage()
    d = reading.directives
    assert (d.retain_s, d.release, d.tiers) == (None, False, TierChoice())
    assert d.prefetch  # the request's other actions still apply
    assert reading.invalid == ("a1",) and reader.counts.invalid == 1


def test_kv_transfer_params():
    params = {
        "do_remote_prefill": False,  # vLLM's own keys are not read
        "kvoffload": {"session_id": "chat-7", "retain_s": 60, "prefetch": True, "store_to": ["DISK"]},
    }
    reading = read(session=None, salt="t", params=params)
    d = reading.directives
    assert d.session == SessionId("t", "chat-7") and d.retain_s == 60.0 and d.prefetch and not d.release
    assert d.tiers == TierChoice(None, frozenset({"DISK"}))
    assert reading.applied == ("kv_transfer_params",)
    assert reading.report() == {
        "session_id": "chat-7",
        "retain_s": 60.0,
        "prefetch": True,
        "store_to": ["DISK"],
        "applied": ["kv_transfer_params"],
    }


def test_kv_hints_win_over_kv_transfer_params():
    reading = read(params={"kvoffload": {"retain_s": 60}}, actions=[act("kvoffload.retain", {"ttl_s": 5})])
    assert reading.directives.retain_s == 5.0


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"kvoffload": {"retain_s": 0}}, "0"),
        ({"kvoffload": {"release": "yes"}}, "'yes'"),
        ({"kvoffload": {"ttl_s": 5}}, "ttl_s"),
        ({"kvoffload": "retain"}, "'retain'"),
        ({"kvoffload": {"session_id": "other"}}, "'other'"),  # the request says s1
        ({"kvoffload": {"session_id": ""}}, "''"),
    ],
)
def test_bad_kv_transfer_params_warn_and_do_nothing(caplog, params, named):
    with caplog.at_level(logging.WARNING):
        reading = read(params=params)
    (record,) = caplog.records
    assert named in record.getMessage()
    assert reading.invalid == ("kv_transfer_params",)
    assert reading.directives.session == SessionId("", "s1") and reading.directives.retain_s is None


def test_session_controls_need_a_session(caplog):
    with caplog.at_level(logging.WARNING):
        reading = read(
            session=None, actions=[act("kvoffload.retain", {"ttl_s": 5}), act("kvoffload.tiers", {})]
        )
    assert "retain_s needs a session id" in caplog.records[0].getMessage()
    assert reading.directives.retain_s is None and reading.directives.session is None
    assert reading.invalid == ("retain_s",)


def test_nothing_said_is_no_directives():
    assert read(session=None).directives is NO_DIRECTIVES
    plain = read().directives  # a session alone: the scheduler learns its keys
    assert plain.session == SessionId("", "s1") and plain.retain_s is None and not plain.prefetch
