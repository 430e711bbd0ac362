"""The feature cache on a real Redis Cluster: 3 masters with a replica each, `redis-server`
processes on this machine (bench/harness/redis_servers.py). No Ray.

Keys spread over every master; single-flight holds across masters; a stale or forged value
on any master is rejected; a master killed under load, and slots migrating under load,
fail no call: the dead master's keys are misses until its replica is promoted, the other
masters' keys keep hitting throughout, and hits resume after the failover.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest
from redis.crc import key_slot

from bench.harness.redis_servers import RedisClusterProcesses
from cache_service.codec import encode
from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.keys import content_key
from cache_service.validation import ValueCheck, stamp_fingerprint
from tests.cache_fixtures import assert_same_features, make_features

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server binary not available"),
]
FP = "0123abcd"
KEYS = [content_key(FP, f"image {i}".encode(), namespace="cluster") for i in range(24)]


@pytest.fixture(scope="module")
def cluster():
    cluster = RedisClusterProcesses().start()
    yield cluster
    cluster.stop()


@pytest.fixture
async def caches():
    made: list[FeatureCache] = []

    def make(cluster: RedisClusterProcesses, check: ValueCheck | None = None, **overrides) -> FeatureCache:
        settings = {
            "redis_url": cluster.url,
            "redis_cluster": True,
            "namespace": "cluster",
            "l1_max_bytes": 0,
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1.0,
            # A killed master refuses connections at once; these only keep a busy machine
            # from passing for a dead master.
            "redis_timeout_s": 2.0,
            "redis_connect_timeout_s": 2.0,
            **overrides,
        }
        cache = FeatureCache(CacheConfig(**settings), check=check)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        await cache.close()


async def test_keys_spread_over_every_master_and_read_back(cluster, caches):
    writer, reader = caches(cluster), caches(cluster)
    features = [make_features(i) for i in range(len(KEYS))]
    assert await writer.put_many(list(zip(KEYS, features))) == [True] * len(KEYS)
    per_master = {port: cluster.client(port).dbsize() for port in cluster.masters()}
    assert len(per_master) == 3 and all(n > 0 for n in per_master.values()), per_master
    got = await reader.get_many(KEYS)
    for want, have in zip(features, got):
        assert_same_features(want, have)
    assert reader.counters.l2_hits == len(KEYS)
    assert await reader.contains_many(KEYS + [KEYS[0] + "x"]) == [True] * len(KEYS) + [False]


async def test_single_flight_across_masters(cluster, caches):
    """Two replicas' caches miss on the same keys at once: each key is computed once; a key
    and its lock may live on different masters."""
    keys = [content_key(FP, f"flight {i}".encode(), namespace="cluster") for i in range(12)]
    computed: list[int] = []

    async def compute(indexes: list[int]):
        computed.extend(indexes)
        await asyncio.sleep(0.2)  # long enough for the other caller to find the locks taken
        return [make_features(i) for i in indexes]

    a, b = caches(cluster), caches(cluster)
    results = await asyncio.gather(a.get_or_compute_many(keys, compute), b.get_or_compute_many(keys, compute))
    assert sorted(computed) == list(range(len(keys)))
    for i in range(len(keys)):
        assert_same_features(results[0][i].features, results[1][i].features)
    assert len({cluster.port_of_key(k + ":lock") for k in keys}) == 3  # the locks too spread over the masters


async def test_forged_and_corrupt_values_rejected_on_every_master(cluster, caches):
    """As on one Redis (test_cache_poisoning.py): wrong for the model or not a value at all ->
    counted, deleted, a miss."""

    def expect_16_tokens(features):
        return None if features.tensors["image_embeds"].shape[0] == 16 else "wrong token count"

    keys = [content_key(FP, f"forged {i}".encode(), namespace="cluster") for i in range(12)]
    by_master: dict[int, list[str]] = {}
    for key in keys:
        by_master.setdefault(cluster.port_of_key(key), []).append(key)
    assert len(by_master) == 3
    forged, corrupt = [], []
    for port, master_keys in by_master.items():
        client = cluster.client(port)
        client.set(master_keys[0], bytes(encode(stamp_fingerprint(make_features(tokens=8), FP))))
        client.set(master_keys[-1], b"IRF2 not a value")
        forged.append(master_keys[0])
        corrupt.append(master_keys[-1])
    reader = caches(cluster, check=ValueCheck(expect_16_tokens))
    assert await reader.get_many(forged + corrupt) == [None] * 6
    assert reader.counters.rejected == 3 and reader.counters.corrupt == 3
    assert not any(cluster.client(cluster.port_of_key(k)).exists(k) for k in forged + corrupt)


class Load:
    """`clients` callers looping get_or_compute_many over KEYS, recording per call the time,
    the keys served from Redis and any exception."""

    def __init__(self, caches: list[FeatureCache]):
        self.caches = caches
        self.calls: list[tuple[float, set[str]]] = []
        self.failures: list[BaseException] = []
        self._stop = asyncio.Event()

    async def _client(self, cache: FeatureCache) -> None:
        async def compute(indexes):
            return [make_features(i) for i in indexes]

        while not self._stop.is_set():
            try:
                results = await cache.get_or_compute_many(KEYS, compute)
                self.calls.append((time.monotonic(), {k for k, r in zip(KEYS, results) if not r.computed}))
            except Exception as err:  # the cache must never raise because of Redis
                self.failures.append(err)
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._client(c)) for c in self.caches]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def since(self, t: float) -> list[set[str]]:
        return [hits for when, hits in self.calls if when >= t]

    async def until(self, condition, timeout_s: float, message: str) -> float:
        """Waits for `condition`; returns when its last false check began: it was still false then."""
        deadline = time.monotonic() + timeout_s
        last_false = None
        while True:
            checked = time.monotonic()
            if condition():
                return last_false
            last_false = checked
            assert checked < deadline, message
            await asyncio.sleep(0.1)


def is_master(client) -> bool:
    role = client.execute_command("ROLE")[0]
    return (role.decode() if isinstance(role, bytes) else role) == "master"


async def test_a_master_killed_under_load(caches):
    cluster = RedisClusterProcesses().start()  # its own: this test leaves it with a master fewer
    try:
        writer = caches(cluster)
        assert all(await writer.put_many([(k, make_features(i)) for i, k in enumerate(KEYS)]))
        for port in cluster.masters():
            assert cluster.client(port).execute_command("WAIT", 1, 5000) == 1  # on the replicas too
        victim = cluster.masters()[0]
        heir = cluster.replica_of(victim)
        victim_keys = {k for k in KEYS if cluster.port_of_key(k) == victim}
        others = set(KEYS) - victim_keys
        assert victim_keys and others
        async with Load([caches(cluster) for _ in range(4)]) as load:
            await load.until(lambda: len(load.calls) >= 8, 30, "no calls before the kill")
            killed = time.monotonic()
            cluster.kill(victim)
            probe = load.caches[0]
            # /health says Redis is not whole, but the other masters stay in use.
            assert await probe.ping() is False and probe.redis_available
            # Calls that ended before the last check where the heir itself was no master yet ran
            # with the victim's slots unserved; the clients may find the heir before this test's
            # next check does, so the outage ends there, not when the promotion is seen.
            not_yet_promoted = await load.until(
                lambda: is_master(cluster.client(heir)), 30, "the replica was not promoted"
            )
            assert not_yet_promoted is not None  # the kill was seen before the promotion
            promoted = time.monotonic()
            outage = [hits for when, hits in load.calls if killed + 0.5 <= when <= not_yet_promoted]
            await load.until(
                lambda: any(victim_keys <= hits for hits in load.since(promoted)),
                30,
                "the dead master's keys did not hit again after the failover",
            )
            await load.until(
                lambda: all(c.l2.shards_down == [] for c in load.caches),
                10,
                "the dead master is still counted as down after the failover",
            )
        assert load.failures == []
        # During the outage the other masters' keys kept hitting, the dead one's were misses.
        assert outage and all(others <= hits for hits in outage)
        assert all(not (victim_keys & hits) for hits in outage)
        assert all(c.stats()["degraded"] == 0 and c.stats()["reconnects"] == 1 for c in load.caches)
        assert await probe.ping() is True
    finally:
        cluster.stop()


async def test_slot_migration_under_load(cluster, caches):
    writer = caches(cluster)
    assert all(await writer.put_many([(k, make_features(i)) for i, k in enumerate(KEYS)]))
    nodes = cluster.cluster_nodes()
    source = next(n for n in nodes if n["port"] == cluster.port_of_key(KEYS[0]))
    target = next(n for n in nodes if n["port"] in cluster.masters() and n["id"] != source["id"])
    async with Load([caches(cluster) for _ in range(4)]) as load:
        await load.until(lambda: len(load.calls) >= 4, 30, "no calls before the migration")
        started = time.monotonic()
        # Every slot of the master that holds KEYS[0], so that key moves while it is read.
        moving = await asyncio.to_thread(
            subprocess.run,
            [
                "redis-cli",
                "--cluster",
                "reshard",
                f"127.0.0.1:{source['port']}",
                "--cluster-from",
                source["id"],
                "--cluster-to",
                target["id"],
                "--cluster-slots",
                "16384",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=120,
        )
        assert moving.returncode == 0, moving.stderr[-2000:]
        finished = time.monotonic()
        settled = finished + 1.0  # calls that began during the move have ended by then
        await load.until(lambda: len(load.since(settled)) >= 4, 30, "no calls after the migration")
    assert cluster.port_of_key(KEYS[0]) == target["port"]
    assert load.failures == []
    # While a key moves, a read of it may be a miss (a redirect that lands mid-move fails that
    # master's pipeline; the features are recomputed): rare, and never after the move.
    during = [hits for when, hits in load.calls if started <= when < finished]
    partial = [len(hits) for hits in during if hits != set(KEYS)]
    assert len(during) >= 8 and len(partial) <= len(during) // 10, partial
    assert all(hits == set(KEYS) for hits in load.since(settled))


async def test_a_slot_no_master_covers_is_a_miss_not_an_error(cluster, caches):
    key = content_key(FP, b"uncovered", namespace="cluster")
    port, slot = cluster.port_of_key(key), key_slot(key.encode())
    for node in cluster.nodes:  # every node forgets the slot's owner
        cluster.client(node).execute_command("CLUSTER DELSLOTS", slot)
    try:
        reader = caches(cluster)
        assert await reader.get_many([key]) == [None]
        assert await reader.contains_many([key]) == [False]
        assert reader.stats()["l2_errors"] >= 1 and reader.redis_available
    finally:
        cluster.client(port).execute_command("CLUSTER ADDSLOTS", slot)
        cluster.wait_until(
            lambda: all(
                cluster.client(n).execute_command("CLUSTER COUNTKEYSINSLOT", slot) is not None
                and _owner(cluster, n, slot) == port
                for n in cluster.nodes
            ),
            30,
            "the slot did not come back",
        )


def _owner(cluster, node: int, slot: int) -> int | None:
    """The port of the master that owns `slot` in `node`'s view."""
    for address, n in cluster.client(node).execute_command("CLUSTER NODES").items():
        if "master" in n["flags"] and any(int(r[0]) <= slot <= int(r[-1]) for r in n["slots"]):
            return int(address.split("@")[0].rsplit(":", 1)[1])
    return None


