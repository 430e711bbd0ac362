"""The benchmark harness (`python -m bench compare`, bench/harness/): workloads are
deterministic for a seed, Prometheus counters are read right, reports carry
whole-answer latency and output tokens/s with their ratios, the GPU configs ask
for the GPU, and `python -m bench gpu` runs end to end at the tiny size (start
Iris and `vllm serve`, drive each with our client, read their counters, write
JSON and Markdown, stop them), so the instrument every performance claim rests
on cannot rot unnoticed. Also the
entry point, the provenance record every result carries, the one percentile,
and the list of saved results."""

from __future__ import annotations

import ast
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench.harness.metrics import Counters, parse
from bench.harness.workloads import WorkloadFactory, chat_messages

BENCH = Path(__file__).resolve().parents[1] / "bench"

WORKLOADS = ["unique", "repeat", "zipf", "multiturn", "upload_free", "text"]


def _fingerprint(workload) -> list:
    return [
        (
            c.upload_free,
            [(t.text, t.image.data_url if t.image else None, t.image.uuid if t.image else None) for t in c.turns],
        )
        for c in workload.conversations
    ]


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
    new = 400 - sum(
        1 for c in zipf.conversations if c.turns[0].image.seed in {f._image_seed("zipf-pool", i) for i in range(8)}
    )
    assert 50 < new < 110  # about 20% new images
    assert zipf.distinct_images <= 8 + new
    multi = f.multiturn(9, turns=3)
    assert [len(c.turns) for c in multi.conversations] == [3, 3, 3]
    assert all(c.turns[0].image and not c.turns[1].image for c in multi.conversations)
    uf = f.upload_free(20, pool=4)
    assert all(c.upload_free and c.turns[0].image.uuid for c in uf.conversations)
    assert len({c.turns[0].image.uuid for c in uf.conversations}) <= 4
    longer = f.text_as_image(3, image_chars=200)
    assert (
        min(len(c.turns[0].text) for c in longer.conversations)
        > 200 + max(len(c.turns[0].text) for c in f.text(3).conversations) - 60
    )


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
    assert samples[0] == (
        "ray_iris_feature_cache_events_total",
        {"deployment": "VisionEncoder", "event": "computations", "replica": "a"},
        5.0,
    )
    assert samples[2][0] == "vllm:prefix_cache_hits_total"
    after = Counters(10, 4, {"r1": [300, 1000]})
    before = Counters(4, 1, {"r1": [100, 500]})
    delta = after.minus(before)
    assert (delta.encoder_runs, delta.preprocess_runs) == (6, 3)
    assert delta.prefix_hit_rates() == {"r1": 0.4}
    two = Counters(0, None, {"a": [300, 1000], "b": [0, 3000]})
    assert two.pooled_prefix_hit_rate() == 300 / 4000
    assert two.prompt_token_shares() == {"a": 0.25, "b": 0.75}
    assert Counters().pooled_prefix_hit_rate() is None and Counters().prompt_token_shares() == {}


def test_gpu_run_entry_point_at_tiny_size_against_iris_and_vllm(tmp_path):
    """`python -m bench gpu` as on a GPU machine, at the tiny size on this CPU: it builds the checkpoint,
    starts Iris (behind Ray Serve's HAProxy, as cluster/rayservice.yaml runs it) and `vllm serve` in
    turn, warms each up, drives new images, a repeated image, text and upload-free requests at 1 and 2
    clients, reads their counters, and saves JSON and Markdown with whole-answer latency, output
    tokens/s and Iris / peer ratios. (The harness's one run end to end;
    `python -m bench compare` is the same harness: systems, client, counters, report, results.)"""
    from bench.__main__ import main

    out = tmp_path / "gpu_run.json"
    argv = [
        "--size",
        "tiny",
        "--models",
        "llava",
        "--systems",
        "iris-haproxy,vllm",
        "--clients",
        "1,2",
        "--requests",
        "4",
        "--max-tokens",
        "12",
        "--workloads",
        "unique,repeat,text,upload_free",
        "--out",
        str(out),
    ]
    main(["gpu", *argv])
    saved = json.loads(out.read_text())
    assert saved["commit"] and saved["command"] == "python -m bench gpu " + " ".join(argv)
    assert saved["machine"]["cpus"] == os.cpu_count() and saved["started"]
    assert saved["gpu"] == bool(saved["machine"]["gpus"]) and saved["eager"] == (not saved["gpu"])
    assert list(saved["models"]) == ["builtin:tiny-llava"]
    assert Path(saved["models"]["builtin:tiny-llava"]["checkpoint"]).is_dir()
    assert [(s["system"], s.get("error")) for s in saved["starts"]] == [("iris-haproxy", None), ("vllm", None)]
    assert all(s["warm_up"]["failed"] == 0 for s in saved["starts"]), saved["starts"]
    points = [f"{w}-c{c}" for w in ("unique", "repeat", "text", "upload_free") for c in (1, 2)]
    results = {(r["system"], r["point"]): r for r in saved["results"]}
    assert sorted(results) == sorted((s, p) for s in ("iris-haproxy", "vllm") for p in points)
    for key, r in results.items():
        assert "summary" in r, (key, r.get("skipped"))
        s = r["summary"]
        assert s["failed"] == 0 and s["ok"] == s["requests"] > 0, (key, s)
        assert 0 < s["ttft_ms"]["p50"] <= s["latency_ms"]["p50"] <= s["latency_ms"]["p90"], (key, s)
        assert s["output_tokens_mean"] == 12, (key, s)  # ignore_eos: whole answers of one length everywhere
        assert s["output_tokens_per_s"] == pytest.approx(12 * s["ok"] / s["duration_s"]) and s["req_per_s"] > 0
    # Iris computes each distinct image once, also for two clients asking at once, and counts it.
    iris = {p: results[("iris-haproxy", p)]["summary"] for p in points}
    assert iris["unique-c1"]["encoder_runs_per_distinct_image"] == 1.0
    assert iris["unique-c2"]["encoder_runs_per_distinct_image"] == 1.0
    assert iris["repeat-c1"]["encoder_runs"] == 1.0 and iris["repeat-c2"]["encoder_runs"] == 1.0
    assert iris["text-c1"]["distinct_images"] == 0 and iris["text-c1"]["encoder_runs"] == 0
    # Each uuid misses until its bytes have been sent once; with 2 clients up to 2 can miss at once.
    assert 1 <= iris["upload_free-c1"]["resent"] <= iris["upload_free-c1"]["distinct_images"]
    assert 1 <= iris["upload_free-c2"]["resent"] <= iris["upload_free-c2"]["distinct_images"] * 2
    ratios = {r["point"]: r for r in saved["ratios"]}
    assert sorted(ratios) == sorted(points) and all(r["peer"] == "vllm" for r in ratios.values())
    for point, row in ratios.items():
        a, b = iris[point], results[("vllm", point)]["summary"]
        assert row["latency_p50"] == pytest.approx(a["latency_ms"]["p50"] / b["latency_ms"]["p50"])
        assert row["output_tokens_per_s"] == pytest.approx(a["output_tokens_per_s"] / b["output_tokens_per_s"])
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# `python -m bench gpu`") and saved["machine"]["description"] in md
    assert "## Iris vs Ray Serve LLM vs `vllm serve` (builtin:tiny-llava)" in md
    assert "| upload_free-c2 |" in md and "| p50 e2e | p90 e2e | req/s | output tok/s |" in md
    assert "Whole answers: p50 e2e ms / p90 e2e ms / p50 TPOT ms / output tok/s" in md


# ---- scale-out: autoscale timeline analysis, router variant, vLLM core binding (no cluster needed)


def _status(t, **replicas):
    return {"t": t, "replicas": {d: ({"RUNNING": r} if isinstance(r, int) else r) for d, r in replicas.items()}}


def test_autoscale_summary_sees_preprocess_alone_move_out_and_back():
    from bench.autoscale import replica_series, scaling_summary, ttft_by_replicas

    steady = {"VisionEncoder": 1, "LLMDecode": 1}
    lines = [
        _status(100, Preprocess=1, **steady),
        _status(110, Preprocess={"RUNNING": 1, "STARTING": 1}, **steady),
        _status(112, Preprocess=2, **steady),
        _status(115, Preprocess=4, **steady),
        _status(130, Preprocess={"RUNNING": 1, "STOPPING": 3}, **steady),
        _status(132, Preprocess=1, **steady),
    ]
    series = replica_series(lines, t0=100)
    assert series["Preprocess"][1] == (10, 1, 2)  # (seconds since t0, RUNNING, all states)
    summary = scaling_summary(series, "Preprocess", load_end_s=25)
    pre = summary["deployments"]["Preprocess"]
    assert (pre["initial"], pre["peak"], pre["final"]) == (1, 4, 1)
    assert (pre["decided_out_s"], pre["first_above_initial_s"], pre["peak_at_s"]) == (10, 12, 15)
    assert (pre["scale_in_started_s"], pre["back_to_initial_s"]) == (30, 32)
    assert summary["moved_out_and_back_alone"]
    assert pre["running_at_load_end"] == 4
    # Settling lower under load is fine; being back at 1 before the load ended is not "back in after it".
    assert not scaling_summary(series, "Preprocess", load_end_s=33)["scaled_back_in"]
    by_replicas = ttft_by_replicas(
        [
            {"ok": True, "start_s": 5, "ttft_ms": 100.0},
            {"ok": True, "start_s": 16, "ttft_ms": 300.0},
            {"ok": False, "start_s": 16, "ttft_ms": None},
        ],
        series["Preprocess"],
    )
    assert by_replicas == {
        "1": {"requests": 1, "ttft_p50_ms": 100.0, "ttft_mean_ms": 100.0},
        "4": {"requests": 1, "ttft_p50_ms": 300.0, "ttft_mean_ms": 300.0},
    }

    # Another deployment moving, Preprocess never scaling, or never coming back all fail the verdict.
    moved = [
        _status(100, Preprocess=1, VisionEncoder=1),
        _status(110, Preprocess=3, VisionEncoder=2),
        _status(130, Preprocess=1, VisionEncoder=1),
    ]
    assert not scaling_summary(replica_series(moved, 100), "Preprocess", 20)["moved_out_and_back_alone"]
    flat = [_status(100, Preprocess=1, VisionEncoder=1), _status(130, Preprocess=1, VisionEncoder=1)]
    assert not scaling_summary(replica_series(flat, 100), "Preprocess", 20)["scaled_out"]
    stuck = [
        _status(100, Preprocess=1, VisionEncoder=1),
        _status(110, Preprocess=3, VisionEncoder=1),
        _status(130, Preprocess=3, VisionEncoder=1),
    ]
    assert not scaling_summary(replica_series(stuck, 100), "Preprocess", 20)["scaled_back_in"]


