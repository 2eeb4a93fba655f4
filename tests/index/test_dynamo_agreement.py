"""Agreement with Dynamo's standalone KV indexer (``ai-dynamo-runtime==1.6.1``, run from
its own environment: ``tests/dynamo_env.py``) on the recorded event stream of real vLLM
engines running kvoffload.

Two engines (tiny Llama, vLLM's CPU build, a device cache of 52 blocks and a CPU tier of
80, so that both evict) serve six prompts each, with a subscriber recording every ZMQ
message they publish: instance 1 with the CPU tier over the local-disk tier (``type:
"fs"``), instance 2 with the CPU tier over the shared Redis tier (``type: "redis"``, a
``redis-server`` started by the test). The recordings are written to a file, then
replayed byte for byte (topic, sequence, payload) from one XPUB socket per instance to
both indexes at once: our ``kvoffload index serve`` API (``IndexServer``, in this
process) and ``python -m dynamo.indexer``, both registered for the same instances, model
and block size; a last batch with one fresh block per tier tells when both have applied
everything. Both then answer ``POST /query`` for the same token sequences (every prompt,
cut and extended, and unseen ones), and both ``/dump`` their holdings.

What agrees and what does not (assertions hold for any run; figures of one run: 62
queries x 2 instances):

* GPU tier: the same matched tokens per instance for every query, and the same ``scores``
  map (Mooncake RFC: device tokens per instance and rank); both hold the same 50 device
  blocks per instance.
* Host (CPU) tier: the same. Dynamo indexes a block only from its token ids; kvoffload
  once announced blocks promoted back into the CPU tier (from disk or the shared tier,
  after the CPU tier had evicted them and forgotten their tokens) in vLLM's placeholder
  form, which Dynamo skipped (14 of 80 CPU blocks per instance, 8 of 124 pairs
  differing). The scheduler now records a promoted block's tokens from the request that
  asked for it: no CPU block is announced in placeholder form, and the test still checks
  that any difference would be of that kind.
* Disk tier (instance 1): the same; kvoffload's disk-tier events carry no ``ownership``
  (as vLLM's own ``fs`` tier's), and Dynamo indexes them as its disk tier.
* Shared tier (instance 2): Dynamo 1.6.1 drops it (``locality="REMOTE"``; see
  ``test_dynamo_tiers.py``): its ``disk`` equals its ``cpu`` there, while ours holds
  every block the engine stored in its shared tier.
"""

from __future__ import annotations

import pickle
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import zmq  # noqa: E402

from dynamo_env import DynamoIndexer, dynamo_python_or_skip, http_call  # noqa: E402
from kvoffload.demo.offline import close_llm, kv_block_bytes, make_llm, settle, word_text  # noqa: E402
from kvoffload.events.codec import decode, encode  # noqa: E402
from kvoffload.events.types import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from kvoffload.index import BlockIndex, IndexServer, IndexService, TierWeights  # noqa: E402
from redis_server import RedisServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "tiny-llama"
BLOCK = 32  # the engine's block size, and the offloaded one (kvoffload's default)
FS, REDIS = 1, 2  # instance ids


@pytest.fixture(scope="module")
def dynamo() -> Path:
    return dynamo_python_or_skip()


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


class Recorder:
    """Binds a SUB socket (vLLM's publisher connects to a concrete tcp address) and keeps
    every message's frames as they came."""

    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self.frames.append(self._sock.recv_multipart())

    def close(self) -> list[list[bytes]]:
        deadline = time.monotonic() + 5  # what the engine sent last is still arriving
        n = -1
        while time.monotonic() < deadline and n != len(self.frames):
            n = len(self.frames)
            time.sleep(0.3)
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        return self.frames


def workload(seed: int) -> list[str]:
    """Six prompts: three share a 600-token system prompt, one is unrelated, one continues
    the first (a second turn), one more is unrelated: about 130 distinct blocks of 32
    tokens. The device cache holds 52 blocks, the CPU tier 80: both evict (the device
    first), the lower tier keeps everything."""
    rng = random.Random(seed)
    system = word_text(rng, 600)
    texts = [system + word_text(rng, 500) for _ in range(3)] + [word_text(rng, 900)]
    return texts + [texts[0] + word_text(rng, 300), word_text(rng, 900)]


