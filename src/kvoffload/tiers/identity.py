"""The canonical text of a tier's identity (``TierContext.identity``): what every tier
hashes into the namespace that keeps engines with other byte layouts apart.

Values must be JSON-serialisable (str, int, float, bool, None, lists, dicts with str
keys): anything else is a ``TypeError`` naming the field, because a ``repr`` may differ
between processes. Keys are sorted, so the text does not depend on their order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def canonical_identity(identity: Mapping[str, Any]) -> str:
    for field, value in identity.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            what = f"namespace field {field!r} is not JSON-serialisable ({exc})"
            raise TypeError(f"{what}: {value!r}") from None
    return json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