def test_relabelled_jpeg_is_new_bytes_with_the_same_pixels():
    import base64
    import io

    import numpy as np
    from PIL import Image

    from bench.harness.workloads import ImageSpec, RelabelledJpeg

    base = ImageSpec(5, 64, 48)
    decoded = [
        base64.b64decode(u.split(",", 1)[1])
        for u in (base.data_url, RelabelledJpeg(base, 1).data_url, RelabelledJpeg(base, 12345).data_url)
    ]
    assert len(set(decoded)) == 3
    pixels = [np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in decoded]
    assert all(np.array_equal(pixels[0], p) for p in pixels[1:])


def test_defaultrouter_config_drops_only_the_router(tmp_path):
    from bench.harness import systems

    engine = systems.EngineSettings("/ckpt", "float32")
    with_router = systems.iris_config(engine, 2, 8000, cache=True, namespace="x")
    without = systems.iris_config(engine, 2, 8000, cache=True, namespace="x", affinity_router=False)
    decode = {d["name"]: d for d in with_router["applications"][0]["deployments"]}["LLMDecode"]
    assert decode["request_router_config"]["request_router_class"].endswith("ImageAffinityRouter")
    decode_default = {d["name"]: d for d in without["applications"][0]["deployments"]}["LLMDecode"]
    assert "request_router_config" not in decode_default
    assert {**decode_default, "request_router_config": decode["request_router_config"]} == decode
    assert "iris-defaultrouter" in systems.ROUTER_VARIANTS  # compare.py runs it with 2+ replicas only
    tuned = systems.iris_config(
        engine,
        1,
        8000,
        cache=True,
        namespace="x",
        deployments={"Preprocess": {"autoscaling_config": {"max_replicas": 4}}},
    )
    assert {d["name"]: d for d in tuned["applications"][0]["deployments"]}["Preprocess"]["autoscaling_config"] == {
        "max_replicas": 4
    }
    with pytest.raises(ValueError, match="Preproces"):
        systems.iris_config(engine, 1, 8000, cache=True, namespace="x", deployments={"Preproces": {}})


def test_the_ray_serve_llm_peer_builds_in_this_environment(ray_dashboard):
    """The peer's app as the harness deploys it: its import path and router class import, and
    build_openai_app accepts the config (a dependency ray.serve.llm needs but does not declare,
    pyarrow, once went missing and every comparison ran without the peer).

    On the session's cluster: build_openai_app calls ray.init, which with no cluster up would start
    a local instance and switch this process to token auth (RAY_AUTH_MODE) for every cluster after."""
    import importlib

    from ray.serve import Application

    from bench.harness import systems

    config = systems.rayllm_config(systems.EngineSettings("/ckpt", "float32"), 1, 8000, affinity=True)
    app = config["applications"][0]
    module, _, name = app["import_path"].partition(":")
    router = app["args"]["llm_configs"][0]["deployment_config"]["request_router_config"]["request_router_class"]
    importlib.import_module(router.rpartition(".")[0]).__dict__[router.rpartition(".")[2]]
    assert isinstance(getattr(importlib.import_module(module), name)(app["args"]), Application)


def test_gpu_configs_ask_for_the_gpu_and_cpu_ones_do_not(ray_dashboard):  # build_openai_app: see above
    """EngineSettings(gpu=True), as `python -m bench gpu` starts the systems: Iris's VisionEncoder and
    LLMDecode share one GPU (fractions adding up to one, so one GPU holds the app), Ray Serve LLM's
    placement group holds a GPU, `vllm serve` gets the same memory share; the CPU configs ask for none."""
    from ray.serve import Application
    from ray.serve.llm import build_openai_app
    from ray.serve.schema import ServeDeploySchema

    from bench.harness import systems
    from deployments.config import IrisConfig

    cpu = systems.EngineSettings("/ckpt", "bfloat16")
    gpu = systems.EngineSettings("/ckpt", "bfloat16", gpu=True, gpu_memory_utilization=0.8)
    iris = systems.iris_config(gpu, 1, 8000, cache=True, namespace="x")
    actors = {d["name"]: d["ray_actor_options"] for d in iris["applications"][0]["deployments"]}
    assert actors["VisionEncoder"]["num_gpus"] == 0.2 and actors["LLMDecode"]["num_gpus"] == 0.8
    assert sum(a.get("num_gpus", 0) for a in actors.values()) == 1.0  # one replica each: one GPU
    assert "num_gpus" not in actors["Ingress"] and "num_gpus" not in actors["Preprocess"]
    # Every replica at its maximum fits the runner's 8 logical CPUs (bench/harness/serve_runner.py).
    deployments = iris["applications"][0]["deployments"]
    assert sum(d["ray_actor_options"]["num_cpus"] * d["autoscaling_config"]["max_replicas"] for d in deployments) <= 8
    assert iris["applications"][0]["args"]["engine_args"]["gpu_memory_utilization"] == 0.8
    ServeDeploySchema.model_validate(iris)  # as serve_runner reads it
    IrisConfig.model_validate(iris["applications"][0]["args"])  # as the app reads its args
    on_cpu = systems.iris_config(cpu, 1, 8000, cache=True, namespace="x")
    assert not any("num_gpus" in d["ray_actor_options"] for d in on_cpu["applications"][0]["deployments"])
    assert "gpu_memory_utilization" not in on_cpu["applications"][0]["args"]["engine_args"]
    # Apart from the GPU lines, the app is the one of CPU runs.
    for d in on_cpu["applications"][0]["deployments"]:
        d["ray_actor_options"].update(systems.IRIS_GPU_ACTORS.get(d["name"], {}))
    on_cpu["applications"][0]["args"]["engine_args"]["gpu_memory_utilization"] = 0.8
    assert on_cpu == iris

    rayllm = systems.rayllm_config(gpu, 1, 8000, affinity=False)["applications"][0]["args"]
    (llm,) = rayllm["llm_configs"]
    assert llm["placement_group_config"] == {"bundles": [{"CPU": 1, "GPU": 1}]}
    assert llm["engine_kwargs"]["gpu_memory_utilization"] == 0.8
    assert isinstance(build_openai_app(rayllm), Application)
    (cpu_llm,) = systems.rayllm_config(cpu, 1, 8000, affinity=False)["applications"][0]["args"]["llm_configs"]
    assert cpu_llm["placement_group_config"] == {"bundles": [{"CPU": 1}]}
    assert "gpu_memory_utilization" not in cpu_llm["engine_kwargs"]

    command = systems.vllm_command(gpu, 9000)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.8"
    assert "--gpu-memory-utilization" not in systems.vllm_command(cpu, 9000)
    assert "--tensor-parallel-size" not in command


