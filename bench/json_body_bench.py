"""The ingress's request-body parse: msgspec's decoder against the standard library's json.loads.

    python -m bench json-body [--rounds 9] [--iters 20]

Bodies as clients send them: a chat request with the harness's 2.7 MB video clip, one
with a 640x480 JPEG, and a text-only one. Each round times both parsers on each body,
alternating which goes first; the figures are the median of the rounds' medians, and
the ratio msgspec ÷ json the median of the rounds' ratios with its range. Both paths
run pipeline/api/body.py's whole parse_json_body (UTF-8 check, depth check); the
stdlib one with msgspec's decoder made to refuse every body, as it does for NaN.
Writes bench/results/json_body.{json,md}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import msgspec

from bench.harness import results
from bench.harness.stats import median_and_range, percentile, timed
from bench.harness.workloads import VideoSpec, WorkloadFactory
from pipeline.api import body as json_body


def bodies() -> dict[str, bytes]:
    def chat(*parts: dict) -> bytes:
        content = [*parts, {"type": "text", "text": "What happens in this clip? Describe it in detail."}]
        return json.dumps(
            {"model": "m", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": content}]}
        ).encode()

    image = WorkloadFactory(0).large(1, width=640, height=480).conversations[0].turns[0].image
    return {
        "video (2.7 MB)": chat({"type": "video_url", "video_url": {"url": VideoSpec(7).data_url}}),
        "JPEG image": chat({"type": "image_url", "image_url": {"url": image.data_url}}),
        "text only": chat(),
    }


def _refused(raw):
    raise msgspec.DecodeError("refused")


def stdlib_parse(raw: bytes) -> dict:
    with mock.patch.object(json_body.msgspec.json, "decode", _refused):
        return json_body.parse_json_body(raw)


def main(argv: list[str]) -> int:
    parser = results.parser("json-body", __doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20, help="parses per parser, body and round")
    parser.add_argument("--out-dir", default=str(results.RESULTS_DIR))
    args = parser.parse_args(argv)
    run = {**results.provenance(results.command_line("json-body", argv)), "bodies": {}}
    for name, raw in bodies().items():
        assert stdlib_parse(raw) == json_body.parse_json_body(raw)  # the same body, whichever parser
        per_round = {"msgspec": [], "json": []}
        for r in range(args.rounds):
            order = [("msgspec", json_body.parse_json_body), ("json", stdlib_parse)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                per_round[label].append(percentile(timed(lambda: fn(raw), args.iters), 50) * 1000)
        ratio = median_and_range([m / j for m, j in zip(per_round["msgspec"], per_round["json"])])
        run["bodies"][name] = {
            "bytes": len(raw),
            "ms": {k: round(percentile(v, 50), 3) for k, v in per_round.items()},
            "rounds_ms": per_round,
            "msgspec_over_json": ratio,
        }
        print(
            f"{name:16} {len(raw):>9} B  msgspec {run['bodies'][name]['ms']['msgspec']:7.3f} ms  "
            f"json {run['bodies'][name]['ms']['json']:7.3f} ms  ratio {ratio['median']} ({ratio['min']}-{ratio['max']})"
        )
    out = results.save(run, Path(args.out_dir) / "json_body.json", markdown(run))
    print(f"saved {out}")
    return 0


def markdown(run: dict) -> str:
    lines = [
        "# The ingress's body parse: msgspec against json.loads",
        "",
        f"Commit `{run['commit']}`; {results.describe(run['machine'])}; {run['started']}.",
        "",
        f"    {run['command']}",
        "",
        "Milliseconds per parse_json_body (median of the rounds' medians); msgspec ÷ json: the median of the "
        "rounds' ratios (range).",
        "",
        "| body | bytes | msgspec | json.loads | msgspec ÷ json |",
        "|---|---|---|---|---|",
    ]
    for name, b in run["bodies"].items():
        r = b["msgspec_over_json"]
        lines.append(
            f"| {name} | {b['bytes']} | {b['ms']['msgspec']:.3f} | {b['ms']['json']:.3f} | "
            f"{r['median']} ({r['min']}–{r['max']}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit("run it as: python -m bench json-body [options]")
