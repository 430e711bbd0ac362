"""The benchmark harness (bench/compare.py): workloads are deterministic for a
seed, Prometheus counters are read right, and a small run against the tiny
model goes end to end (start Iris, drive it with our client and vLLM's, read
its counters, write JSON, Markdown and plots, stop it), so the instrument
every performance claim rests on cannot rot unnoticed."""

from __future__ import annotations

import json

import pytest

from bench.harness.metrics import Counters, parse
from bench.harness.workloads import WorkloadFactory, chat_messages

WORKLOADS = ["unique", "repeat", "zipf", "multiturn", "upload_free", "text"]


def _fingerprint(workload) -> list:
    return [(c.upload_free, [(t.text, t.image.data_url if t.image else None, t.image.uuid if t.image else None)
                             for t in c.turns]) for c in workload.conversations]


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic_for_a_seed(name):
    a = WorkloadFactory(seed=3, small_px=32).build(name, 12)
    b = WorkloadFactory(seed=3, small_px=32).build(name, 12)
    c = WorkloadFactory(seed=4, small_px=32).build(name, 12)
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(a) != _fingerprint(c)
    assert a.requests == 12


def test_workload_shapes():
    f = WorkloadFactory(seed=1, small_px=32)
    assert f.unique(10).distinct_images == 10
    assert f.repeat(10).distinct_images == 1
    assert f.text(5).distinct_images == 0
    zipf = f.zipf(400, repeat_share=0.8, pool=8)
    new = 400 - sum(1 for c in zipf.conversations if c.turns[0].image.seed in
                    {f._image_seed("zipf-pool", i) for i in range(8)})
    assert 50 < new < 110  # about 20% new images
    assert zipf.distinct_images <= 8 + new
    multi = f.multiturn(9, turns=3)
    assert [len(c.turns) for c in multi.conversations] == [3, 3, 3]
    assert all(c.turns[0].image and not c.turns[1].image for c in multi.conversations)
    uf = f.upload_free(20, pool=4)
    assert all(c.upload_free and c.turns[0].image.uuid for c in uf.conversations)
    assert len({c.turns[0].image.uuid for c in uf.conversations}) <= 4
    longer = f.text_as_image(3, image_chars=200)
    assert min(len(c.turns[0].text) for c in longer.conversations) > 200 + max(
        len(c.turns[0].text) for c in f.text(3).conversations) - 60


def test_upload_free_messages_carry_uuid_without_bytes():
    turn = WorkloadFactory(seed=1, small_px=32).upload_free(1).conversations[0].turns[0]
    part = chat_messages([], turn, with_bytes=False)[0]["content"][0]
    assert part == {"type": "image_url", "image_url": None, "uuid": turn.image.uuid}
    resend = chat_messages([], turn, with_bytes=True)[0]["content"][0]
    assert resend["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert resend["uuid"] == turn.image.uuid


def test_prometheus_text_is_parsed_and_counters_subtract():
    text = """# HELP x
ray_iris_feature_cache_events_total{deployment="VisionEncoder",event="computations",replica="a"} 5.0
ray_iris_feature_cache_events_total{deployment="LLMDecode",event="computations",replica="b"} 7.0
vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 128.0
"""
    samples = parse(text)
    assert samples[0] == ("ray_iris_feature_cache_events_total",
                          {"deployment": "VisionEncoder", "event": "computations", "replica": "a"}, 5.0)
    assert samples[2][0] == "vllm:prefix_cache_hits_total"
    after = Counters(10, 4, {"r1": [300, 1000]})
    before = Counters(4, 1, {"r1": [100, 500]})
    delta = after.minus(before)
    assert (delta.encoder_runs, delta.preprocess_runs) == (6, 3)
    assert delta.prefix_hit_rates() == {"r1": 0.4}


def test_quick_run_against_tiny_iris(tmp_path):
    """A few points of the plan against Iris on the tiny model, with vLLM's own client too."""
    from bench import compare

    args = compare.parse_args(["--model", "builtin:tiny-llava", "--systems", "iris", "--replicas", "1",
                               "--points", "unique-c1,repeat-c1,zipf-c4,upload_free-c4,random_mm-c4",
                               "--scale", "0.25", "--out-dir", str(tmp_path), "--name", "smoke"])
    run = compare.run_comparison(args, "pytest smoke")
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["commit"] and saved["command"] == "pytest smoke"
    assert [s.get("error") for s in saved["starts"]] == [None]
    assert saved["starts"][0]["warm_up"]["failed"] == 0, saved["starts"][0]["warm_up"]
    results = {r["point"]: r for r in saved["results"]}
    assert set(results) == {"unique-c1", "repeat-c1", "zipf-c4", "upload_free-c4", "random_mm-c4"}
    for point, r in results.items():
        s = r["summary"]
        assert s["failed"] == 0 and s["ok"] == s["requests"] > 0, (point, s)
        assert 0 < s["ttft_ms"]["p50"] <= s["latency_ms"]["p50"]
        assert s["req_per_s"] > 0
    # Iris computes each distinct image once, and reports it through its metrics.
    assert results["unique-c1"]["summary"]["encoder_runs_per_distinct_image"] == 1.0
    assert results["repeat-c1"]["summary"]["encoder_runs"] == 1.0
    # Each uuid misses until its bytes have been sent once; with 4 clients up to 4 can miss at once.
    upload_free = results["upload_free-c4"]["summary"]
    assert 1 <= upload_free["resent"] <= upload_free["distinct_images"] * 4
    md = (tmp_path / "smoke.md").read_text()
    assert "| unique-c1 |" in md and "random_mm-c4" in md
    assert sorted(p.name for p in tmp_path.glob("smoke_*.png")) == ["smoke_latency_vs_load.png",
                                                                    "smoke_ttft_by_workload.png"]
    assert run["duration_s"] > 0