def test_gpu_run_tensor_parallel_point_at_tiny_size(tmp_path):
    """`python -m bench gpu --tensor-parallel-size 2` end to end on this CPU (each rank a process with
    a core of its own): Iris starts with two ranks and answers every request. (`vllm serve` at two
    ranks: tests/test_parallel_engine.py, and its command line above; left out here for CI's time.)"""
    from bench.__main__ import main

    out = tmp_path / "gpu_run.json"
    argv = ["--size", "tiny", "--models", "llava", "--systems", "iris-haproxy", "--clients", "1"]
    argv += ["--requests", "3", "--max-tokens", "8", "--workloads", "unique,text", "--tensor-parallel-size", "2"]
    main(["gpu", *argv, "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["tensor_parallel_size"] == 2
    assert [(s["system"], s.get("error")) for s in saved["starts"]] == [("iris-haproxy", None)]
    for r in saved["results"]:
        assert "summary" in r, r.get("skipped")
        assert r["summary"]["failed"] == 0 and r["summary"]["ok"] == r["summary"]["requests"] > 0, r
    assert "tensor parallel 2" in out.with_suffix(".md").read_text()


def test_a_tensor_parallel_point_gives_every_system_the_same_ranks(ray_dashboard):
    """`python -m bench gpu --tensor-parallel-size 4`: every engine over 4 ranks, each system's own way."""
    from ray.serve.llm import build_openai_app
    from ray.serve.schema import ServeDeploySchema

    from bench.harness import systems
    from deployments.config import IrisConfig

    tp4 = systems.EngineSettings("/ckpt", "bfloat16", gpu=True, gpu_memory_utilization=0.8, tensor_parallel_size=4)
    app = systems.iris_config(tp4, 1, 8000, cache=True, namespace="x")["applications"][0]
    assert app["args"]["engine_args"]["tensor_parallel_size"] == 4
    actors = {d["name"]: d.get("ray_actor_options", {}) for d in app["deployments"]}
    # LLMDecode's group holds its GPUs (deployments/placement.py); the encoder keeps its fraction.
    assert "num_gpus" not in actors["LLMDecode"] and actors["VisionEncoder"]["num_gpus"] == 0.2
    config = IrisConfig.model_validate(app["args"])
    assert [b.get("GPU") for b in config.decode_ranks().serve_options()["placement_group_bundles"]] == [1] * 4
    ServeDeploySchema.model_validate(systems.iris_config(tp4, 1, 8000, cache=True, namespace="x"))
    (llm,) = systems.rayllm_config(tp4, 1, 8000, affinity=False)["applications"][0]["args"]["llm_configs"]
    assert llm["engine_kwargs"]["tensor_parallel_size"] == 4
    assert [b["GPU"] for b in llm["placement_group_config"]["bundles"]] == [1] * 4
    build_openai_app({"llm_configs": [llm]})
    command = systems.vllm_command(tp4, 9000)
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    # On a CPU, each rank reserves a CPU instead (vLLM's CPU platform runs its ranks as processes).
    cpu = systems.iris_config(replace(tp4, gpu=False), 1, 8000, cache=True, namespace="x")["applications"][0]
    assert IrisConfig.model_validate(cpu["args"]).decode_ranks().bundles == [{"CPU": 2}] + [{"CPU": 1}] * 3


def test_vllm_replicas_get_cores_of_their_own():
    from bench.harness.systems import vllm_cpu_binding

    assert vllm_cpu_binding(0, 1, [0, 1]) == {}  # one engine: vLLM's default
    # Tensor parallel on a CPU: a core list per rank, within the replica's own slice.
    assert vllm_cpu_binding(0, 1, [0, 1], ranks=2) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert vllm_cpu_binding(1, 2, [0, 1, 2, 3], ranks=2) == {"VLLM_CPU_OMP_THREADS_BIND": "2|3"}
    assert [vllm_cpu_binding(i, 2, [0, 1]) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        {"VLLM_CPU_OMP_THREADS_BIND": "1"},
    ]
    assert [vllm_cpu_binding(i, 2, [0, 1, 2, 3]) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3"},
    ]
    assert vllm_cpu_binding(2, 3, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def test_round_robin_proxy_alternates_backends_and_streams():
    """Two real HTTP servers behind the proxy vLLM's bench client is given for `vllm serve` ×2."""
    import asyncio
    import threading

    import httpx
    from aiohttp import web

    from bench.harness.rr_proxy import RoundRobinProxy
    from bench.harness.systems import free_port

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    ports, runners = [free_port(), free_port()], []

    async def serve(name: str, port: int):
        async def chat(request):
            body = await request.json()
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for piece in (name, body["say"], "[DONE]"):
                await response.write(f"data: {piece}\n\n".encode())
            return response

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)

    for name, port in zip("ab", ports):
        asyncio.run_coroutine_threadsafe(serve(name, port), loop).result(10)
    try:
        with RoundRobinProxy([f"http://127.0.0.1:{p}" for p in ports]) as proxy:
            texts = [
                httpx.post(f"{proxy.url}/v1/chat/completions", json={"say": f"hi{i}"}, timeout=10).text
                for i in range(4)
            ]
            assert proxy.requests == 4
            missing = httpx.get(f"{proxy.url}/nope", timeout=10)
        assert [t.split("\n\n")[0] for t in texts] == ["data: a", "data: b", "data: a", "data: b"]
        assert all(f"data: hi{i}\n\ndata: [DONE]" in t for i, t in enumerate(texts))
        assert missing.status_code == 404  # the backend's answer, passed through
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_whole_answer_points_ask_for_no_stream_and_count_the_whole_answer_as_ttft():
    """A real HTTP server that answers as `vllm serve` does with `"stream": false`, after 0.2 s."""
    import asyncio

    from aiohttp import web

    from bench.compare import FULL, LoadPoint
    from bench.harness.client import LoadClient
    from bench.harness.systems import free_port
    from bench.harness.workloads import WorkloadFactory

    assert LoadPoint("text", 4, concurrency=1, stream=False).name == "text-c1-whole"
    assert {"text-c1", "text-c1-whole", "repeat-c1-whole"} <= {p.name for p in FULL}
    bodies = []

    async def run():
        async def chat(request):
            bodies.append(await request.json())
            await asyncio.sleep(0.2)
            return web.json_response(
                {
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 1},
                }
            )

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            client = LoadClient([f"http://127.0.0.1:{port}"], "m", stream=False)
            return await client.closed_loop(WorkloadFactory(0).build("text", 2), 1)
        finally:
            await runner.cleanup()

    records, _ = asyncio.run(run())
    assert [b["stream"] for b in bodies] == [False, False] and "stream_options" not in bodies[0]
    assert all(r.ok and r.output_tokens == 1 and r.prompt_tokens == 7 for r in records)
    assert all(0.2 <= r.ttft_s <= r.latency_s for r in records)


def test_stage_timeline_segments_follow_the_path_and_skip_stages_a_request_does_not_cross():
    from bench.stage_timeline import request_segments, summarise

    def marks(*pairs):
        return [{"t": t, "stage": s} for s, t in pairs]

    new = marks(
        ("ingress.received", 10.001),
        ("ingress.parsed", 10.003),
        ("ingress.looked_up", 10.004),
        ("preprocess.start", 10.007),
        ("preprocess.end", 10.010),
        ("encoder.start", 10.015),
        ("encoder.forward_start", 10.016),
        ("encoder.forward_end", 10.216),
        ("encoder.end", 10.218),
        ("decode.start", 10.005),  # LLMDecode was called while the image was encoded: off the path
        ("decode.features_in", 10.224),
        ("decode.engine_call", 10.226),
        ("decode.first_output", 10.246),
        ("ingress.first_token", 10.248),
        ("decode.first_output", 10.300),  # a later request's mark, after this one's first token
        ("ingress.received", 9.0),
    )  # an earlier request's
    segments = request_segments(new, 10.0, 10.250)
    assert [(a, b) for a, b, _ in segments][0] == ("client.sent", "ingress.received")
    assert [b for _, b, _ in segments][-1] == "client.first_token"
    assert len(segments) == 14
    by_pair = dict(((a, b), ms) for a, b, ms in segments)
    assert abs(by_pair[("encoder.forward_start", "encoder.forward_end")] - 200) < 1e-6
    assert abs(by_pair[("encoder.end", "decode.features_in")] - 6) < 1e-6
    assert all(ms >= 0 for *_, ms in segments)
    assert abs(sum(ms for *_, ms in segments) - 250) < 1e-6

    cached = marks(("ingress.received", 20.001), ("ingress.looked_up", 20.002), ("decode.start", 20.006))
    pairs = [(a, b) for a, b, _ in request_segments(cached, 20.0, 20.030)]
    assert ("ingress.looked_up", "decode.start") in pairs  # no Preprocess/VisionEncoder between
    assert ("decode.start", "client.first_token") in pairs  # marks missing: one segment

    summary = summarise([segments, request_segments(new, 10.0, 10.250)])
    assert summary["requests"] == 2 and summary["ttft_median_ms"] == 250.0
    assert summary["segments"][0]["what"] == "HTTP proxy to ingress"


def test_cpu_meter_counts_a_process_tree_by_role():
    """A real child that burns CPU under a real parent: its time lands on its role, per request."""
    import subprocess
    import sys

    from bench.harness import cpu_usage

    assert cpu_usage.role("ray::ServeReplica:iris:VisionEncoder.handle_request") == "VisionEncoder"
    assert cpu_usage.role("ray::ServeReplica:rayllm:LLMServer:bench") == "LLMServer"
    assert cpu_usage.role("VLLM::Worker") == "VLLM::Worker"
    assert cpu_usage.role("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=a") == "raylet"
    assert cpu_usage.role("redis-server 127.0.0.1:6379") == "redis-server"
    assert cpu_usage.role("python -m vllm.entrypoints.openai.api_server --model m") == "vllm api_server"

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        meter = cpu_usage.Meter([burner.pid])
        assert meter.per_request_ms(2) == {}  # not measured yet
        with meter:
            time.sleep(1.0)
        ms = meter.per_request_ms(2)
        assert ms["total"] >= ms["other Ray processes"] > 50  # ≥ 0.1 s of CPU in 1 s, over 2 requests
        assert meter.per_request_ms(0) == {}
    finally:
        burner.kill()


_DUMP = """[2026-12-04 03:02:37,294 I 11141 11171] core_worker.cc:591: Event stats:


Global stats: 6 total (4 active)
Event stats:
	CoreWorkerService.grpc_server.ReportGeneratorItemReturns - {items} total (0 active), Execution time: mean = 0.24ms, total = 84.00ms, Queueing time: mean = 0.01ms
	CoreWorkerService.grpc_client.PushTask - {calls} total (0 active), Execution time: mean = 4.02ms, total = 249.32ms, Queueing time: mean = 0.01ms
	NodeManagerService.grpc_client.PinObjectIDs - 3 total (0 active), Execution time: mean = 0.43ms, total = 4.72ms, Queueing time: mean = 0.01ms
	CoreWorker.PrintEventStats - 40 total (1 active, 1 running), Execution time: mean = 0.19ms, total = {dump}ms, Queueing time: mean = 0.01ms
-----------------
Task Event stats:
Other Stats:
	gcs_grpc_in_progress:0

"""


def test_a_core_workers_last_complete_event_stats_dump_is_read():
    from bench.harness.host_work import (
        ITEMS_RECEIVED,
        PINS,
        SENT_CALLS,
        parse_event_stats,
    )

    first = _DUMP.format(items=10, calls=4, dump="7.50")
    second = _DUMP.format(items=17, calls=6, dump="8.00").replace("03:02:37,294", "03:02:39,294")
    when, counts, dump_ms = parse_event_stats(
        "noise\n" + first + "[2026-12-04 03:02:38,000 I 1 1] x.cc:1: y\n" + second
    )
    assert counts[ITEMS_RECEIVED] == 17 and counts[SENT_CALLS] == 6 and counts[PINS] == 3 and dump_ms == 8.0
    assert when - parse_event_stats(first)[0] == pytest.approx(2.0)
    # A dump still being written (no "Other Stats:" yet) is skipped for the one before it.
    assert parse_event_stats(first + second.split("Task Event stats")[0])[1][ITEMS_RECEIVED] == 10
    assert parse_event_stats("no dump here") == (None, {}, 0.0)


def test_ray_task_and_object_store_counters_are_read_from_prometheus_text():
    from bench.harness.host_work import ray_counts, short_method

    text = "\n".join(
        [
            "# HELP ray_tasks Current number of tasks",
            'ray_tasks{Name="ServeReplica:iris:Ingress.handle_request_streaming",Source="owner",State="FINISHED"} 5',
            'ray_tasks{Name="ServeReplica:iris:Ingress.handle_request_streaming",Source="owner",State="FAILED"} 1',
            'ray_tasks{Name="ServeReplica:iris:Ingress.handle_request_streaming",Source="owner",State="RUNNING"} 2',
            'ray_tasks{Name="ServeReplica:iris:Ingress.handle_request_streaming",Source="executor",State="FINISHED"} 9',
            'ray_object_store_dist_count{Source="CreatedByWorker"} 4',
            'ray_object_store_dist_count{Source="RestoredFromSpill"} 2',
        ]
    )
    assert ray_counts(text) == {
        "tasks": {"ServeReplica:iris:Ingress.handle_request_streaming": 6.0},
        "object_store_creates": 4.0,
    }
    assert short_method("ServeReplica:iris:Ingress.handle_request_streaming") == "Ingress.handle_request_streaming"
    assert short_method("Outer.call") == "Outer.call"
    assert short_method("ServeReplica:rayllm:LLMServer:bench.handle_request") == "LLMServer:bench.handle_request"


def test_host_work_is_the_difference_per_request_by_method_and_role():
    from bench.harness import host_work as hw

    def worker(role, sent=0, items=0, pins=0, dump=0.0, **extra):
        return {
            "role": role,
            "t": 0.0,
            "dump_ms": dump,
            **extra,
            "counts": {hw.SENT_CALLS: sent, hw.ITEMS_RECEIVED: items, hw.PINS: pins},
        }

    before = {
        "metrics": {
            "tasks": {
                "ServeReplica:iris:Ingress.handle_request_streaming": 2.0,
                "ServeController.listen_for_change": 10.0,
            },
            "object_store_creates": 1.0,
        },
        "workers": {1: worker("ProxyActor", sent=2, items=20, dump=5.0), 2: worker("Ingress", sent=4)},
    }
    after = {
        "metrics": {
            "tasks": {
                "ServeReplica:iris:Ingress.handle_request_streaming": 6.0,
                "ServeReplica:iris:LLMDecode.handle_request_streaming": 4.0,
                "ProxyActor.receive_asgi_messages": 8.0,
                "ServeController.listen_for_change": 12.0,
            },
            "object_store_creates": 3.0,
        },
        "workers": {
            1: worker("ProxyActor", sent=6, items=60, dump=9.0),
            2: worker("Ingress", sent=12, items=36, pins=2, stale=True),
            3: worker("Ingress", sent=1),
        },
    }  # started in between: counts from zero
    work = hw.diff(before, after, 4)
    assert work["ray_calls_per_request"] == {
        "total": 4.0,
        "ProxyActor.receive_asgi_messages": 2.0,
        "Ingress.handle_request_streaming": 1.0,
        "LLMDecode.handle_request_streaming": 1.0,
    }
    assert work["other_ray_calls_per_request"] == 0.5
    assert work["other_ray_calls_by_method"] == {"total": 0.5, "ServeController.listen_for_change": 0.5}
    assert work["calls_sent_by_role"] == {"total": 3.25, "Ingress": 2.25, "ProxyActor": 1.0}
    assert work["streamed_items_received_by_role"] == {"total": 19.0, "ProxyActor": 10.0, "Ingress": 9.0}
    assert work["object_store_puts_per_request"] == 0.5 and work["object_pins_by_role"] == {
        "total": 0.5,
        "Ingress": 0.5,
    }
    assert work["event_stats_dump_ms_per_request"] == 1.0 and work["stale_roles"] == ["Ingress"]
    assert hw.diff(before, after, 0) == {}
    # Without event stats (--ray-event-stats-s 0) only the metrics' counts remain.
    bare = hw.diff({**before, "workers": {}}, {**after, "workers": {}}, 4)
    assert bare["calls_sent_by_role"] is None and bare["ray_calls_per_request"]["total"] == 4.0


def test_cpu_per_output_token_and_the_host_work_table():
    from bench.harness import cpu_usage, host_work, report

    per_request = {"total": 100.0, "VLLM::Worker": 60.0, "Ingress": 30.0, "VisionEncoder": 10.0}
    assert cpu_usage.per_output_token(per_request, 4, 64) == {
        "total": 6.25,
        "VLLM::Worker": 3.75,
        "Ingress": 1.88,
        "VisionEncoder": 0.62,
    }
    assert cpu_usage.per_output_token(per_request, 4, None) == {} == cpu_usage.per_output_token(per_request, 0, 5)
    assert report.host_cpu(per_request) == 30.0

    def result(system, work):
        return {
            "system": system,
            "replicas": 1,
            "point": "text-c1",
            "summary": {
                "requests": 4,
                "ok": 4,
                "failed": 0,
                "req_per_s": 1.0,
                "output_tokens": 64,
                "ttft_ms": {"p50": 10, "p90": 20},
                "latency_ms": {"p50": 30, "p90": 40},
                "tpot_ms": {"p50": 1},
                "cpu_ms_per_request": per_request,
                "cpu_ms_per_output_token": {"total": 6.25},
                "host_work": work,
            },
        }

    iris = {
        "ray_calls_per_request": {
            "total": 2.0,
            "Ingress.handle_request_streaming": 1.0,
            "LLMDecode.handle_request_streaming": 1.0,
        },
        "other_ray_calls_per_request": 0.5,
        "calls_sent_by_role": {"total": 2.0, "ProxyActor": 1.0, "Ingress": 1.0},
        "streamed_items_received_by_role": {"total": 34.0, "ProxyActor": 17.0, "Ingress": 17.0},
        "object_store_puts_per_request": 0.0,
        "object_pins_by_role": {"total": 0.0},
        "event_stats_dump_ms_per_request": 0.4,
    }
    run = {
        "model": "m",
        "machine": {"description": "test box", "cpus": 2},
        "commit": "abc",
        "started": "now",
        "duration_s": 60,
        "command": "python -m bench compare",
        "systems": ["iris", "vllm"],
        "ratios": [],
        "gpu_node_mode": {"model_cores": [0], "host_cores": [1], "omp_threads_bind": "0"},
        "results": [result("iris", iris), result("vllm", dict(host_work.NO_RAY))],
    }
    text = report.markdown(run)
    assert "GPU-node mode: cores [0] play the GPU" in text and "VLLM_CPU_OMP_THREADS_BIND=0" in text
    assert "| iris | 1 | text-c1 | 100 | 6.25 | 30 | 1.88 |" in text
    assert (
        "| iris | 1 | text-c1 | 2.00: Ingress.handle_request_streaming 1.00, LLMDecode.handle_request_streaming "
        "1.00 | 2.00: ProxyActor 1.00, Ingress 1.00 | 34.00: ProxyActor 17.00, Ingress 17.00 | 0.00 (0.00) | "
        "0.50 | 0.40 |"
    ) in text
    assert "| vllm | 1 | text-c1 | 0 (n/a: no Ray) |" in text
    assert "GPU-node mode: off" in report.markdown({**run, "gpu_node_mode": None})


def test_gpu_node_mode_splits_the_cores_and_plans_every_thread():
    from bench.harness import affinity

    assert affinity.split_cores(1, [1, 0]) == ([0], [1])
    assert affinity.split_cores(2, [0, 1, 2, 3]) == ([0, 1], [2, 3]) and affinity.omp_bind([1, 0]) == "0,1"
    for bad in (0, 2):
        with pytest.raises(ValueError):
            affinity.split_cores(bad, [0, 1])
    model, host = {0, 1}, {2, 3}
    assert affinity.is_model("VLLM::EngineCore") and affinity.is_model("ray::ServeReplica:iris:VisionEncoder")
    assert not affinity.is_model("ray::ServeReplica:iris:LLMDecode") and not affinity.is_model("ray::ProxyActor")
    assert affinity.target("VLLM::Worker", {0, 1, 2, 3}, model, host) == model
    assert affinity.target("VLLM::Worker", {1}, model, host) is None  # an OpenMP thread vLLM bound itself
    assert affinity.target("ray::ServeReplica:iris:Ingress", {0, 1, 2, 3}, model, host) == host
    assert affinity.target("ray::ServeReplica:iris:Ingress", {2, 3}, model, host) is None
    # This process's real threads, as if it were a vLLM worker, then a host process.
    me = os.getpid()
    tids = affinity.threads(me)
    assert me in tids
    everywhere = affinity.plan({me: "VLLM::Worker"}, [0, 1], [2, 3], affinity=lambda _tid: {0, 1, 2, 3})
    assert set(everywhere) == set(tids) and all(v == model for v in everywhere.values())
    assert affinity.plan({me: "ray::ProxyActor"}, [0, 1], [2, 3], affinity=lambda _tid: {2, 3}) == {}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_gpu_node_mode_moves_a_real_process_threads_to_the_host_cores():
    from bench.harness import affinity

    model, host = affinity.split_cores(1, sorted(os.sched_getaffinity(0)))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while len(affinity.threads(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        moved = affinity.apply([child.pid], model, host)
        assert sum(moved["threads_moved"].values()) == 2
        assert all(os.sched_getaffinity(t) == set(host) for t in affinity.threads(child.pid))
        assert affinity.apply([child.pid], model, host)["threads_moved"] == {}  # nothing left to move
    finally:
        child.kill()
        child.wait()


def test_gpu_node_mode_binds_every_systems_engine_to_the_model_cores(tmp_path):
    from bench.harness import systems

    engine = systems.EngineSettings("ckpt", "float32", omp_bind="0")
    iris = systems.iris_config(engine, 1, 8000, cache=True, namespace="n")
    rayllm = systems.rayllm_config(engine, 1, 8000, affinity=False)
    for config in (iris, rayllm):
        assert config["applications"][0]["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    plain = systems.EngineSettings("ckpt", "float32")
    assert (
        "VLLM_CPU_OMP_THREADS_BIND"
        not in systems.rayllm_config(plain, 1, 8000, False)["applications"][0]["runtime_env"]["env_vars"]
    )


# ---- one entry point, one provenance record, one percentile, one list of results


def test_entry_point_dispatches_each_experiment_its_arguments(monkeypatch):
    import importlib

    from bench.__main__ import EXPERIMENTS, main

    assert set(EXPERIMENTS) == {
        "compare",
        "gpu",
        "autoscale",
        "cache",
        "feature-plane",
        "soak",
        "stage-timeline",
        "tenants",
        "vision-vs-prefill",
        "vllm",
        "json-body",
        "ec-connector",
        "upload_free",
        "two-models",
    }
    for name, (module_name, _) in EXPERIMENTS.items():
        module = importlib.import_module(module_name)
        calls = []
        monkeypatch.setattr(module, "main", lambda argv, calls=calls: calls.append(argv) or 3)
        assert main([name, "--seed", "7", "x y"]) == 3
        assert calls == [["--seed", "7", "x y"]], name


def test_entry_point_names_the_experiments_and_refuses_others(capsys):
    from bench.__main__ import EXPERIMENTS, main

    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in EXPERIMENTS)
    assert main([]) == 2 and "usage: python -m bench <experiment>" in capsys.readouterr().err
    assert main(["compare.py"]) == 2 and "no experiment 'compare.py'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    [
        "compare",
        "gpu",
        "autoscale",
        "cache",
        "feature-plane",
        "soak",
        "stage-timeline",
        "tenants",
        "vision-vs-prefill",
        "json-body",
        "ec-connector",
        "upload_free",
    ],
)
def test_each_experiment_keeps_its_options_under_its_own_name(name, capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: python -m bench {name} ")
    options = {
        "compare": [
            "--quick",
            "--video",
            "--model",
            "--systems",
            "--replicas",
            "--points",
            "--scale",
            "--seed",
            "--small-px",
            "--max-tokens",
            "--name",
            "--out-dir",
            "--no-plots",
            "--profile",
        ],
        "gpu": [
            "--models",
            "--size",
            "--systems",
            "--clients",
            "--requests",
            "--workloads",
            "--budget-s",
            "--max-tokens",
            "--image-px",
            "--max-model-len",
            "--gpu-memory-utilization",
            "--eager",
            "--timeout",
            "--seed",
            "--out",
        ],
        "autoscale": [
            "--model",
            "--before-s",
            "--load-s",
            "--load-clients",
            "--after-s",
            "--idle-max-s",
            "--seed",
            "--num-cpus",
            "--name",
            "--out-dir",
            "--reanalyse",
        ],
        "cache": ["--iters", "--redis-url", "--out"],
        "feature-plane": ["--rounds", "--seconds", "--clients", "--out"],
        "soak": ["--minutes", "--warmup-s", "--concurrency", "--sample-s", "--model", "--seed", "--out"],
        "stage-timeline": ["--model", "--requests", "--video", "--seed", "--name", "--out-dir"],
        "tenants": ["--model", "--rounds", "--flood-clients", "--b-requests", "--settle-s", "--out"],
        "vision-vs-prefill": ["--repeats", "--families", "--out"],
        "json-body": ["--rounds", "--iters", "--out-dir"],
        "ec-connector": ["--models", "--rounds", "--iters", "--out-dir"],
        "upload_free": [
            "--model",
            "--requests",
            "--rounds",
            "--iris",
            "--peers",
            "--no-pause-idle",
            "--seed",
            "--name",
            "--out-dir",
        ],
    }[name]
    assert all(option in usage for option in options), [o for o in options if o not in usage]


def test_python_dash_m_bench_runs_and_the_old_script_paths_say_where_to_go():
    root = BENCH.parent
    listing = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], cwd="/", capture_output=True, text=True, timeout=120
    )
    assert listing.returncode == 0 and "stage-timeline" in listing.stdout, listing.stderr
    old = subprocess.run(
        [sys.executable, "bench/stage_timeline.py", "--requests", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert old.returncode == 1 and "python -m bench stage-timeline" in old.stderr, old.stderr


def _fake_nvidia_smi(folder: Path, output: str) -> Path:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    script.chmod(0o755)
    return folder


def test_provenance_records_the_machine_as_detected(tmp_path, monkeypatch):
    from bench.harness import results

    record = results.provenance("python -m bench soak --minutes 1")
    commit = record["commit"].removesuffix("-dirty")
    assert re.fullmatch(r"[0-9a-f]{40}", commit), record["commit"]
    # HEAD then: HEAD now or, if a commit has landed since, one of its ancestors.
    assert subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=BENCH.parent).returncode == 0
    assert record["command"] == "python -m bench soak --minutes 1"
    assert record["started"].endswith("+00:00")
    machine = record["machine"]
    assert machine["cpus"] == os.cpu_count() and machine["cpus_usable"] == len(os.sched_getaffinity(0))
    mem_kib = int(re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1))
    assert abs(machine["memory_gib"] - mem_kib / 2**20) < 0.1
    assert machine["platform"] == platform.platform() and machine["arch"] == platform.machine()
    assert machine["description"].startswith(f"{os.cpu_count()}-CPU {platform.machine()} machine with ")
    # GPUs as this machine has them: named where there are any, "no GPU" only where there are none.
    assert ("no GPU" in machine["description"]) == (machine["gpus"] == [])
    assert all(gpu in machine["description"] for gpu in machine["gpus"])

    # nvidia-smi answers first, where it is installed.
    fake = _fake_nvidia_smi(tmp_path, "NVIDIA H200\\nNVIDIA H200\\n")
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    two = results.detect_machine()
    assert two["gpus"] == ["NVIDIA H200", "NVIDIA H200"]
    assert two["description"].endswith("GiB, 2× NVIDIA H200") and "no GPU" not in two["description"]
    assert results.label(two) == f"{os.cpu_count()} CPUs, NVIDIA H200"
    assert results.label({**two, "gpus": []}) == f"{os.cpu_count()} CPUs, no GPU"
    assert (
        results.command_line("compare", ["--points", "unique-c1", "a b"])
        == "python -m bench compare --points unique-c1 'a b'"
    )


