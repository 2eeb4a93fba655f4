"""One configuration schema: every key of the connector's extra config and of each built-in
tier type is declared once (``kvoffload.settings``), README's key tables are what
``scripts/config_tables.py`` writes from those tables, errors name the key and the value,
and parsing has no side effects (folders and secrets are touched when a tier is built)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest

from kvoffload.settings import BOOL, NON_NEGATIVE_INT, POSITIVE_INT, REQUIRED, Key, Schema, one_of, seconds
from kvoffload.tiers.fs.tier import FS_KEYS, FSTierType
from kvoffload.tiers.redis.tier import REDIS_KEYS
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers

ROOT = Path(__file__).resolve().parent
while not (ROOT / "scripts" / "config_tables.py").exists():
    ROOT = ROOT.parent


def _script():
    spec = importlib.util.spec_from_file_location("config_tables", ROOT / "scripts" / "config_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_key_tables_are_generated_from_the_schemas():
    pytest.importorskip("vllm")  # the connector's table lives in the vLLM integration
    readme = (ROOT / "README.md").read_text()
    assert _script().render(readme) == readme, "run: .venv/bin/python scripts/config_tables.py --write"


def test_the_script_rewrites_only_the_marked_regions(tmp_path):
    script = _script()
    script.TABLES = {"fs": script.TABLES["fs"]}
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- keys:fs -->\nstale\n<!-- /keys:fs -->\nafter\n")
    assert script.main(["--readme", str(readme)]) == 1  # differs: a check fails
    assert script.main(["--readme", str(readme), "--write"]) == 0
    text = readme.read_text()
    assert text.startswith('before\n<!-- keys:fs -->\n| `"type": "fs"` key | value | default | meaning |')
    assert text.endswith("<!-- /keys:fs -->\nafter\n") and "stale" not in text
    for name in FS_KEYS.names:
        assert f"| `{name}` |" in text
    assert script.main(["--readme", str(readme)]) == 0
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match=r"0 regions <!-- keys:fs -->"):
        script.main(["--readme", str(readme)])


def test_tier_types_take_exactly_the_keys_of_their_table():
    assert tuple(inspect.signature(FSTierType).parameters) == FS_KEYS.names
    for schema in (FS_KEYS, REDIS_KEYS):
        for key in schema.keys:
            assert key.meaning and "\n" not in key.meaning, key.name


@pytest.mark.parametrize(
    "kind, good, bad, message",
    [
        (POSITIVE_INT, [1, 10**12], [0, -1, True, 1.0, "1"], "k must be a positive int, got "),
        (NON_NEGATIVE_INT, [0, 5], [-1, False, None], "k must be a non-negative int, got "),
        (BOOL, [True, False], [1, 0, "yes", None], "k must be true or false, got "),
        (seconds(0, 0.1), [0, 0.1, 0.05], [1, -0.001, True, "0"], r"k must be seconds in \[0, 0.1\], got "),
        (one_of("auto", True, False, must="be 'auto', true or false"), ["auto", True], [1, 0, "x"],
         "k must be 'auto', true or false, got "),
    ],
)  # fmt: skip
def test_kinds_check_values_and_name_them(kind, good, bad, message):
    schema = Schema((Key("k", kind, None, "a key"),))
    for value in good:
        assert schema.parse({"k": value})["k"] == value
    for value in bad:
        with pytest.raises(ValueError, match="^" + message + re.escape(repr(value)) + "$"):
            schema.parse({"k": value})


def test_absent_keys_take_their_default_and_required_ones_are_named():
    keys = (Key("a", POSITIVE_INT, REQUIRED, "a", hint="the a"), Key("b", POSITIVE_INT, 3, "b"))
    schema = Schema(
        (*keys, Key("c", BOOL, None, "c")), unknown="unknown thing key(s) {unknown}; known: {known}"
    )
    assert schema.parse({"a": 1}) == {"a": 1, "b": 3, "c": None}
    with pytest.raises(ValueError, match=r"^a is required \(the a\)$"):
        schema.parse({})
    with pytest.raises(ValueError, match=r"^unknown thing key\(s\) \['x'\]; known: \['a', 'b', 'c'\]$"):
        schema.parse({"a": 1, "x": 2})
    with pytest.raises(ValueError, match="declared twice"):
        Schema((Key("a", BOOL, None, "a"), Key("a", BOOL, None, "a")))


def test_tier_errors_name_the_entry_the_key_and_the_value():
    with pytest.raises(
        ValueError, match=r"^secondary_tiers\[0\]: bytes_to_use must be a positive int, got 0$"
    ):
        parse_secondary_tiers([{"type": "fs", "root_dir": "/x", "bytes_to_use": 0}])
    with pytest.raises(ValueError, match=r"^secondary_tiers\[1\]: the fs tier needs 'root_dir'$"):
        parse_secondary_tiers([{"type": "fs", "root_dir": "/x", "bytes_to_use": 1}, {"type": "fs"}])
    with pytest.raises(ValueError, match=r"min_free_fraction must be a number in \[0, 1\), got 1$"):
        parse_secondary_tiers([{"type": "fs", "root_dir": "/x", "bytes_to_use": 1, "min_free_fraction": 1}])
    with pytest.raises(
        ValueError, match=r"^secondary_tiers\[0\]: the redis tier needs 'url' \(e\.g\. 'redis:"
    ):
        parse_secondary_tiers([{"type": "redis"}])
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['colour'\] for the redis tier; known: \['url',"
    ):
        parse_secondary_tiers([{"type": "redis", "url": "redis://h:1/0", "colour": 1}])


def test_connector_errors_name_the_key_and_the_value():
    config = pytest.importorskip("kvoffload.integrations.vllm.config")
    base = {"cpu_bytes_to_use": 1 << 20}
    fs = {"type": "fs", "root_dir": "/x", "bytes_to_use": 0}
    key = r"kv_connector_extra_config\['"
    for extra, message in [
        ({"idle_wait_s": 1}, key + r"idle_wait_s'\] must be seconds in \[0, 0.1\], got 1"),
        ({"secondary_tiers": [fs]},
         r"kv_connector_extra_config: secondary_tiers\[0\]: bytes_to_use must be a positive int, got 0"),
        ({"nope": 1}, r"unknown kv_connector_extra_config key\(s\) \['nope'\]; known: \['cpu_bytes_"),
        ({"eviction_policy": "x"}, key + r"eviction_policy'\]: unknown eviction policy 'x'"),
        ({"sync_stores": 1}, key + r"sync_stores'\] must be 'auto', true or false, got 1"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match="^" + message):
            config.parse_extra_config({**base, **extra}, 16)
    parsed = config.parse_extra_config({**base, "blocks_per_chunk": 2, "self_describing_kv_events": True}, 16)
    assert parsed.tiers.blocks_per_offload_block == 2 and parsed.kv_events == "self_describing"
    extra = {**base, "block_size": 32, "blocks_per_chunk": 2, "kv_events": "placeholder"}
    parsed = config.parse_extra_config(extra, 16)
    assert parsed.tiers.blocks_per_offload_block == 2 and parsed.kv_events == "placeholder"
    defaults = config.parse_extra_config(base, 16)
    assert defaults.tiers.blocks_per_offload_block == 1 and defaults.tiers.eviction_policy == "lru"
    assert defaults.sync_stores == "auto" and defaults.faults is None and defaults.tiers.secondary_tiers == ()
    assert config.EXTRA_CONFIG.names == config.KNOWN_KEYS
    assert not set(config.VLLM_ONLY_KEYS) & set(config.KNOWN_KEYS)


def test_parsing_an_fs_tier_creates_nothing_and_building_it_does(tmp_path):
    root = tmp_path / "not" / "yet"
    (tier,) = parse_secondary_tiers([{"type": "fs", "root_dir": root, "bytes_to_use": 1 << 20}])
    assert not (tmp_path / "not").exists()
    manager = tier.build_manager(TierContext(4096, {"model": "m"}), "lru")
    try:
        assert root.is_dir() and len(os.listdir(root)) == 1  # the namespace
        assert (root.stat().st_mode & 0o777) == 0o700
    finally:
        manager.close()


def test_a_root_dir_that_cannot_be_created_fails_the_build_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tier,) = parse_secondary_tiers(
        [{"type": "fs", "root_dir": str(blocker / "kv"), "bytes_to_use": 1 << 20}]
    )
    with pytest.raises(ValueError, match=f"root_dir '{blocker / 'kv'}' cannot be created"):
        tier.build_manager(TierContext(4096, {"model": "m"}), "lru")


def test_an_unset_password_env_parses_and_fails_the_build_naming_the_variable(monkeypatch):
    pytest.importorskip("redis")
    monkeypatch.delenv("KVO_SURELY_UNSET_VAR", raising=False)
    entry = {"type": "redis", "url": "redis://127.0.0.1:1/0", "password_env": "KVO_SURELY_UNSET_VAR"}
    (tier,) = parse_secondary_tiers([entry])
    context = TierContext(4096, {"model": "m"})
    message = r"redis tier redis://127.0.0.1:1/0: password_env names 'KVO_SURELY_UNSET_VAR', which is not set"
    with pytest.raises(ValueError, match=message):
        tier.build_manager(context, "lru")
    torch = pytest.importorskip("torch")
    from kvoffload.transfer import HostBlockPool, KVLayout

    pool = HostBlockPool(KVLayout([torch.empty((1, 4096), dtype=torch.uint8)]), 2, pin_memory=False)
    with pytest.raises(ValueError, match=message):
        tier.build_worker(context, pool)
