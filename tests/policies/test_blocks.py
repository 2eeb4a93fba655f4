"""``kvoffload.policies.blocks``: the C block table and recency lists against the Python
versions (same results for the same calls), their contracts, and the CPU tier run on
either giving the same hits, evictions and events."""

from __future__ import annotations

import gc
import random
import sys

import pytest

import kvoffload.cpu as cpu_module
import kvoffload.policies.arc as arc_module
import kvoffload.policies.lru as lru_module
import kvoffload.policies.s3fifo as s3fifo_module
import kvoffload.policies.turnlru as turnlru_module
import kvoffload.policies.wtinylfu as wtinylfu_module
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import RequestContext
from kvoffload.policies import blocks, resolve_policy

PY = blocks.PYTHON_VERSIONS
native = pytest.mark.skipif(not blocks.NATIVE, reason="kvoffload.policies._blocks not built")


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


IMPLEMENTATIONS = [pytest.param(PY, id="python"), pytest.param(vars(blocks), id="native", marks=native)]


def random_ops(seed: int, impl: dict, steps: int = 600) -> list:
    """A random run of every Order method and batch path; what each call answered."""
    rng = random.Random(seed)
    make, order = impl["BlockStatus"], impl["Order"]
    lists = [order() for _ in range(4)]  # T1, T2, B1, B2 for arc_touch / arc_insert
    table: dict = {}
    seen = []
    for _ in range(steps):
        op = rng.randrange(15)
        a, b = rng.sample(range(4), 2)
        keys = ks(*rng.sample(range(30), rng.randint(0, 6)))
        if op == 0:
            new = [key for key in keys if all(key not in o.table for o in lists)]
            lists[a].insert_many(new, [make(i, rng.choice((-1, 0, 0, 2))) for i in range(len(new))])
        elif op == 1:
            seen.append(lists[a].move_to_end_reversed(keys + keys[:2]))
        elif op == 2:
            got = lists[a].evictable(rng.randint(0, 5), set(keys))
            seen.append(got)
            if rng.random() < 0.5:
                lists[a].pop_many(got)
        elif op == 3:
            seen.append([lists[a].remove(key) for key in keys])
        elif op == 4:
            lists[a].take_from(lists[b], keys)
        elif op == 5:
            lists[a].trim(rng.randint(0, 12))
        elif op == 6:
            seen.append(lists[0].arc_touch(*lists[1:], keys, rng.choice((0.0, 2.5, 9.0)), 10.0))
        elif op == 7:
            new = [key for key in keys if key not in lists[0].table and key not in lists[1].table]
            lists[0].arc_insert(*lists[1:], new, [make(i, 0) for i in range(len(new))])
        elif op == 8:
            new = [key for key in keys if key not in table]
            statuses = impl["reserve"](table, new, range(len(new)))
            seen.append([(s.slot, s.ref) for s in statuses])
            seen.append(impl["complete"](table, keys[: len(keys) // 2]))
        elif op == 9:
            seen.append(impl["pin"](table, keys + keys[:1]))
        elif op == 10:
            seen.append(impl["unpin"](table, keys[:3]))
        elif op == 11:
            seen.append(impl["lookup_prefix"](table, keys))
        elif op == 13:
            target = rng.choice((0.0, 2.5, 9.0))
            seen.append(lists[0].arc_evict(*lists[1:], rng.randint(1, 4), set(keys), target, 6))
        elif op == 12:
            seen.append(impl["absent"](table, keys + keys[::-1]))
        else:
            free = [99]
            impl["release"](table, [key for key in keys if key in table and table[key].ref == 0], free)
            seen.append(free)
        seen.append([o.keys() for o in lists] + [len(o) for o in lists])
        seen.append(sorted((key, s.ref) for key, s in table.items()))
    return seen


@native
@pytest.mark.parametrize("seed", range(40))
def test_native_answers_every_call_as_the_python_version(seed):
    assert random_ops(seed, vars(blocks)) == random_ops(seed, PY)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_order_moves_keys_and_finds_idle_ones(impl):
    order, make = impl["Order"](), impl["BlockStatus"]
    statuses = [make(i, 0) for i in range(5)]
    order.insert_many(ks(0, 1, 2, 3, 4), statuses)
    assert order.move_to_end_reversed(ks(3, 9, 1)) == ks(9)  # 1 then 3 to the end: 3 is most recent
    assert order.keys() == ks(0, 2, 4, 1, 3) and len(order) == 5
    statuses[2].ref, statuses[4].ref = -1, 2  # in flight, pinned: never evictable
    assert order.evictable(3, {k(0)}) == ks(1, 3) and order.keys() == ks(0, 2, 4, 1, 3)
    order.pop_many(ks(1, 7))
    assert order.remove(k(3)) and not order.remove(k(3))
    assert sorted(order.table) == ks(0, 2, 4)
    replacement = make(9, 0)
    order.insert_many(ks(2), [replacement])  # a key present keeps its place
    assert order.keys() == ks(0, 2, 4) and order.table[k(2)] is replacement


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_batch_paths_are_all_or_nothing(impl):
    table: dict = {}
    statuses = impl["reserve"](table, ks(1, 2, 3), [5, 6, 7])
    assert [(s.slot, s.ref) for s in statuses] == [(5, -1), (6, -1), (7, -1)]
    assert impl["lookup_prefix"](table, ks(1, 2)) == (0, False)  # in flight: pending, no miss
    assert impl["complete"](table, ks(1, 1, 2, 9)) == ks(1, 2)  # each once; 9 absent
    assert impl["lookup_prefix"](table, ks(1, 2, 3)) == (2, False)
    assert impl["lookup_prefix"](table, ks(1, 8, 2)) == (1, True)
    assert impl["pin"](table, ks(1, 3)) is None and table[k(1)].ref == 0  # 3 is in flight
    assert impl["pin"](table, ks(1, 1, 2)) == ([5, 5, 6], 2)
    assert impl["unpin"](table, ks(2, 2)) is None  # pinned once only
    assert (table[k(1)].ref, table[k(2)].ref) == (2, 1)
    assert impl["unpin"](table, ks(1, 2)) == 1 and impl["unpin"](table, ks(1)) == 1
    assert [table[key].ref for key in ks(1, 2, 3)] == [0, 0, -1]
    assert impl["absent"](table, ks(4, 1, 4, 5, 3)) == ks(4, 5)
    free = [0]
    impl["release"](table, ks(3, 1), free)
    assert free == [0, 7, 5] and sorted(table) == ks(2)
    with pytest.raises(KeyError):
        impl["release"](table, ks(3), free)


@native
def test_native_rejects_what_it_cannot_hold():
    order, other = blocks.Order(), blocks.Order()
    status = blocks.BlockStatus(0, 0)
    with pytest.raises(ValueError, match="2 keys but 1 statuses"):
        order.insert_many(ks(1, 2), [status])
    order.insert_many(ks(1), [status])
    with pytest.raises(ValueError, match="in an order already"):
        other.insert_many(ks(2), [status])
    with pytest.raises(KeyError, match="resident already"):
        order.arc_insert(other, blocks.Order(), blocks.Order(), ks(1), [blocks.BlockStatus(1, 0)])
    with pytest.raises(TypeError):
        blocks.Order(1)
    assert repr(status) == "BlockStatus(slot=0, ref=0)" and status.is_ready


class Live:
    """A status of another kind (as the disk tier's): ``ref`` read from outside."""

    def __init__(self, state: list, slot: int) -> None:
        self.state, self.slot = state, slot

    @property
    def ref(self) -> int:
        return self.state[self.slot]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_order_takes_any_status_with_a_ref_and_reads_it_live(impl):
    state = [0, 0, 0]
    order = impl["Order"]()
    order.insert_many(ks(0, 1, 2), [Live(state, i) for i in range(3)])
    state[0] = -1
    assert order.evictable(2, ()) == ks(1, 2)
    state[0], state[1] = 0, 3
    assert order.evictable(2, ()) == ks(0, 2) and order.table[k(1)].ref == 3
    order.pop_many(ks(0))
    assert order.keys() == ks(1, 2)


@native
def test_native_order_holds_no_reference_after_it_lets_go():
    key = b"x" * 12
    status = blocks.BlockStatus(3, 0)
    before = sys.getrefcount(key), sys.getrefcount(status)
    order = blocks.Order()
    for _ in range(100):
        order.insert_many([key], [status])
        order.move_to_end_reversed([key])
        assert order.evictable(1, ()) == [key]
        order.pop_many([key])
    assert (sys.getrefcount(key), sys.getrefcount(status)) == before
    order.insert_many([key], [status])
    del order  # unlinks what it held: the status may join another order
    gc.collect()
    assert (sys.getrefcount(key), sys.getrefcount(status)) == before
    again = blocks.Order()
    again.insert_many([key], [status])
    assert again.keys() == [key]
    live = Live([0], 0)  # linked through a proxy, which goes with its entry
    before = sys.getrefcount(live)
    again.insert_many([b"y"], [live])
    again.pop_many([b"y"])
    assert sys.getrefcount(live) == before


def replay(policy: str, seed: int) -> tuple:
    """A random lifecycle run of the CPU tier: every answer, event and counter."""
    rng = random.Random(seed)
    m = CPUOffloadingManager(24, policy, enable_events=True)
    answers = []
    for i in range(300):
        keys = ks(*range(rng.randrange(20), rng.randrange(20) + rng.randint(1, 12)))
        ctx = RequestContext(str(i))
        m.on_new_request(ctx)
        h = m.lookup_prefix(keys)
        m.touch(keys)
        if h:
            answers.append(m.prepare_load(keys[:h]).block_ids.tolist())
            m.complete_load(keys[:h])
        out = m.prepare_store(keys[h:])
        if out is not None:
            answers.append((out.keys_to_store, out.store_spec.block_ids.tolist(), out.evicted_keys))
            m.complete_store(out.keys_to_store, success=rng.random() < 0.9)
        m.on_request_finished(ctx, [keys], frozenset(), frozenset(keys[:h]))
        answers.append((h, m.take_events()))
    return answers, m.stats()


def on_python(monkeypatch) -> None:
    """Every user of the C paths switched to the Python versions."""
    for module in (lru_module, arc_module, s3fifo_module, turnlru_module, wtinylfu_module):
        monkeypatch.setattr(module, "Order", PY["Order"])
    for name in ("lookup_prefix", "pin", "unpin", "complete", "reserve", "absent", "release"):
        monkeypatch.setattr(cpu_module, f"_{name}", PY[name])
    for module in (s3fifo_module, turnlru_module, wtinylfu_module):
        for name, function in module.PYTHON_VERSIONS.items():
            monkeypatch.setattr(module, name, function)


@native
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "turnlru", "wtinylfu"])
def test_cpu_tier_gives_the_same_answers_on_c_and_python(policy, monkeypatch):
    on_c = replay(policy, 7)
    on_python(monkeypatch)
    assert on_c == replay(policy, 7)
    assert on_c[1].evictions > 50 and on_c[1].hits > 100  # it evicted and hit, on both


def drive(policy: str, seed: int) -> list:
    """A policy alone under random calls, busy and protected keys included (so evictions
    fail and are undone): every answer and the state of each status."""
    rng = random.Random(seed)
    p = resolve_policy(policy)(12)
    statuses: dict = {}
    seen = []
    for i in range(400):
        op = rng.randrange(5)
        keys = ks(*rng.sample(range(40), rng.randint(1, 6)))
        if op == 0:
            new = [key for key in keys if key not in statuses]
            made = [blocks.BlockStatus(j, rng.choice((-1, 0, 0, 0, 1))) for j in range(len(new))]
            p.insert_many(new, made)
            statuses.update(zip(new, made))
        elif op == 1:
            p.touch(keys)
        elif op == 2:
            ctx = RequestContext(str(i))
            p.on_new_request(ctx)
            p.touch(keys)
            p.on_request_finished(ctx, [keys], frozenset(keys[:2]), frozenset())
        elif op == 3:
            victims = p.evict(rng.randint(1, 4), set(keys[:2]))
            seen.append(("evict", victims))
            for key in victims or ():
                del statuses[key]
        else:
            key = rng.choice(keys)
            if key in statuses and statuses[key].ref == -1:
                p.remove(key)
                del statuses[key]
            for status in rng.sample(list(statuses.values()), min(3, len(statuses))):
                status.ref = rng.choice((-1, 0, 0, 2))
        seen.append(sorted((key, s.ref) for key, s in statuses.items()))
    seen.append(getattr(p, "target_t1", None))
    return seen


@native
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "turnlru", "wtinylfu"])
@pytest.mark.parametrize("seed", range(8))
def test_policies_choose_the_same_victims_on_c_and_python(policy, seed, monkeypatch):
    on_c = drive(policy, seed)
    on_python(monkeypatch)
    assert on_c == drive(policy, seed)
    evictions = [entry[1] for entry in on_c if isinstance(entry, tuple) and entry[0] == "evict"]
    assert None in evictions and len([v for v in evictions if v]) > 20  # some failed, many did not