def test_results_are_saved_only_with_provenance_and_reports_say_the_machine(tmp_path):
    from bench.harness import report, results
    from bench.stage_timeline import markdown as timeline_markdown

    with pytest.raises(ValueError, match="provenance"):
        results.save({"command": "x"}, tmp_path / "x.json")
    gpu_box = {
        "cpus": 16,
        "cpus_usable": 16,
        "memory_gib": 128.0,
        "gpus": ["NVIDIA H200"],
        "platform": "Linux",
        "arch": "x86_64",
        "python": "3.11",
    }
    gpu_box["description"] = results.describe(gpu_box)
    summary = {
        "requests": 2,
        "ok": 2,
        "failed": 0,
        "req_per_s": 1.0,
        "ttft_ms": {"p50": 10.0, "p90": 12.0},
        "tpot_ms": {"p50": 1.0},
        "cpu_ms_per_request": {"total": 50.0, "LLMDecode": 50.0},
    }
    run = {
        "commit": "abc",
        "command": "python -m bench compare",
        "started": "now",
        "machine": gpu_box,
        "model": "m",
        "duration_s": 60,
        "systems": ["iris"],
        "ratios": [],
        "results": [{"system": "iris", "replicas": 1, "point": "unique-c1", "summary": summary}],
    }
    path = results.save(run, tmp_path / "run.json", report.markdown(run))
    assert json.loads(path.read_text())["machine"] == gpu_box
    md = (tmp_path / "run.md").read_text()
    assert "16-CPU x86_64 machine with 128 GiB, NVIDIA H200" in md
    assert "this machine's 16 CPUs, 1000 ms of CPU per second is 6% of the machine" in md
    assert "2 cores" not in md and "no GPU" not in md and "CPU figures" not in md
    timeline = timeline_markdown({**run, "kinds": {"new image": {"segments": [], "ttft_median_ms": 1.0}}})
    assert "NVIDIA H200" in timeline


