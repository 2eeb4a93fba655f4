"""``s3_replicas``: engine halves of the object tier (``s3_replica.Replica``) against one
real S3 server (``s3_server``), closed after the test."""

from __future__ import annotations

import pytest

from s3_replica import POOLS, Replica
from s3_server import S3Server


@pytest.fixture
def s3_server(tmp_path):
    server = S3Server(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def s3_replicas(s3_server):
    made = []

    def make(layout: str = "one buffer", **options):
        pool = POOLS[layout](seed=len(made))
        made.append(Replica(s3_server, seed=len(made), pool=pool, **options))
        return made[-1]

    yield make
    for replica in made:
        replica.close()