def test_blocking_reader_of_a_cluster_with_a_master_frozen_is_bounded():
    """The EC connector's reader in vLLM's scheduler: redis-py's cluster client, left to its
    default retries, tried each read 3 more times, a socket timeout each, while a master did not
    answer; now one try per read, and once the timeouts go on (redis_client.Outage), no read at
    all until the backoff has passed."""
    import signal

    from cache_service.store_factory import blocking_reader

    cluster = RedisClusterProcesses().start()  # its own: a master is frozen here
    victim = cluster.masters()[0]
    try:
        key = next(k for k in KEYS if cluster.port_of_key(k) == victim)
        cluster.client(victim).set(key, b"v")
        read = blocking_reader(
            CacheConfig(
                redis_url=cluster.url,
                redis_cluster=True,
                redis_timeout_s=0.4,
                redis_connect_timeout_s=0.4,
                backoff_initial_s=5,
                backoff_max_s=5,
            ),
            "iris-test",
        )
        assert read(key) == b"v"
        cluster.nodes[victim].proc.send_signal(signal.SIGSTOP)
        for _ in range(3):  # one timeout each (4 with redis-py's default retries)
            started = time.monotonic()
            assert read(key) is None
            assert time.monotonic() - started < 1.2
        started = time.monotonic()
        assert [read(key) for _ in range(50)] == [None] * 50
        assert time.monotonic() - started < 0.05
    finally:
        cluster.nodes[victim].proc.send_signal(signal.SIGCONT)
        cluster.stop()
