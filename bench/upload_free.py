"""Upload-free requests with iris_client against plain uploads, and against the peers sending the
bytes every time: bytes on the wire and p50 time to first token, one streamed request at a time,
with ~2 MB photos (2800x2100 JPEGs of smooth pictures plus noise, bench/harness/workloads.py).

Cases, `--requests` each per system and round:

    plain, cached        the openai client sends the same photo's bytes every time (the server
                         has its features: only the upload, its parse and its hash remain; a peer
                         still decodes the photo, then finds its processor and prefix caches warm)
    plain, new           a new photo each time, with its bytes
    client, cached       (Iris) iris_client sends the photo it sent before by content uuid only
    client, miss+resend  (Iris) a new photo that the client believes sent (as after the cache lost
                         it): the id alone is answered 409 mm_cache_miss, then the client resends
                         the bytes; the time to first token counts both attempts

Iris (`--iris`, as shipped behind HAProxy by default) and the peers (`--peers vllm,rayllm`) are up
side by side and take turns, case after case, for `--rounds` rounds, the order rotated each round,
the systems not being measured paused (SIGSTOP, as `compare --pause-idle`), new photos each round
(the "new" photos are the same for every system: each sees them once). Per round, a case's p50
TTFT of one system is divided by another's; a ratio is reported as the median of the rounds' with
its range. The clock of a request starts with the photo's bytes in hand: the data: URL (plain) or
the hash and, when bytes go, the data: URL (client) are the caller's cost. Bytes on the wire are
the request bodies' (both attempts of a resend), counted on the openai client's HTTP client.

    python -m bench upload_free --peers vllm,rayllm    # bench/results/upload_free/upload_free.{json,md}
"""

from __future__ import annotations

import base64
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import liveness, memory_plan, results, systems
from bench.harness.stats import median_and_range, percentile
from bench.harness.workloads import ImageSpec

QUESTION = "Describe this photo in one sentence."
PHOTO_PX = (2800, 2100)  # a JPEG of ~2.0 MB at quality 90 from workloads' photo generator
MAX_TOKENS = 8
CACHED, NEW = "plain, cached", "plain, new"
CLIENT_CACHED, CLIENT_MISS = "client, cached", "client, miss+resend"
IRIS_CASES = (CACHED, CLIENT_CACHED, NEW, CLIENT_MISS)
PEER_CASES = (CACHED, NEW)


def photo(seed: int, width: int = PHOTO_PX[0], height: int = PHOTO_PX[1]) -> bytes:
    """A JPEG photo (bench/harness/workloads.py's generator: compresses as a photo does)."""
    return base64.b64decode(ImageSpec(seed, width, height, "JPEG").data_url.split(",", 1)[1])


def comparisons(iris: str, peers: list[str]) -> list[tuple[str, tuple[str, str], tuple[str, str]]]:
    """(what, numerator, denominator) pairs of (system, case) whose p50 TTFT ratio is reported."""
    pairs = [
        ("the client's id / plain upload, cached (Iris)", (iris, CLIENT_CACHED), (iris, CACHED)),
        ("the client's miss+resend / plain upload, new (Iris)", (iris, CLIENT_MISS), (iris, NEW)),
    ]
    for peer in peers:
        pairs += [
            (f"Iris's client, cached / {peer}, the same photo's bytes", (iris, CLIENT_CACHED), (peer, CACHED)),
            (f"Iris plain, cached / {peer}, the same photo's bytes", (iris, CACHED), (peer, CACHED)),
            (f"Iris's client, miss+resend / {peer}, a new photo", (iris, CLIENT_MISS), (peer, NEW)),
            (f"Iris plain, new / {peer}, a new photo", (iris, NEW), (peer, NEW)),
        ]
    return pairs


class Wire:
    """Request bodies' bytes, from a hook on the openai client's HTTP client."""

    def __init__(self):
        import httpx2  # the openai client's HTTP library

        self.sizes: list[int] = []
        self.http = httpx2.Client(timeout=600, event_hooks={"request": [lambda r: self.sizes.append(len(r.content))]})

    def take(self) -> int:
        total, self.sizes = sum(self.sizes), []
        return total