def test_report_gives_whole_answer_latency_and_output_tokens_per_second_with_ratios():
    """End-to-end latency p50/p90 and output tokens/s for every point, beside TTFT and TPOT, and
    their Iris / peer ratios, in the summaries, the ratios and the Markdown."""
    from bench.harness import report
    from bench.harness.client import RequestRecord

    def records(ttft_s: float, latency_s: float, tokens: int, n: int = 4) -> list[RequestRecord]:
        ok = [RequestRecord(i, 0, 0.0, True, 200, ttft_s, latency_s * (1 + i / 10), tokens) for i in range(n)]
        return ok + [RequestRecord(n, 0, 0.0, False, 500, error="boom")]  # a failure counts no tokens

    iris = report.summarize(records(0.05, 1.0, 64), 2.0, 4, None)
    peer = report.summarize(records(0.10, 2.0, 64), 4.0, 4, None)
    assert iris["output_tokens_per_s"] == pytest.approx(4 * 64 / 2.0)
    assert iris["latency_ms"]["p50"] == pytest.approx(1150.0) and iris["latency_ms"]["p90"] == pytest.approx(1270.0)
    assert iris["request_output_tokens_per_s"]["p50"] == pytest.approx(
        statistics.median([64 / (1 + i / 10) for i in range(4)])
    )
    assert iris["failed"] == 1 and iris["tpot_ms"]["p50"] == pytest.approx((1150 - 50) / 63)
    assert report.summarize([], 0.0, 0, None)["output_tokens_per_s"] is None

    results = [
        {"system": s, "replicas": 1, "point": "unique-c1", "summary": summary}
        for s, summary in (("iris", iris), ("vllm", peer))
    ]
    (row,) = report.ratios(results)
    assert row["peer"] == "vllm"
    assert row["latency_p50"] == pytest.approx(0.5) and row["latency_p90"] == pytest.approx(0.5)
    assert row["output_tokens_per_s"] == pytest.approx(2.0) and row["ttft_p50"] == pytest.approx(0.5)
    # Summaries saved before the whole-answer figures existed still give the other ratios.
    old = {k: v for k, v in peer.items() if k not in ("latency_ms", "output_tokens_per_s")}
    (old_row,) = report.ratios([results[0], {**results[1], "summary": old}])
    assert old_row["latency_p50"] is None and old_row["output_tokens_per_s"] is None and old_row["ttft_p50"]

    machine = {
        "cpus": 2,
        "cpus_usable": 2,
        "memory_gib": 24.0,
        "gpus": [],
        "platform": "Linux",
        "arch": "x86_64",
        "python": "3.11",
        "description": "2-CPU x86_64 machine with 24 GiB, no GPU",
    }
    md = report.markdown(
        {
            "commit": "abc",
            "command": "c",
            "started": "now",
            "machine": machine,
            "model": "m",
            "duration_s": 60,
            "systems": ["iris", "vllm"],
            "results": results,
            "ratios": [row],
        }
    )
    assert "| unique-c1 | 50 / 50 / 2.0 (1 failed) | 100 / 100 / 1.0 (1 failed) |" in md  # the TTFT table as before
    assert "| unique-c1 | 1150 / 1270 / 17.5 / 128.0 | 2300 / 2540 / 34.9 / 64.0 |" in md
    assert "| load point | peer | p50 TTFT | p90 TTFT | p50 TPOT | p50 e2e | p90 e2e | req/s | output tok/s |" in md
    assert "| unique-c1 | vllm | 0.50 | 0.50 | 0.50 | 0.50 | 0.50 | 2.00 | 2.00 |" in md


