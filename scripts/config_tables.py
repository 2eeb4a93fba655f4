"""README.md's configuration key tables, generated from the schemas that validate the keys.

    .venv/bin/python scripts/config_tables.py          # exit 1, with a diff, when README differs
    .venv/bin/python scripts/config_tables.py --write  # rewrite README's tables

Each table lies between marker comments, ``<!-- keys:NAME -->`` and ``<!-- /keys:NAME -->``;
only the text between them is rewritten. ``NAME`` is one of ``TABLES``: the connector's
extra config (``kvoffload.integrations.vllm.config.EXTRA_CONFIG``, needs vLLM installed) and
each built-in tier type's entry (``FS_KEYS``, ``REDIS_KEYS``, ``MOONCAKE_KEYS``, ``S3_KEYS``), and the SGLang
backend's extra config (``kvoffload.integrations.sglang.config.STORAGE_CONFIG``), and the session controls'
kv_hints actions and kv_transfer_params keys (``kvoffload.directives``). ``tests`` checks that
README.md is what this script writes.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _connector() -> str:
    from kvoffload.integrations.vllm.config import EXTRA_CONFIG, VLLM_ONLY_KEYS

    *most, last = (f"`{key}`" for key in VLLM_ONLY_KEYS)
    refused = f"{', '.join(most)} and {last}"
    return (
        EXTRA_CONFIG.markdown("extra-config key")
        + f"\nvLLM's `OffloadingConnector` keys {refused} have no meaning here: they are refused with a "
        "hint saying what to do instead.\n"
    )


def _fs() -> str:
    from kvoffload.tiers.fs.tier import FS_KEYS

    return FS_KEYS.markdown('`"type": "fs"` key')


def _redis() -> str:
    from kvoffload.tiers.redis.tier import REDIS_KEYS

    return REDIS_KEYS.markdown('`"type": "redis"` key')


def _mooncake() -> str:
    from kvoffload.tiers.mooncake.tier import MOONCAKE_KEYS

    return MOONCAKE_KEYS.markdown('`"type": "mooncake"` key')


def _s3() -> str:
    from kvoffload.tiers.s3.tier import S3_KEYS

    return S3_KEYS.markdown('`"type": "s3"` key')


def _actions() -> str:
    from kvoffload.directives import ACTION_MEANINGS, ACTION_VERSION, ACTIONS

    lines = ["| `action_type` | `action_version` | payload | meaning |", "|---|---|---|---|"]
    for name, schema in ACTIONS.items():
        keys = (
            "; ".join(f"`{k.name}` ({k.kind.shown}; {k.default_text()}): {k.meaning}" for k in schema.keys)
            or "`{}`"
        )
        cells = (f"`{name}`", f'`"{ACTION_VERSION}"`', keys, ACTION_MEANINGS[name])
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _session_params() -> str:
    from kvoffload.directives import PARAMS, PARAMS_KEY

    return PARAMS.markdown(f'`kv_transfer_params["{PARAMS_KEY}"]` key')


def _sglang() -> str:
    from kvoffload.integrations.sglang.config import STORAGE_CONFIG

    return STORAGE_CONFIG.markdown("extra-config key")


TABLES: dict[str, Callable[[], str]] = {
    "connector": _connector,
    "fs": _fs,
    "sglang": _sglang,
    "redis": _redis,
    "mooncake": _mooncake,
    "s3": _s3,
    "session-actions": _actions,
    "session-params": _session_params,
}


def render(readme: str) -> str:
    """``readme`` with every table region rewritten; ``ValueError`` when a region's markers
    are missing or appear twice."""
    for name, table in TABLES.items():
        pattern = re.compile(rf"(<!-- keys:{name} -->\n)(.*?)(<!-- /keys:{name} -->)", re.DOTALL)
        found = len(pattern.findall(readme))
        if found != 1:
            raise ValueError(f"README.md has {found} regions <!-- keys:{name} --> ... <!-- /keys:{name} -->")
        text = table()
        readme = pattern.sub(lambda m, text=text: m.group(1) + text + m.group(3), readme)
    return readme


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md's tables")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    current = args.readme.read_text()
    wanted = render(current)
    if wanted == current:
        return 0
    if args.write:
        args.readme.write_text(wanted)
        print(f"rewrote the key tables of {args.readme}")
        return 0
    diff = difflib.unified_diff(current.splitlines(True), wanted.splitlines(True), "README.md", "generated")
    sys.stdout.writelines(diff)
    print(f"\n{args.readme}'s key tables differ from the schemas: run scripts/config_tables.py --write")
    return 1


if __name__ == "__main__":
    sys.exit(main())