class Caller:
    """One system's two clients over one HTTP client: the openai client (plain uploads) and, for
    Iris, iris_client on top of it (ids first). Requests are streamed; each is read to its end."""

    def __init__(self, base_url: str):
        import openai

        from iris_client import IrisClient, SentKeys

        self.wire = Wire()
        self.plain = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="bench", max_retries=0, http_client=self.wire.http
        )
        self.sent = SentKeys()
        self.client = IrisClient(openai_client=self.plain, sent=self.sent)

    def believe_sent(self, png: bytes) -> None:
        """The client takes `png` for sent before (its id goes first), as after the server lost it."""
        from iris_client import content_uuid
        from iris_client.content import data_url

        self.sent.add((self.client.scope, content_uuid(png)), len(data_url(png)))

    def ask(self, png: bytes, through_client: bool) -> dict:
        """One request: seconds to the first streamed chunk with choices (as vLLM's bench client
        counts it), request bytes on the wire, attempts."""
        from iris_client.content import data_url

        self.wire.take()
        start = time.perf_counter()
        if through_client:
            part = {"type": "image", "image": png}
        else:
            part = {"type": "image_url", "image_url": {"url": data_url(png)}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
        create = (self.client if through_client else self.plain).chat.completions.create
        stream = create(model=systems.SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        ttft = None
        for chunk in stream:  # read to the end: the connection goes back to the pool for the next request
            if ttft is None and chunk.choices:
                ttft = time.perf_counter() - start
        if ttft is None:
            raise RuntimeError("the stream ended without a chunk with choices")
        return {
            "ttft_s": ttft,
            "wire_bytes": self.wire.take(),
            "attempts": getattr(getattr(stream, "iris", None), "attempts", 1),
        }


def run_case(caller: Caller, case: str, photos: list[bytes]) -> dict:
    """`case` over `photos`, one request at a time; a failed request is recorded, not retried."""
    records, errors = [], []
    for png in photos:
        if case == CLIENT_MISS:
            caller.believe_sent(png)
        try:
            records.append(caller.ask(png, through_client=case in (CLIENT_CACHED, CLIENT_MISS)))
        except Exception as err:  # the openai client's errors, a broken stream
            errors.append(f"{type(err).__name__}: {err}"[:300])
    return case_result(records, len(photos), errors)


def case_result(records: list[dict], requests: int, errors: list[str] = ()) -> dict:
    """A case's figures from its requests' records (ttft_s, wire_bytes, attempts)."""
    ttfts = [r["ttft_s"] for r in records]
    sizes = [r["wire_bytes"] for r in records]
    return {
        "requests": requests,
        "ok": len(records),
        "failed": requests - len(records),
        "errors": list(errors)[:3],
        "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1) if ttfts else None,
        "ttft_ms": [round(t * 1000, 1) for t in ttfts],
        "wire_bytes_per_request": round(sum(sizes) / len(sizes)) if sizes else None,
        "resends": sum(r["attempts"] > 1 for r in records),
    }


def summarise(rounds: list[dict], iris: str, peers: list[str]) -> dict:
    """Per system and case, the median (and range) of the rounds' p50 TTFT and bytes per request;
    per comparison, the median (and range) of the rounds' ratios."""
    cases: dict[str, dict[str, dict]] = {}
    for system in [iris, *peers]:
        for case in IRIS_CASES if system == iris else PEER_CASES:
            per_round = [r["results"].get(system, {}).get(case) for r in rounds]
            done = [c for c in per_round if c]
            cases.setdefault(system, {})[case] = {
                "ttft_p50_ms": median_and_range([c["ttft_p50_ms"] for c in done], 1),
                "wire_bytes_per_request": median_and_range([c["wire_bytes_per_request"] for c in done], 0),
                "requests": sum(c["requests"] for c in done),
                "failed": sum(c["failed"] for c in done),
                "resends": sum(c["resends"] for c in done),
            }
    ratios = []
    for what, (num_system, num_case), (den_system, den_case) in comparisons(iris, peers):
        ttft, wire = [], []
        for r in rounds:
            num = r["results"].get(num_system, {}).get(num_case) or {}
            den = r["results"].get(den_system, {}).get(den_case) or {}
            if num.get("ttft_p50_ms") and den.get("ttft_p50_ms"):
                ttft.append(num["ttft_p50_ms"] / den["ttft_p50_ms"])
                wire.append(num["wire_bytes_per_request"] / den["wire_bytes_per_request"])
        ratios.append(
            {
                "what": what,
                "numerator": [num_system, num_case],
                "denominator": [den_system, den_case],
                "rounds": len(ttft),
                "ttft_p50": median_and_range(ttft),
                "wire_bytes": median_and_range(wire, 4),
            }
        )
    return {"cases": cases, "ratios": ratios}


def _range(stat: dict, fmt: str) -> str:
    if stat["median"] is None:
        return "–"
    return f"{stat['median']:{fmt}} ({stat['min']:{fmt}}–{stat['max']:{fmt}})"


def markdown(run: dict) -> str:
    summary = run["summary"]
    lines = [
        f"# Upload-free requests with iris_client ({run['model']})",
        "",
        f"Commit `{run['commit']}`; {run['machine']['description']}; {run['started']}; "
        f"{run['duration_s'] / 60:.1f} min in all.",
        "",
        f"    {run['command']}",
        "",
        f"One streamed request at a time, {run['requests']} per case, system and round, {run['rounds']} rounds "
        f"(the systems up side by side, taking turns, the others paused: {run['pause_idle']}); photos of "
        f"{run['photo_bytes'] / 1e6:.2f} MB ({run['photo_px'][0]}x{run['photo_px'][1]} JPEG), "
        f"max_tokens {MAX_TOKENS}. Figures: the median of the rounds' (their range).",
        "",
        "| system | case | request bytes on the wire | p50 TTFT (ms) | requests | failed | resends |",
        "|---|---|---|---|---|---|---|",
    ]
    for system, cases in summary["cases"].items():
        for case, c in cases.items():
            wire = c["wire_bytes_per_request"]["median"]
            lines.append(
                f"| {system} | {case} | {'–' if wire is None else f'{wire:,.0f}'} "
                f"| {_range(c['ttft_p50_ms'], '.0f')} | {c['requests']} | {c['failed']} | {c['resends']} |"
            )
    lines += [
        "",
        "Ratios, per round then the median of the rounds' (range):",
        "",
        "| comparison | p50 TTFT | request bytes |",
        "|---|---|---|",
    ]
    for ratio in summary["ratios"]:
        lines.append(f"| {ratio['what']} | {_range(ratio['ttft_p50'], '.2f')} | {_range(ratio['wire_bytes'], '.4f')} |")
    problems = [f"- {s['system']}: {s['error'][:300]}" for s in run["starts"] if "error" in s]
    problems += [f"- round {r['round']}: {b}" for r in run["per_round"] for b in r.get("broken", [])]
    if problems:
        lines += ["", "Problems:", "", *problems]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = results.parser("upload_free", __doc__)
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--requests", type=int, default=4, help="requests per case, system and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iris", default="iris-haproxy", help="the Iris system (bench/harness/systems.py)")
    parser.add_argument("--peers", default="", help="comma-separated: vllm, rayllm (bytes every time)")
    parser.add_argument("--no-pause-idle", action="store_true", help="leave the systems not being measured running")
    parser.add_argument(
        "--eager", action="store_true", help="engines without torch.compile (quicker starts; smoke tests, not figures)"
    )
    parser.add_argument("--ignore-memory-estimate", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="upload_free")
    parser.add_argument("--out-dir", default=str(results.RESULTS_DIR / "upload_free"))
    args = parser.parse_args(argv)

    from pipeline.model.source import checkpoint_dtype, resolve_model

    peers = [p for p in args.peers.split(",") if p]
    names = [args.iris, *peers]
    if not args.iris.startswith("iris") or any(
        systems.base_system(n) not in systems.SYSTEMS or n.startswith("iris") for n in peers
    ):
        raise SystemExit(f"--iris: an Iris system; --peers: others of {', '.join(systems.SYSTEMS)}")
    checkpoint = resolve_model(args.model)
    engine = systems.EngineSettings(checkpoint, checkpoint_dtype(checkpoint), max_images=1, eager=args.eager)
    try:
        # Up side by side, as `compare --rounds` runs them (so checked as such: rounds > 1).
        memory = memory_plan.refuse_unless_fits([names], [1], engine, 2, args.ignore_memory_estimate)
    except memory_plan.DoesNotFit as refused:
        print(refused, file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    run = {
        **results.provenance(results.command_line("upload_free", argv)),
        "model": args.model,
        "checkpoint": checkpoint,
        "requests": args.requests,
        "rounds": args.rounds,
        "systems": names,
        "pause_idle": not args.no_pause_idle,
        "photo_px": list(PHOTO_PX),
        "memory": memory,
        "starts": [],
        "per_round": [],
        "duration_s": 0.0,
    }
    # Every photo made before any system starts: drawing a 6 MP picture takes a core for a second.
    plan = []
    for r in range(args.rounds):
        base = args.seed * 100_000 + r * 1000
        plan.append(
            {
                "cached": photo(base),
                "new": [photo(base + 1 + i) for i in range(args.requests)],
                "miss": [photo(base + 500 + i) for i in range(args.requests)],
            }
        )
    sizes = [len(p) for r in plan for p in [r["cached"], *r["new"], *r["miss"]]]
    run["photo_bytes"] = round(sum(sizes) / len(sizes))
    t0 = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="upload-free-logs-"))
    running: dict[str, systems.RunningSystem] = {}
    callers: dict[str, Caller] = {}
    watches: dict[str, liveness.Watch] = {}
    try:
        for name in names:
            print(f"starting {name}", file=sys.stderr, flush=True)
            try:
                system = systems.start(name, 1, engine, log_dir)
            except Exception as err:  # one system that cannot start does not stop the others
                run["starts"].append({"system": name, "error": str(err)[-2000:]})
                continue
            running[name], callers[name] = system, Caller(system.base_urls[0])
            warm = [photo(args.seed * 100_000 + 99_000 + i) for i in range(2)]
            for png in warm:  # first-request costs (imports, compiled graphs) out of the figures
                callers[name].ask(png, through_client=False)
            run["starts"].append({"system": name, "start_s": round(system.start_s, 1), "warm_up": len(warm)})
            watches[name] = liveness.Watch(system)
        for r, photos in enumerate(plan):
            order = names[r % len(names) :] + names[: r % len(names)]
            record = {"round": r, "order": order, "results": {}, "broken": []}
            for case in IRIS_CASES:
                for name in order:
                    if name not in running or (case not in PEER_CASES and name != args.iris):
                        continue
                    if problem := watches[name].check():
                        record["broken"].append(f"{name}: {problem}")
                        running.pop(name).stop()
                        continue
                    caller = callers[name]
                    if case in (CACHED, CLIENT_CACHED) and not record["results"].get(name):
                        # The round's cached photo, stored once through the client (it then knows it sent).
                        caller.ask(photos["cached"], through_client=name == args.iris)
                    print(f"round {r + 1}/{args.rounds}: {name}, {case}", file=sys.stderr, flush=True)
                    batch = {
                        CACHED: [photos["cached"]] * args.requests,
                        CLIENT_CACHED: [photos["cached"]] * args.requests,
                        NEW: photos["new"],
                        CLIENT_MISS: photos["miss"],
                    }[case]
                    with systems.measured_alone(running, name, not args.no_pause_idle):
                        record["results"].setdefault(name, {})[case] = run_case(caller, case, batch)
            run["per_round"].append(record)
            run["summary"] = summarise(run["per_round"], args.iris, peers)
            run["duration_s"] = time.monotonic() - t0
            results.save(run, out / f"{args.name}.json", markdown(run))  # partial results survive a crash
    finally:
        for system in running.values():
            system.stop()
    run["summary"] = summarise(run["per_round"], args.iris, peers)
    run["duration_s"] = time.monotonic() - t0
    results.save(run, out / f"{args.name}.json", markdown(run))
    print(markdown(run))
    return 0


if __name__ == "__main__":
    sys.exit("run it as: python -m bench upload_free [options]")
