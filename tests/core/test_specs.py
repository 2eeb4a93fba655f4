"""kvoffload.specs: the CPU spec's ids, kept until read, read as the ids given then."""

from __future__ import annotations

import pickle

import numpy as np

from kvoffload.specs import CPULoadStoreSpec


def test_cpu_spec_reads_int64_ids_in_the_order_given():
    spec = CPULoadStoreSpec([5, 1, 9])
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == [5, 1, 9]
    assert spec.block_ids is spec.block_ids  # made once
    assert repr(spec) == "CPULoadStoreSpec([5, 1, 9])"
    assert CPULoadStoreSpec([]).block_ids.tolist() == []


def test_cpu_spec_keeps_the_ids_it_was_given_not_the_callers_list():
    slots = [3, 4]
    spec = CPULoadStoreSpec(slots)
    slots.append(7)  # the caller reuses its list before anyone read the spec
    slots[0] = 99
    assert spec.block_ids.tolist() == [3, 4]


def test_cpu_spec_from_an_array_and_through_pickle():
    host = np.arange(10, dtype=np.int32)
    spec = CPULoadStoreSpec(host[2:5])
    assert spec.block_ids.dtype == np.int64 and spec.block_ids.tolist() == [2, 3, 4]
    unread = pickle.loads(pickle.dumps(CPULoadStoreSpec([8, 6])))  # (sent to a worker process)
    assert unread.block_ids.tolist() == [8, 6]