def test_rounds_give_per_round_ratios_reported_as_their_median_and_range():
    """`compare --rounds N`: Iris / peer is taken within each round (systems measured in turn, minutes
    apart at most), then reported as the median with its range; a system's figures in the tables are
    the median of its rounds', its failures summed."""
    from bench.harness import report
    from bench.harness.client import RequestRecord

    def summary(latency_s: float, failed: int = 0) -> dict:
        ok = [RequestRecord(i, 0, 0.0, True, 200, latency_s / 2, latency_s, 8) for i in range(3)]
        return report.summarize(ok + [RequestRecord(9, 0, 0.0, False, 500)] * failed, 1.0, 3, None)

    # A noisy machine: round 1 is slow for everyone; Iris's ratio stays 0.5, 0.8, 0.6.
    latencies = {"iris": [0.5, 4.0, 0.6], "rayllm": [1.0, 5.0, 1.0]}
    results = [
        {
            "system": system,
            "replicas": 1,
            "point": "text-c1",
            "round": r,
            "summary": summary(latency, failed=int(system == "iris" and r == 2)),
        }
        for r in range(3)
        for system, series in latencies.items()
        for latency in [series[r]]
    ]
    rows = report.ratios(results)
    assert [(row["round"], round(row["latency_p50"], 3)) for row in rows] == [(0, 0.5), (1, 0.8), (2, 0.6)]
    (medians,) = report.ratio_medians(rows)
    assert medians["rounds"] == 3 and medians["peer"] == "rayllm"
    assert medians["latency_p50"] == {"median": 0.6, "min": 0.5, "max": 0.8}
    assert medians["ttft_p50"]["median"] == 0.6

    machine = {"cpus": 2, "description": "2-CPU x86_64 machine with 24 GiB, no GPU"}
    md = report.markdown(
        {
            "commit": "abc",
            "command": "c",
            "started": "now",
            "machine": machine,
            "model": "m",
            "duration_s": 60,
            "systems": ["iris", "rayllm"],
            "results": results,
            "rounds": 3,
            "ratios": rows,
            "ratio_medians": [medians],
        }
    )
    assert "3 rounds, the systems up side by side" in md
    # Iris's p50 TTFT is the median of 250, 2000 and 300 ms, its p50 e2e that of 500, 4000 and 600 ms;
    # its one failure (round 2) is counted once.
    assert "| text-c1 | 300 / 300 / 3.0 (1 failed) | 500 / 500 / 3.0 |" in md
    assert "| text-c1 | 600 / 600 / " in md and "| iris | 1 | text-c1 | 9 |" in md  # 3 new images a round
    assert "| text-c1 | rayllm | 0.60 (0.50–0.80) |" in md


