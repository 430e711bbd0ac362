"""deployments.affinity: rendezvous hashing over decode replicas with a load bound (no Ray)."""

import random
from collections import Counter

import pytest

from deployments.affinity import (
    ReplicaLoad,
    affinity_key,
    load_cap,
    rank_for_key,
    rendezvous_order,
    two_choices,
)

KEYS = [f"iris:fp:img-{i}" for i in range(2000)]


def _owner(key, replicas):
    return rendezvous_order(key, replicas)[0]


def _idle(replicas, max_ongoing=64):
    return [ReplicaLoad(r, 0, max_ongoing) for r in replicas]


def test_same_key_same_replica_whatever_the_listing_order():
    replicas = [f"rep-{i}" for i in range(5)]
    for key in KEYS[:200]:
        first = _owner(key, replicas)
        assert _owner(key, list(reversed(replicas))) == first
        assert _owner(key, random.Random(key).sample(replicas, 5)) == first
        assert rank_for_key(key, _idle(replicas), 1.5)[0] == [first]


def test_keys_spread_evenly():
    replicas = [f"rep-{i}" for i in range(4)]
    counts = Counter(_owner(k, replicas) for k in KEYS)
    assert set(counts) == set(replicas)
    assert all(abs(c / len(KEYS) - 0.25) < 0.04 for c in counts.values()), counts


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adding_a_replica_moves_only_its_share(n):
    before = [f"rep-{i}" for i in range(n)]
    after = before + ["rep-new"]
    moved = [k for k in KEYS if _owner(k, before) != _owner(k, after)]
    assert all(_owner(k, after) == "rep-new" for k in moved)  # nothing moves between old replicas
    assert abs(len(moved) / len(KEYS) - 1 / (n + 1)) < 0.04, len(moved) / len(KEYS)


def test_removing_a_replica_moves_only_its_keys():
    before = [f"rep-{i}" for i in range(5)]
    after = before[:2] + before[3:]
    for k in KEYS:
        if _owner(k, before) != "rep-2":
            assert _owner(k, after) == _owner(k, before)


def test_saturated_replica_spills_to_least_loaded():
    replicas = ["a", "b", "c"]
    key = next(k for k in KEYS if _owner(k, replicas) == "a")
    loads = [ReplicaLoad("a", 8, 8), ReplicaLoad("b", 3, 8), ReplicaLoad("c", 1, 8)]
    assert rank_for_key(key, loads, max_load_factor=100) == [["c"], ["b", "a"]]


def test_preferred_kept_while_within_the_bound():
    key = next(k for k in KEYS if _owner(k, ["a", "b"]) == "a")
    # 2 of 3 in flight on a: cap = ceil(1.5 * 4 / 2) = 3, a would hold 3 -> stays
    assert rank_for_key(key, [ReplicaLoad("a", 2, 64), ReplicaLoad("b", 1, 64)], 1.5)[0] == ["a"]
    # 3 of 3 on a: cap = 3, a would hold 4 -> spills to b
    assert rank_for_key(key, [ReplicaLoad("a", 3, 64), ReplicaLoad("b", 0, 64)], 1.5)[0] == ["b"]


def test_idle_cluster_always_takes_the_preferred_replica():
    assert load_cap(0, 8, 1.0) == 1


def test_load_bound_holds_under_a_hot_image():
    """Random arrivals and completions, 60% of requests on one image: after every
    routing decision no replica holds more than ceil(factor x mean), and the hot
    image still lands on its own replica whenever that one has room."""
    rng = random.Random(7)
    replicas = [f"rep-{i}" for i in range(4)]
    factor = 1.25
    in_flight = Counter({r: 0 for r in replicas})
    running: list[str] = []
    hot = KEYS[0]
    on_owner = 0
    for _ in range(5000):
        if running and rng.random() < 0.45:
            in_flight[running.pop(rng.randrange(len(running)))] -= 1
            continue
        key = hot if rng.random() < 0.6 else rng.choice(KEYS)
        loads = [ReplicaLoad(r, in_flight[r], 1000) for r in replicas]
        cap = load_cap(sum(in_flight.values()), len(replicas), factor)
        chosen = rank_for_key(key, loads, factor)[0][0]
        in_flight[chosen] += 1
        running.append(chosen)
        assert in_flight[chosen] <= cap
        on_owner += key == hot and chosen == _owner(hot, replicas)
    assert on_owner > 0


def test_affinity_key_is_the_first_image():
    assert affinity_key(["k1", "k2"]) == "k1"
    assert affinity_key(["", "k2"]) == "k2"
    assert affinity_key([]) is None and affinity_key(None) is None


def test_text_only_requests_are_spread():
    rng = random.Random(1)
    replicas = [f"rep-{i}" for i in range(4)]
    picks = [two_choices(replicas, rng) for _ in range(4000)]
    assert all(len(p) == 2 and p[0] != p[1] for p in picks)
    counts = Counter(r for p in picks for r in p)
    assert all(abs(c / 8000 - 0.25) < 0.03 for c in counts.values()), counts
    assert sorted(two_choices(["only"], rng)) == ["only"]
