"""Upload-free requests with iris_client against plain uploads: bytes on the wire and p50 time
to first token, one request at a time, with ~2 MB photos (noise PNGs, which do not compress).

Cases, each `--requests` streamed requests:

    plain, cached        the openai client sends the same image's bytes every time (the server
                         has its features: only the upload, its parse and its hash remain)
    client, cached       iris_client sends it by content uuid only
    plain, new           a new image each time, with its bytes
    client, miss+resend  a new image each time that the client believes sent: the id alone is
                         answered 409 mm_cache_miss, then the client resends the bytes

With `--peers vllm,rayllm` the same photos go to `vllm serve` and Ray Serve LLM too, bytes every
time (they have no upload-free form); each peer starts in minutes on a CPU box.

    python -m bench upload_free --requests 8        # bench/results/upload_free/upload_free.{json,md}
"""

from __future__ import annotations

import io
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import results, systems
from bench.harness.stats import percentile

QUESTION = "Describe this photo in one sentence."


def photo(seed: int, megabytes: float = 2.0) -> bytes:
    """A PNG of RGB noise of about `megabytes` (noise does not compress: bytes ~ pixels x 3)."""
    import numpy as np
    from PIL import Image

    side = int((megabytes * 1e6 / 3) ** 0.5)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class Wire:
    """Request bodies' bytes, from a hook on the openai client's HTTP client."""

    def __init__(self):
        import httpx2  # the openai client's HTTP library

        self.sizes: list[int] = []
        self.http = httpx2.Client(timeout=300, event_hooks={"request": [lambda r: self.sizes.append(len(r.content))]})

    def take(self) -> int:
        total, self.sizes = sum(self.sizes), []
        return total


def _stream_ttft(stream) -> float:
    """Seconds from the call to its first content chunk (the call itself is timed by the caller)."""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return time.perf_counter()
    return time.perf_counter()


def run_case(create, images: list[bytes], wire: Wire, client_parts: bool) -> dict:
    """`create(messages)` per image, streamed; TTFT and bytes on the wire per request."""
    ttfts, sizes, resends = [], [], 0
    for png in images:
        from iris_client.content import data_url

        part = ({"type": "image", "image": png} if client_parts
                else {"type": "image_url", "image_url": {"url": data_url(png)}})
        messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
        wire.take()
        start = time.perf_counter()
        stream = create(messages)
        ttfts.append(_stream_ttft(stream) - start)
        sizes.append(wire.take())
        resends += getattr(getattr(stream, "iris", None), "attempts", 1) > 1
    return {"requests": len(images), "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
            "ttft_ms": [round(t * 1000, 1) for t in ttfts], "wire_bytes_per_request": round(sum(sizes) / len(sizes)),
            "resends": resends}


def measure(base_url: str, system: str, n: int, seed: int, upload_free: bool) -> dict:
    import openai

    from iris_client import IrisClient, SentKeys, content_uuid
    from iris_client.content import data_url

    wire = Wire()
    plain = openai.OpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, http_client=wire.http)

    def create_plain(messages):
        return plain.chat.completions.create(model=systems.SERVED_NAME, messages=messages, max_tokens=8,
                                             temperature=0, stream=True)

    cached = photo(seed)
    create_plain([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(cached)}},
                                               {"type": "text", "text": QUESTION}]}])  # warm: features cached
    cases = {"plain, cached": run_case(create_plain, [cached] * n, wire, False),
             "plain, new": run_case(create_plain, [photo(seed + 1 + i) for i in range(n)], wire, False)}
    if upload_free:
        sent = SentKeys()
        client = IrisClient(openai_client=plain, sent=sent)

        def create_client(messages):
            return client.chat.completions.create(model=systems.SERVED_NAME, messages=messages, max_tokens=8,
                                                  temperature=0, stream=True)

        cases["client, cached"] = run_case(create_client, [cached] * n, wire, True)
        new = [photo(seed + 1000 + i) for i in range(n)]
        for png in new:  # believed sent: the optimistic id meets a 409, then the bytes go
            sent.add((client.scope, content_uuid(png)), len(data_url(png)))
        cases["client, miss+resend"] = run_case(create_client, new, wire, True)
    return {"system": system, "photo_bytes": len(cached), "cases": cases}


def markdown(run: dict) -> str:
    lines = [f"# Upload-free requests with iris_client ({run['model']})", "",
             f"Commit `{run['commit']}`; {run['machine']['description']}; {run['started']}.", "",
             f"    {run['command']}", "",
             f"One streamed request at a time, {run['requests']} per case, photos of "
             f"{run['systems'][0]['photo_bytes'] / 1e6:.2f} MB (noise PNG), max_tokens 8.", "",
             "| system | case | bytes on the wire per request | p50 TTFT (ms) | resends |", "|---|---|---|---|---|"]
    for s in run["systems"]:
        for case, r in s["cases"].items():
            lines.append(f"| {s['system']} | {case} | {r['wire_bytes_per_request']:,} | {r['ttft_p50_ms']:.1f} "
                         f"| {r['resends']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = results.parser("upload_free", __doc__)
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--requests", type=int, default=8, help="requests per case")
    parser.add_argument("--peers", default="", help="comma-separated: vllm, rayllm (bytes every time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(results.RESULTS_DIR / "upload_free"))
    args = parser.parse_args(argv)

    from pipeline.model.source import checkpoint_dtype, resolve_model

    checkpoint = resolve_model(args.model)
    engine = systems.EngineSettings(checkpoint, checkpoint_dtype(checkpoint), max_images=1, eager=True)
    run = {**results.provenance(results.command_line("upload_free", argv)), "model": args.model,
           "requests": args.requests, "systems": []}
    for name in ["iris", *filter(None, args.peers.split(","))]:
        log_dir = Path(tempfile.mkdtemp(prefix=f"upload-free-{name}-"))
        system = systems.start(name, 1, engine, log_dir)
        try:
            run["systems"].append(measure(system.base_urls[0], name, args.requests, args.seed,
                                          upload_free=name.startswith("iris")))
        finally:
            system.stop()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results.save(run, out / "upload_free.json", markdown(run))
    print(markdown(run))


if __name__ == "__main__":
    sys.exit("run it as: python -m bench upload_free [options]")