def test_haproxy_variants_get_files_and_ports_of_their_own_and_their_ratios(tmp_path):
    """iris-haproxy and rayllm-haproxy run side by side with the others: each HAProxy gets its own
    files (the admin socket's path within a unix socket's 107 bytes), metrics and stats ports, and
    direct-ingress port range; Iris behind HAProxy is compared with every peer."""
    from bench.harness import report, systems

    assert {"iris-haproxy", "rayllm-haproxy"} <= set(systems.SYSTEMS)
    a, b = systems.haproxy_env(tmp_path / "a"), systems.haproxy_env(tmp_path / "b")
    assert a["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert a["RAY_SERVE_HAPROXY_SOCKET_PATH"].startswith(str(tmp_path / "a"))
    for key in (
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
        "RAY_SERVE_HAPROXY_SOCKET_PATH",
        "RAY_SERVE_HAPROXY_METRICS_PORT",
        "RAY_SERVE_HAPROXY_STATS_PORT",
    ):
        assert a[key] != b[key], key
    low, high = int(a["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]), int(a["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])
    assert 30000 <= low < high < int(a["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]) < 65536
    summary = report.summarize([], 1.0, 0, None) | {"req_per_s": 2.0}
    results = [
        {"system": name, "replicas": 1, "point": "text-c1", "summary": summary}
        for name in ("iris", "iris-haproxy", "rayllm", "rayllm-haproxy")
    ]
    assert sorted((r["system"], r["peer"]) for r in report.ratios(results)) == [
        ("iris", "rayllm"),
        ("iris", "rayllm-haproxy"),
        ("iris-haproxy", "rayllm"),
        ("iris-haproxy", "rayllm-haproxy"),
    ]


def test_an_idle_system_is_paused_whole_and_resumed_and_stops_even_while_paused():
    """--pause-idle: every process under the system's runner stops (state T) and continues (S);
    stop() continues a paused system first, else SIGTERM would wait behind SIGSTOP."""
    from bench.harness import systems
    from bench.harness.profiler import process_tree

    runner = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(process_tree([runner.pid])) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        system = systems.RunningSystem("vllm", 1, [], [], [runner], [], 0.0)

        def states_become(wanted: str) -> bool:  # a signal is delivered asynchronously
            for _ in range(100):
                states = {
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    for pid in process_tree([runner.pid])
                }
                if states == {wanted}:
                    return True
                time.sleep(0.02)
            return False

        system.pause()
        assert states_become("T")
        system.resume()
        assert states_become("S")
        system.pause()
        system.stop()  # SIGTERM to bash, which exits; its sleeps are left to the session kill below
        assert runner.returncode is not None
    finally:
        try:
            os.killpg(runner.pid, 9)  # the group outlives bash: its sleeps are still in it
        except ProcessLookupError:
            pass


def test_percentile_interpolates_between_ranks():
    import numpy as np

    from bench.harness.stats import distribution, percentile

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        values = list(rng.normal(size=n))
        for q in (0, 5, 25, 50, 90, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12), (n, q)
        assert percentile(values, 50) == pytest.approx(statistics.median(values), abs=1e-12)
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None and percentile(iter([2.0, 1.0]), 100) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert distribution([0.001, 0.002, 0.003], 1000) == pytest.approx(
        {"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0}
    )
    assert distribution([], 1000) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_bench_code_has_one_percentile_and_no_path_edits_or_private_imports_between_experiments():
    """bench/harness/stats.py holds the percentile; experiments share helpers only through bench/harness/."""
    from bench.__main__ import EXPERIMENTS

    experiments = {module for module, _ in EXPERIMENTS.values() if not module.startswith("bench.harness.")}
    problems = []
    for path in sorted(BENCH.rglob("*.py")):
        where = path.relative_to(BENCH.parent)
        source = path.read_text()
        for banned in (
            "sys.path",
            "statistics.median",
            "statistics.quantiles",
            "np.percentile",
            "np.quantile",
            "numpy.percentile",
        ):
            if banned in source:
                problems.append(f"{where}: {banned}")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module in experiments:
                problems.append(f"{where}: imports from the experiment {node.module}")
            if (
                isinstance(node, ast.FunctionDef)
                and re.fullmatch(r"_?(pct|percentile|quantile)", node.name)
                and where.as_posix() != "bench/harness/stats.py"
            ):
                problems.append(f"{where}: a percentile of its own ({node.name})")
    assert problems == []


def _listed_results(readme: str) -> list[str]:
    """File names in the first column of the README's `| file | made by | what |` table."""
    lines = readme.splitlines()
    start = lines.index("| file | made by | what |") + 2
    names = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def test_results_readme_lists_exactly_the_files_that_exist():
    results_dir = BENCH / "results"
    listed = _listed_results((results_dir / "README.md").read_text())
    on_disk = sorted(p.relative_to(results_dir).as_posix() for p in results_dir.rglob("*") if p.is_file())
    on_disk.remove("README.md")
    assert len(listed) == len(set(listed)), "a file is listed twice"
    assert sorted(listed) == on_disk
    # The results the repository's README and docs cite by path are among them.
    docs = [BENCH.parent / "README.md", *sorted((BENCH.parent / "docs").glob("*.md"))]
    cited = {
        name for doc in docs if doc.exists() for name in re.findall(r"bench/results/([\w./-]+\.\w+)", doc.read_text())
    } - {"README.md"}
    assert cited and cited <= set(listed), cited - set(listed)


def test_feature_plane_bench_runs_on_a_real_cluster(tmp_path):
    """`python -m bench feature-plane`, briefly: both targets answer every call, fp32 features
    weigh twice bf16's, and the capacity table follows from the measured GET rate."""
    from bench import feature_plane

    out = tmp_path / "fp.json"
    feature_plane.main(["--rounds", "1", "--seconds", "0.3", "--clients", "2", "--out", str(out)])
    run = json.loads(out.read_text())
    (round_,) = run["rounds"]
    assert all(round_[target][op] > 0 for target in ("single", "cluster") for op in ("put_per_s", "get_per_s"))
    assert run["value_bytes"]["fp32_over_bf16"] == pytest.approx(2.0, abs=0.01)
    llava = next(row for row in run["capacity"] if row["family"] == "LLaVA-1.5-7B")
    assert llava["MB_per_image"] == 4.72
    assert llava["images_per_s_per_shard"] == pytest.approx(round_["single"]["get_per_s"], rel=1e-3, abs=0.1)
    assert out.with_suffix(".md").read_text().startswith("# Feature plane")


def test_tenant_fairness_report_takes_the_median_of_per_round_ratios():
    from bench.tenant_fairness import markdown, summarise

    def mode(alone, flood, rate):
        return {"alone": {"b_ttft_p50_ms": alone}, "flood": {"b_ttft_p50_ms": flood, "a_images_per_s": rate}}

    rounds = [
        {"fair": mode(40, f, 2.0), "fifo": mode(41, 400, 2.1), "b_flood_fair_over_fifo": f / 400}
        for f in (100, 300, 120)
    ]
    summary = summarise(rounds)
    assert summary["b_flood_fair_over_fifo"] == {"median": 0.3, "min": 0.25, "max": 0.75}
    assert summary["b_flood_fifo_p50_ms"]["median"] == 400 and summary["a_images_per_s_fifo"]["median"] == 2.1
    summary["target_met"] = True
    run = {
        "summary": summary,
        "rounds": rounds,
        "machine": "test box",
        "model": "m",
        "commit": "abc",
        "flood_clients": 8,
        "b_px": 256,
        "b_requests": 8,
    }
    text = markdown(run)
    assert "**0.30** (0.25-0.75)" in text and "| under A's flood | 120 (100-300) | 400 (400-400) |" in text


def test_upload_free_report_takes_per_round_ratios_and_counts_what_failed():
    """`python -m bench upload_free`: a case's p50 TTFT and bytes are the median of the rounds';
    Iris / peer ratios are taken within each round first; a failed request is counted, and a
    round a system missed leaves its ratios out."""
    from bench.upload_free import CACHED, CLIENT_CACHED, CLIENT_MISS, NEW, case_result, markdown, summarise

    def case(ttft_ms: float, wire: int, attempts: int = 1, failed: int = 0) -> dict:
        records = [{"ttft_s": ttft_ms / 1000, "wire_bytes": wire, "attempts": attempts}] * 3
        return case_result(records, 3 + failed, ["APIError: boom"] * failed)

    def round_(r: int, scale: float, vllm: bool = True) -> dict:
        results = {
            "iris": {
                CACHED: case(40 * scale, 2_000_000),
                CLIENT_CACHED: case(20 * scale, 200),
                NEW: case(100 * scale, 2_000_000),
                CLIENT_MISS: case(110 * scale, 2_000_300, 2),
            }
        }
        if vllm:
            results["vllm"] = {
                CACHED: case(200 * scale, 2_000_000, failed=int(r == 1)),
                NEW: case(125 * scale, 2_000_000),
            }
        return {"round": r, "order": list(results), "results": results, "broken": []}

    # Round 1 is slow for everyone (the ratios hold); vllm misses round 2.
    rounds = [round_(0, 1.0), round_(1, 3.0), round_(2, 1.0, vllm=False)]
    summary = summarise(rounds, "iris", ["vllm"])
    iris, vllm = summary["cases"]["iris"], summary["cases"]["vllm"]
    assert iris[CLIENT_CACHED]["ttft_p50_ms"] == {"median": 20.0, "min": 20.0, "max": 60.0}
    assert iris[CLIENT_MISS]["resends"] == 9 and iris[CLIENT_MISS]["wire_bytes_per_request"]["median"] == 2_000_300
    assert vllm[CACHED]["requests"] == 7 and vllm[CACHED]["failed"] == 1
    ratios = {r["what"]: r for r in summary["ratios"]}
    by_id = ratios["Iris's client, cached / vllm, the same photo's bytes"]
    assert by_id["rounds"] == 2 and by_id["ttft_p50"] == {"median": 0.1, "min": 0.1, "max": 0.1}
    assert by_id["wire_bytes"]["median"] == 0.0001
    assert ratios["the client's id / plain upload, cached (Iris)"]["rounds"] == 3
    assert ratios["Iris's client, miss+resend / vllm, a new photo"]["ttft_p50"]["median"] == 0.88

    run = {
        "commit": "abc",
        "command": "python -m bench upload_free",
        "started": "now",
        "model": "m",
        "machine": {"description": "2-CPU x86_64 machine with 24 GiB, no GPU"},
        "duration_s": 540,
        "requests": 3,
        "rounds": 3,
        "pause_idle": True,
        "photo_bytes": 2_000_000,
        "photo_px": [2800, 2100],
        "starts": [{"system": "rayllm", "error": "did not start"}],
        "per_round": rounds,
        "summary": summary,
    }
    text = markdown(run)
    assert "| iris | client, cached | 200 | 20 (20–60) | 9 | 0 | 0 |" in text
    assert "| vllm | plain, cached | 2,000,000 | 400 (200–600) | 7 | 1 | 0 |" in text  # two rounds
    assert "| Iris's client, cached / vllm, the same photo's bytes | 0.10 (0.10–0.10) |" in text
    assert "- rayllm: did not start" in text and "9.0 min in all" in text


# ---- the harness survives its own load (issue 33): memory estimate, dying replicas, clean exit


def _checkpoint(folder: Path) -> Path:
    """A checkpoint folder as the estimate reads it: config.json and safetensors with a tower and a language model."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    save_file(
        {"vision_tower.w": np.zeros(1000, np.float32), "language_model.w": np.zeros(3000, np.float32)},
        str(folder / "model.safetensors"),
    )
    return folder


def test_memory_estimate_refuses_what_does_not_fit_before_starting_anything_and_accepts_what_does(tmp_path):
    """Issue 33's plan (four Ray-based systems side by side) on its 23.5 GiB machine with 19 GiB
    available is refused, naming each system's estimate, the memory there is and what to do; the
    documented three-system run fits; one system at a time fits; on a GPU the KV cache and the
    weights are not host memory. Through the CLI, a plan that cannot fit anywhere starts nothing."""
    from dataclasses import replace

    from bench.harness import memory_plan as mp
    from bench.harness import systems

    ckpt = _checkpoint(tmp_path / "ckpt")
    assert mp.weight_bytes(str(ckpt)) == (16000, 4000)
    engine = systems.EngineSettings(str(ckpt), "float32")
    four = [mp.estimate(s, 1, engine) for s in ("iris", "iris-haproxy", "rayllm", "rayllm-haproxy")]
    three = [mp.estimate(s, 1, engine) for s in ("iris", "rayllm", "vllm")]
    assert three[2].total == mp.API_SERVER + mp.ENGINE_CORE + mp.GiB + 16000  # KV cache: VLLM_CPU_KVCACHE_SPACE=1
    iris = dict(four[0].parts)
    assert iris["Ingress x2"] == iris["Preprocess x2"] == 2 * mp.SERVE_REPLICA  # at their max_replicas
    assert iris["VisionEncoder weights x1"] == 4000 and iris["weights x1"] == 16000
    assert four[1].total == four[0].total + mp.HAPROXY
    assert mp.estimate("iris", 2, engine).total - four[0].total == mp.SERVE_REPLICA + mp.ENGINE_CORE + mp.GiB + 16000
    machine = {"available": 19 * mp.GiB, "total": int(23.5 * mp.GiB)}
    refused = mp.check([four], rounds=3, **machine)
    assert refused.startswith("Not started") and "Available now: 19.0 GiB of 23.5 GiB" in refused
    assert all(f"  {e.system} x1: {mp.gib(e.total)}" in refused for e in four), refused
    assert "fewer --systems" in refused and "no --rounds" in refused and "--ignore-memory-estimate" in refused
    assert mp.check([three], rounds=3, **machine) is None
    assert mp.check([[e] for e in four], rounds=1, **machine) is None
    assert mp.estimate("vllm", 1, replace(engine, gpu=True)).total == mp.API_SERVER + mp.ENGINE_CORE
    assert (
        mp.estimate("vllm", 1, replace(engine, checkpoint="no-such/model-here"))
        .parts[-1][0]
        .startswith("weights unknown")
    )

    out = tmp_path / "out"
    refusal = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "compare",
            "--model",
            str(ckpt),
            "--systems",
            "iris,vllm",
            "--replicas",
            "64",
            "--rounds",
            "2",
            "--out-dir",
            str(out),
        ],
        cwd=BENCH.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refusal.returncode == 2 and "Not started" in refusal.stderr and "iris x64" in refusal.stderr, refusal.stderr
    assert not out.exists()  # refused before anything started or was written
    record = mp.refuse_unless_fits([["vllm"]], [64], engine, 1, ignore=True)
    assert record["fits"] is False and record["estimates"][0]["system"] == "vllm"


_CHILD = """
import sys, time
from pathlib import Path
from bench.harness import processes, systems
from bench.harness.profiler import process_tree
mode, folder = sys.argv[1], Path(sys.argv[2])
# The system's leader notes SIGTERM (so it ran: it was continued first) and exits, leaving its sleep behind.
proc = systems._spawn(["bash", "-c", f"trap 'echo TERM > {folder / 'marker'}; exit 0' TERM; sleep 300 & wait"],
                      folder / "log")
system = systems.RunningSystem("vllm", 1, [], [], [proc], [folder / "log"], 0.0)
while len(process_tree([proc.pid])) < 2:
    time.sleep(0.05)
system.pause()
with processes.stop_on_signals():
    print(" ".join(map(str, process_tree([proc.pid]))), flush=True)
    if mode == "exception":
        raise RuntimeError("the harness failed")
    if mode != "exit":
        time.sleep(120)
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "exit", "exception"])
def test_the_harness_resumes_then_stops_every_system_it_started_however_it_ends(tmp_path, how):
    """A harness process starts a system (a process session), pauses it (SIGSTOP, as --pause-idle),
    and is then stopped with SIGTERM or Ctrl-C, or ends normally or with an exception: the system
    is continued first (its leader runs its SIGTERM trap) and then ended, its whole session with it."""
    from bench.harness.liveness import _running

    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), how, str(tmp_path)],
        cwd=BENCH.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(pid) for pid in child.stdout.readline().split()]
        assert len(pids) == 2, child.stderr.read()
        if how.startswith("SIG"):
            assert {Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] for pid in pids} == {"T"}
            child.send_signal(getattr(signal, how))
        _, err = child.communicate(timeout=90)
    finally:
        child.kill()
    assert child.returncode == {"SIGTERM": 143, "SIGINT": -signal.SIGINT, "exit": 0, "exception": 1}[how], err
    if how.startswith("SIG"):
        assert f"bench: {how}: continuing and stopping the 1 system process session(s)" in err
    assert (tmp_path / "marker").read_text().strip() == "TERM"  # SIGCONT before SIGTERM: its trap ran
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if _running(pid)]
        time.sleep(0.05)


