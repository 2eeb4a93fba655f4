"""A shared tier's job is checked before anything moves (``check_job``), with errors that
name the bad value; a good job comes back as its direction, host ids and keys."""

from __future__ import annotations

import pytest

from kvoffload.specs import MEDIUM_CPU, MEDIUM_MOONCAKE, CPULoadStoreSpec, DiskLoadStoreSpec
from kvoffload.tiers.mooncake.names import MooncakeLoadStoreSpec
from kvoffload.tiers.shared_store_jobs import check_job

DIRECTIONS = {(MEDIUM_CPU, MEDIUM_MOONCAKE): "put", (MEDIUM_MOONCAKE, MEDIUM_CPU): "get"}
KEYS = [b"k1", b"k2"]


def check(src, dst):
    return check_job("W", DIRECTIONS, MooncakeLoadStoreSpec, 7, src, dst, num_blocks=4)


def test_a_good_job_gives_its_direction_host_ids_and_keys() -> None:
    host, remote = CPULoadStoreSpec([3, 0]), MooncakeLoadStoreSpec(KEYS)
    assert check(host, remote) == ("put", [3, 0], KEYS)
    assert check(remote, host) == ("get", [3, 0], KEYS)


@pytest.mark.parametrize(
    "src, dst, error, named",
    [
        (CPULoadStoreSpec([0, 1]), CPULoadStoreSpec([2, 3]), TypeError, "W does not move CPU -> CPU jobs"),
        (CPULoadStoreSpec([0]), MooncakeLoadStoreSpec(KEYS), ValueError, "1 host blocks but 2 keys in job 7"),
        (CPULoadStoreSpec([0, 4]), MooncakeLoadStoreSpec(KEYS), ValueError, "host block id 4 out of range"),
        (MooncakeLoadStoreSpec(KEYS), CPULoadStoreSpec([-1, 0]), ValueError, "host block id -1 out of range"),
    ],
)
def test_a_bad_job_is_refused_naming_the_value(src, dst, error, named) -> None:
    with pytest.raises(error, match=named):
        check(src, dst)


def test_a_spec_of_another_class_is_refused() -> None:
    disk = DiskLoadStoreSpec([0, 1], KEYS)
    disk.medium = MEDIUM_MOONCAKE  # the right medium, the wrong class
    with pytest.raises(TypeError, match="expected a CPU and a MooncakeLoadStoreSpec"):
        check(CPULoadStoreSpec([0, 1]), disk)