def record(model: str, secondary: dict, texts: list[str]) -> tuple[list[list[bytes]], list[list[int]]]:
    from vllm import SamplingParams

    block = kv_block_bytes(model)
    recorder = Recorder()
    prompts = []
    try:
        llm = make_llm(
            model,
            kvoffload={"cpu_bytes_to_use": 80 * block, "secondary_tiers": [secondary]},
            kv_cache_bytes=52 * block,
            max_model_len=1600,
            events_endpoint=f"tcp://127.0.0.1:{recorder.port}",
        )
        try:
            for text in texts:
                out = llm.generate([text], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
                prompts.append(list(out.prompt_token_ids))
                for _ in range(3):
                    settle(llm)  # stores and the write-through below finish between prompts
        finally:
            close_llm(llm)
    finally:
        frames = recorder.close()
    return frames, prompts


@pytest.fixture(scope="module")
def recording(model, tmp_path_factory):
    """Both engines' streams, recorded to a file once, and the prompts they served."""
    folder = tmp_path_factory.mktemp("recording")
    server = RedisServer(folder).start()
    try:
        fs_tier = {
            "type": "fs",
            "root_dir": str(folder / "kv"),
            "bytes_to_use": 400 * (kv_block_bytes(model) + 4096),
        }
        redis_tier = {"type": "redis", "url": server.url, "timeout_s": 1.0, "connect_timeout_s": 0.5}
        streams = {FS: record(model, fs_tier, workload(7)), REDIS: record(model, redis_tier, workload(8))}
    finally:
        server.stop()
    path = folder / "streams.pickle"
    path.write_bytes(pickle.dumps(streams))
    return path


def events_of(frames: list[list[bytes]]):
    return [e for frame in frames for e in decode(frame[2]).events]


class Replayer:
    """One XPUB socket per instance; sends a recorded stream once every expected
    subscriber has subscribed (an XPUB hears each subscription, so nothing is sent into
    the void)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # each subscriber's "" subscription, not just the first
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    def wait_subscribers(self, n: int, timeout: float = 30.0) -> None:
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {seen} of {n} subscribers connected to {self.endpoint}")
            if self.sock.poll(100) and self.sock.recv()[:1] == b"\x01":
                seen += 1

    def send(self, frames: list[list[bytes]]) -> None:
        for frame in frames:
            self.sock.send_multipart(frame)

    def close(self) -> None:
        self.sock.close(linger=1000)


SENTINEL_FORMS = (("gpu", "GPU", None), ("cpu", "CPU", None), ("disk", "STORAGE", "LOCAL"))


def sentinel_hash(instance: int, t: int) -> int:
    return 2**63 + 10 * instance + t


def sentinel(frames: list[list[bytes]], instance: int) -> tuple[list[bytes], list[tuple[str, list[int]]]]:
    """A last batch after the recording: one block of fresh tokens in each tier Dynamo
    indexes (device, host, and disk in the form it accepts). Both indexes apply a
    publisher's batches in order (Dynamo each tier's share on a queue of its own), so
    once each tier answers for its block, the recording is in."""
    topic, seq, _ = frames[-1]
    events, marker = [], []
    for t, (tier, medium, locality) in enumerate(SENTINEL_FORMS):
        tokens = [50_000 + 10 * instance + t] * BLOCK
        h = sentinel_hash(instance, t)
        events.append(BlockStored([h], None, tokens, BLOCK, None, medium, None, locality=locality))
        marker.append((tier, tokens))
    next_seq = (int.from_bytes(seq, "big") + 1).to_bytes(8, "big")
    return [topic, next_seq, encode(KVEventBatch(time.time(), events))], marker


@pytest.fixture(scope="module")
def indexes(dynamo, recording, tmp_path_factory):
    """Dynamo's indexer and ours, both fed the recorded streams; yields ``(query, streams,
    dynamo, ours)`` where ``query(tokens)`` returns ``{instance: (Dynamo's tiers, ours)}``
    (``query(tokens, raw=True)``: that and both responses as they came)."""
    streams = pickle.loads(recording.read_bytes())
    log = tmp_path_factory.mktemp("dynamo") / "indexer.log"
    ctx = zmq.Context()
    replayers = {instance: Replayer(ctx) for instance in streams}
    service = IndexService(BlockIndex(TierWeights()), replay_timeout=0.5, idle_catch_up=0.2)
    with DynamoIndexer(dynamo, log) as dyn, IndexServer(service, "127.0.0.1", 0) as ours:
        for instance, replayer in replayers.items():
            body = {
                "instance_id": instance,
                "endpoint": replayer.endpoint,
                "model_name": MODEL,
                "block_size": BLOCK,
            }
            assert dyn.call("/register", body)[0] == 201
            assert call(ours, "/register", body)[0] == 201
        sentinels = {}
        for instance, replayer in replayers.items():
            frames, _ = streams[instance]
            replayer.wait_subscribers(2)
            last, marker = sentinel(frames, instance)
            replayer.send(frames + [last])
            sentinels[instance] = marker

        def query(tokens: list[int], raw: bool = False):
            body = {"token_ids": tokens, "model_name": MODEL}
            status, theirs = dyn.call("/query", body)
            assert status == 200, theirs
            status, mine = call(ours, "/query", body)
            assert status == 200, mine
            out = {}
            for instance in streams:
                # Dynamo leaves out instances matching nothing
                t = theirs.get("instances", {}).get(str(instance))
                m = mine["instances"][str(instance)]["dp"]["0"]
                out[instance] = (
                    {tier: (t or {}).get(tier, 0) for tier in ("gpu", "cpu", "disk")},
                    {tier: m[tier] for tier in ("gpu", "cpu", "disk", "shared")} | {"state": m["state"]},
                )
            return (out, theirs, mine) if raw else out

        deadline = time.monotonic() + 60
        for instance, marker in sentinels.items():
            for tier, tokens in marker:
                while True:
                    theirs, mine = query(tokens)[instance]
                    if theirs[tier] == mine[tier] == BLOCK:
                        break
                    assert time.monotonic() < deadline, (
                        f"the replay of instance {instance} did not arrive ({tier}): {theirs} {mine}"
                    )
                    time.sleep(0.1)
        yield query, streams, dyn, ours
    for replayer in replayers.values():
        replayer.close()
    ctx.term()


def call(server: IndexServer, path: str, body: object = None) -> tuple[int, object]:
    return http_call(server.url, path, body)


def queries(streams) -> list[list[int]]:
    """Every prompt either engine served, cut at a few lengths (on and off block
    boundaries), extended with tokens no engine saw, and two prompts no engine saw."""
    out = []
    rng = random.Random(3)
    for _, prompts in streams.values():
        for prompt in prompts:
            out += [
                prompt,
                prompt[:100],
                prompt[:640],
                prompt[:700],
                prompt + [rng.randrange(3, 200) for _ in range(200)],
            ]
    out.append([rng.randrange(3, 200) for _ in range(900)])
    out.append(list(range(10, 74)))
    return out


def dynamo_event_counters(dyn: DynamoIndexer) -> dict[str, float]:
    """Dynamo's non-zero ``kv_cache_events_applied`` and warning counters."""
    status, text = dyn.call("/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        if line.startswith("dynamo_kvrouter_kv_cache_event") and not line.endswith(" 0"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("dynamo_kvrouter_")] = float(value)
    return out


def placeholder_cpu_hashes(frames) -> set[int]:
    """CPU blocks kvoffload announced last in vLLM's placeholder form (no token ids)."""
    held: dict[int, bool] = {}
    for event in events_of(frames):
        if getattr(event, "medium", None) != "CPU":
            continue
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                held[h] = event.block_size == 0
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                held.pop(h, None)
    return {h for h, placeholder in held.items() if placeholder}


def test_the_recording_is_a_real_multi_tier_stream(indexes) -> None:
    """The streams are what the agreement is about: contiguous sequence numbers from 0,
    and GPU and CPU stores and removals, disk stores on instance 1, shared stores on 2."""
    _, streams, _, _ = indexes
    for instance, (frames, _) in streams.items():
        assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
        kinds = Counter(
            (type(e).__name__, e.medium, e.locality, e.ownership)
            for e in events_of(frames)
            if hasattr(e, "medium")
        )
        for kind in ("BlockStored", "BlockRemoved"):
            assert kinds[(kind, "GPU", None, None)] > 0 and kinds[(kind, "CPU", None, None)] > 0
        lower = ("STORAGE", "LOCAL", None) if instance == FS else ("STORAGE", "REMOTE", "redis")
        assert kinds[("BlockStored", *lower)] > 0


def test_gpu_and_host_tiers_agree_per_instance(indexes) -> None:
    """Same matched tokens per instance in the GPU tier for every query (and the same
    Mooncake-RFC ``scores`` map: device tokens per instance and rank, for the instances
    matching at least one block); in the host tier too, except where ours is longer
    because the host match runs through a block that kvoffload announced in placeholder
    form (Dynamo cannot index it: no token ids)."""
    query, streams, _, _ = indexes
    placeholders = {instance: placeholder_cpu_hashes(frames) for instance, (frames, _) in streams.items()}
    # promoted blocks are announced self-described: no CPU block in placeholder form
    assert placeholders == {FS: set(), REDIS: set()}
    from kvoffload.keys import BlockHasher, external_hash

    hasher = BlockHasher()
    compared = differing = matched_gpu = matched_cpu_beyond_gpu = 0
    for tokens in queries(streams):
        hashes = [external_hash(h) for h in hasher.hash_request(tokens, BLOCK)]
        answers, theirs_raw, mine_raw = query(tokens, raw=True)
        assert theirs_raw["scores"] == mine_raw["scores"], (len(tokens), theirs_raw, mine_raw)
        for instance, (theirs, mine) in answers.items():
            compared += 1
            assert mine["state"] == "EXACT"
            assert theirs["gpu"] == mine["gpu"], (instance, len(tokens), theirs, mine)
            matched_gpu += mine["gpu"] > 0
            matched_cpu_beyond_gpu += mine["cpu"] > mine["gpu"]
            if theirs["cpu"] != mine["cpu"]:
                differing += 1
                print(
                    f"host tier differs: instance {instance}, {len(tokens)} tokens: "
                    f"Dynamo {theirs}, ours {mine}"
                )
                # Dynamo stops at the first block it could not index; ours went on
                assert theirs["cpu"] < mine["cpu"], (instance, len(tokens), theirs, mine)
                stop = theirs["cpu"] // BLOCK
                assert hashes[stop] in placeholders[instance], (instance, len(tokens), theirs, mine)
    # the comparison is not vacuous: device and host matches, and host matches beyond the device
    assert matched_gpu > 0 and matched_cpu_beyond_gpu > 0
    print(
        f"{compared} (query, instance) pairs, {matched_gpu} matching on the device, {matched_cpu_beyond_gpu} "
        f"further in the host tier: GPU identical in all, host identical in {compared - differing}"
    )


def dynamo_holdings(dyn: DynamoIndexer) -> dict[tuple[int, str], set[int]]:
    """``(instance, Dynamo tier) -> block hashes`` from Dynamo's ``/dump``."""
    status, dump = dyn.call("/dump")
    assert status == 200
    out: dict[tuple[int, str], set[int]] = {}
    for space in dump.values():
        for entry in space["events"]:
            stored = entry["event"]["data"].get("stored")
            blocks = out.setdefault((entry["worker_id"], entry["storage_tier"]), set())
            blocks.update(b["block_hash"] for b in stored["blocks"])
    return out


def our_holdings(ours: IndexServer) -> dict[tuple[int, str], set[int]]:
    """``(instance, our tier) -> block hashes`` from our ``/dump``."""
    status, dump = call(ours, "/dump")
    assert status == 200
    out: dict[tuple[int, str], set[int]] = {}
    for space in dump.values():
        for entry in space["entries"]:
            out.setdefault((entry["instance_id"], entry["tier"]), set()).update(entry["block_hashes"])
    return out


def test_both_indexes_hold_the_same_blocks(indexes) -> None:
    """Whole-index agreement from both ``/dump``s after the replay: per instance, Dynamo's
    device tier holds exactly our GPU tier's blocks, its host tier exactly our CPU tier's
    blocks (less any announced last in placeholder form: none now), its disk tier exactly
    our disk tier's (instance 1); nothing of the shared tier (instance 2)."""
    _, streams, dyn, ours = indexes
    theirs, mine = dynamo_holdings(dyn), our_holdings(ours)
    ends = {sentinel_hash(i, t) for i in streams for t in range(len(SENTINEL_FORMS))}
    theirs = {key: blocks - ends for key, blocks in theirs.items() if blocks - ends}
    mine = {key: blocks - ends for key, blocks in mine.items()}
    for instance, (frames, _) in streams.items():
        placeholders = placeholder_cpu_hashes(frames)
        assert theirs.get((instance, "device"), set()) == mine[(instance, "gpu")]
        assert theirs.get((instance, "host_pinned"), set()) == mine[(instance, "cpu")] - placeholders
        assert placeholders <= mine[(instance, "cpu")]
        lower = mine.get((instance, "disk"), set()) | mine.get((instance, "shared"), set())
        counts = {tier: len(blocks) for (i, tier), blocks in theirs.items() if i == instance}
        gpu, cpu = len(mine[(instance, "gpu")]), len(mine[(instance, "cpu")])
        print(
            f"instance {instance}: ours gpu {gpu}, cpu {cpu} ({len(placeholders)} in placeholder form), "
            f"lower tier {len(lower)} blocks; Dynamo {counts}"
        )
    # the disk tier of instance 1 is indexed by both, alike; the shared tier only by ours
    assert theirs.get((FS, "disk"), set()) == mine[(FS, "disk")] and mine[(FS, "disk")]
    assert {tier for _, tier in theirs} == {"device", "host_pinned", "disk"}
    assert (REDIS, "disk") not in theirs and mine[(REDIS, "shared")]


def test_disk_tier_agrees_and_shared_tier_is_dropped_by_dynamo(indexes) -> None:
    """Instance 1's disk-tier events (``STORAGE``/``LOCAL``, no ownership): both indexes
    give the same disk-tier match for every query, and it reaches past the host tier
    wherever the CPU tier lost blocks. Instance 2's shared-tier events
    (``STORAGE``/``REMOTE``/``redis``) reach Dynamo on the same stream and do not break
    it (the sentinel after them is indexed, the listener stays active), but Dynamo 1.6.1
    indexes none of them: its ``disk`` never goes past its ``cpu`` there, while ours
    counts the shared tier. Why: ``test_dynamo_tiers.py``."""
    query, streams, dyn, ours = indexes
    further = {FS: 0, REDIS: 0}
    for tokens in queries(streams):
        for instance, (theirs, mine) in query(tokens).items():
            if instance == FS:
                assert theirs["disk"] == mine["disk"], (instance, len(tokens), theirs, mine)
                further[FS] += mine["disk"] > mine["cpu"]
            else:
                assert theirs["disk"] == theirs["cpu"], (instance, theirs)
                further[REDIS] += mine["shared"] > mine["cpu"]
    assert further[FS] > 0 and further[REDIS] > 0
    status, workers = dyn.call("/workers")
    assert status == 200
    assert sorted((w["instance_id"], w["status"]) for w in workers) == [(FS, "active"), (REDIS, "active")]
    print("Dynamo's event counters:", dynamo_event_counters(dyn))
