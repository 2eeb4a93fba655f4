"""The budget and seed of the fuzz tests (``tests/fuzz/``).

``make test`` runs them with a fixed seed and a small budget (the folder in well under a
minute); ``make fuzz`` runs the same tests with ``KVOFFLOAD_FUZZ_SCALE`` times as many
examples each and a seed of its own (``KVOFFLOAD_FUZZ_SEED``, printed by the target), so a
longer run explores inputs the short one never drew. What a long run found is recorded in
``notes/fuzzing.md``. No example database: a run depends on its seed and budget only.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, seed, settings

SCALE = float(os.environ.get("KVOFFLOAD_FUZZ_SCALE", "1"))
SEED = int(os.environ.get("KVOFFLOAD_FUZZ_SEED", "0"))
TIMEOUT = round(300 * max(1.0, SCALE))  # a test's hang guard (pytest-timeout), scaled with it


def fuzz(examples: int):
    """Hypothesis settings for a fuzz test of ``examples`` examples at scale 1."""

    def wrap(test):
        test = settings(
            max_examples=max(1, round(examples * SCALE)),
            deadline=None,  # a loaded machine is slow, never wrong
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(test)
        return seed(SEED)(test)

    return wrap