_FAKE_IRIS = """
(exec -a ray::ServeReplica:iris:LLMDecode sleep 300) &
(exec -a ray::ServeReplica:iris:Ingress sleep 300) &
(exec -a VLLM::EngineCore sleep 300) &
while true; do (exec -a ray::ServeController sleep 300); done &
wait
"""


def test_a_dying_replica_engine_controller_or_runner_breaks_the_system_with_a_clear_message(tmp_path):
    """Real processes named as Ray and vLLM name theirs, under a runner: the watch names what died
    (a fixed deployment's replica, the engine core, the Serve controller, an autoscaled deployment
    below its minimum, the runner itself), stays broken, ends a load in progress within its
    interval, and leaves a paused system alone."""
    import asyncio
    import threading

    from bench.harness import liveness, systems
    from bench.harness.profiler import process_tree

    root = subprocess.Popen(["bash", "-c", _FAKE_IRIS], start_new_session=True, stderr=subprocess.DEVNULL)
    config = systems.iris_config(systems.EngineSettings("ckpt", "float32"), 1, 0, cache=True, namespace="x")
    system = systems.RunningSystem("iris", 1, [], [], [root], [tmp_path / "iris-1.log"], 0.0, meta={"config": config})

    def pid_of(name: str) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = [pid for pid, cmd in process_tree([root.pid]).items() if cmd.startswith(name + " ")]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no {name}")

    def gone(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        while liveness._running(pid):
            time.sleep(0.01)

    try:
        names = [
            "ray::ServeReplica:iris:LLMDecode",
            "ray::ServeReplica:iris:Ingress",
            "VLLM::EngineCore",
            "ray::ServeController",
        ]
        pids = {name: pid_of(name) for name in names}
        watch = liveness.Watch(system)
        assert sorted(kind for kind, _ in watch.baseline.values()) == ["controller", "engine", "replica", "replica"]
        assert watch.check() is None
        system.pause()
        assert watch.check() is None  # stopped is not dead
        system.resume()

        gone(pids["ray::ServeReplica:iris:LLMDecode"])
        problem = watch.alive()
        assert (
            problem.startswith(f"iris: replica iris:LLMDecode (pid {pids[names[0]]}) died") and "iris-1.log" in problem
        )
        assert watch.check() == problem  # broken stays broken

        watch = liveness.Watch(system)
        threading.Timer(0.3, gone, (pids["VLLM::EngineCore"],)).start()
        started = time.monotonic()
        with pytest.raises(liveness.SystemBroken, match=r"iris: VLLM::EngineCore \(a vLLM engine\) \(pid \d+\) died"):
            asyncio.run(liveness.guarded(asyncio.sleep(60), watch, interval_s=0.1))
        assert time.monotonic() - started < 5

        watch = liveness.Watch(system)
        gone(pids["ray::ServeController"])
        assert f"the Serve controller (pid {pids['ray::ServeController']}) died" in watch.check()
        assert pid_of("ray::ServeController") != pids["ray::ServeController"]  # restarted, as Ray would

        watch = liveness.Watch(system)
        gone(pids["ray::ServeReplica:iris:Ingress"])
        assert watch.alive() is None  # Ingress autoscales: one replica more or less is no death...
        assert "Ingress has 0 live replicas, fewer than its minimum 1" in watch.check()  # ...none at all is

        watch = liveness.Watch(system)
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
        assert f"iris: iris-1.log (pid {root.pid}) exited with -9" in watch.alive()
    finally:
        try:
            os.killpg(root.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        root.wait()


def test_a_variant_is_its_system_with_environment_of_its_own_compared_with_it_and_the_peers(tmp_path, monkeypatch):
    """`compare --variant iris-haproxy@mp:VLLM_ENABLE_V1_MULTIPROCESSING=1` runs iris-haproxy again
    with that environment beside iris-haproxy itself: an A/B of a setting within one run."""
    from bench import compare
    from bench.harness import report, systems

    variants = compare.parse_variants(["iris-haproxy@mp:VLLM_ENABLE_V1_MULTIPROCESSING=1,A=b", "vllm@x:K=V"])
    assert variants == {"iris-haproxy@mp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "A": "b"}, "vllm@x": {"K": "V"}}
    for bad in ("iris-haproxy:K=V", "nosuch@x:K=V", "iris@x", "iris@x:K"):
        with pytest.raises(SystemExit, match="NAME@LABEL"):
            compare.parse_variants([bad])
    with pytest.raises(SystemExit, match="iris@undeclared"):
        compare.run_comparison(compare.parse_args(["--systems", "iris,iris@undeclared"]), "")

    spawned = []
    monkeypatch.setattr(systems, "_spawn", lambda cmd, log, env=None: spawned.append((cmd, log, env)))
    monkeypatch.setattr(systems.RunningSystem, "wait_ready", lambda self, *a: self)
    engine = systems.EngineSettings("/nonexistent", "float32")
    started = systems.start("vllm@x", 1, engine, tmp_path, env={"K": "V"})
    assert started.name == "vllm@x" and spawned[-1][2]["K"] == "V" and spawned[-1][1].name.startswith("vllm@x-")
    started = systems.start("rayllm@x", 1, engine, tmp_path, env={"K": "V"})
    assert started.name == "rayllm@x" and spawned[-1][2]["K"] == "V"  # the runner's: its Ray cluster's

    summary = report.summarize([], 1.0, 0, None) | {"req_per_s": 2.0}
    results = [
        {"system": name, "replicas": 1, "point": "text-c1", "summary": summary}
        for name in ("iris-haproxy", "iris-haproxy@mp", "rayllm", "vllm@x")
    ]
    assert sorted((r["system"], r["peer"]) for r in report.ratios(results)) == [
        ("iris-haproxy", "rayllm"),
        ("iris-haproxy", "vllm@x"),
        ("iris-haproxy@mp", "iris-haproxy"),
        ("iris-haproxy@mp", "rayllm"),
        ("iris-haproxy@mp", "vllm@x"),
    ]


def test_two_models_bench_configs_are_apps_of_the_models_it_names():
    """bench two-models's setups: one app of both models (the VLM's stages and the text model's
    LLMDecode under their per-model names, as the app builds them) and an app of each alone."""
    from bench import two_models
    from bench.harness import systems
    from deployments.app import deployment_name
    from deployments.config import IrisConfig

    engine = systems.EngineSettings("/ckpt", "float32")
    both = systems.iris_config(engine, 1, 8000, cache=True, namespace="x")
    two_models.two_model_config(both, "/text")
    app = both["applications"][0]
    config = IrisConfig.model_validate(app["args"])
    vlm, text = config.model_configs()
    assert (vlm.model, vlm.model_name, text.model, text.model_name) == ("/ckpt", "vlm", "/text", "text")
    assert text.engine_args == vlm.engine_args
    expected = ["Ingress"] + [
        deployment_name(stage, config, model)
        for model, stages in ((vlm, ("Preprocess", "VisionEncoder", "LLMDecode")), (text, ("LLMDecode",)))
        for stage in stages
    ]
    assert [d["name"] for d in app["deployments"]] == expected
    for name, deployments in (("vlm", 4), ("text", 2)):
        alone = systems.iris_config(engine, 1, 8000, cache=True, namespace="x")
        two_models.one_model_config(alone, name, "/text")
        one = alone["applications"][0]
        assert IrisConfig.model_validate(one["args"]).model_name == name and len(one["deployments"]) == deployments
