"""What one image costs on a decode replica when its features reach vLLM through Iris's EC
connector (pipeline/model/ec_connector.py) rather than as embeddings, step by step, on the CPU.

    python -m bench ec-connector [--models builtin:tiny-gemma3,builtin:bench-llava] [--rounds 5]

Per image size, for each model (its VisionModel: vLLM's loaders, processor and encoder):
- decode: vLLM's image loader on the bytes the features carry (LLMDecode, in a thread);
- processor: vLLM's multimodal processor on the decoded image, which the engine's input
  processing runs (LLMDecode's process) to lay out the placeholders; vLLM's processor cache
  skips it for an item it processed before under the same key;
- stage: Iris's codec and a file write into the staging folder (tmpfs) (LLMDecode);
- load: the connector's read, checksum and check (the engine's scheduler process);
- embeddings: what the embeddings path does instead (LLMDecode's embedding_input), for a
  model that takes embeddings.
Milliseconds: the median of the rounds' medians. The whole path's time to first token, with
and without the connector, is `python -m bench compare --systems iris,iris-connector,...`.
Writes bench/results/ec_connector/ec_connector_cost.{json,md}.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.harness import results
from bench.harness.stats import percentile, timed

SIZES = {"224x224": (224, 224), "640x480": (640, 480), "1024x1024": (1024, 1024)}
DEFAULT_MODELS = "builtin:tiny-gemma3,builtin:tiny-llava,builtin:bench-llava"


def jpeg(width: int, height: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width * height)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def measure(model: str, rounds: int, iters: int) -> dict:
    from cache_service import codec
    from pipeline.model.ec_staging import FeatureStaging, staged_name, values_of
    from pipeline.model.embedding_form import CONNECTOR
    from pipeline.model.source import resolve_model
    from pipeline.model.vision_model import VisionModel

    vision = VisionModel(resolve_model(model), connector=True)
    vision.load_encoder()
    embeddings = VisionModel(resolve_model(model))
    embeddings.load_encoder()
    takes_embeddings = embeddings.forms["image"].delivery != CONNECTOR
    staging = FeatureStaging()
    out = {"model": model, "takes_embeddings": takes_embeddings, "sizes": {}}
    for name, (w, h) in SIZES.items():
        data = jpeg(w, h)
        image = vision.load_image(data)
        pixels = vision.preprocess(image)
        pixels.source = data
        (features,) = vision.encode([pixels])
        (plain,) = embeddings.encode([embeddings.preprocess(image)])
        key = f"bench-{name}"

        def stage():  # a write and its removal, as for a request that is the item's only user
            staging.stage(f"{key}-timed", features)
            staging.release([f"{key}-timed"])

        staging.stage(key, features)
        path = staging.dir / staged_name(key)
        steps = {
            "decode": lambda: vision.load_image(data),
            "processor": lambda: vision.preprocess(image),
            "stage": stage,
            "load": lambda: values_of(codec.decode(path.read_bytes())),
        }
        if takes_embeddings:
            steps["embeddings"] = lambda: embeddings.embedding_input([plain])
        per_round = {step: [] for step in steps}
        for r in range(rounds):
            for step, fn in steps.items() if r % 2 == 0 else reversed(steps.items()):
                per_round[step].append(percentile(timed(fn, iters), 50) * 1000)
        staging.release([key])
        ms = {step: round(percentile(v, 50), 3) for step, v in per_round.items()}
        values = features.tensors[vision.forms["image"].values_field]
        out["sizes"][name] = {
            "jpeg_bytes": len(data),
            "feature_rows": int(values.shape[0]),
            "feature_bytes": values.numel() * values.element_size(),
            "ms": ms,
            "connector_ms": round(sum(ms[s] for s in ("decode", "processor", "stage", "load")), 3),
        }
        print(
            f"{model:24} {name:10} rows {values.shape[0]:5}  "
            + "  ".join(f"{k} {v:.3f}" for k, v in ms.items())
            + f"  connector total {out['sizes'][name]['connector_ms']:.3f} ms",
            flush=True,
        )
    staging.close()
    return out


def main(argv: list[str]) -> int:
    parser = results.parser("ec-connector", __doc__)
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated models (builtin:... or folders)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10, help="timings per step, size and round")
    parser.add_argument("--out-dir", default=str(results.RESULTS_DIR / "ec_connector"))
    args = parser.parse_args(argv)
    run = {
        **results.provenance(results.command_line("ec-connector", argv)),
        "models": [measure(m, args.rounds, args.iters) for m in args.models.split(",")],
    }
    out = results.save(run, Path(args.out_dir) / "ec_connector_cost.json", markdown(run))
    print(f"saved {out}")
    return 0


def markdown(run: dict) -> str:
    lines = [
        "# One image through the EC connector, step by step (CPU)",
        "",
        f"Commit `{run['commit']}`; {results.describe(run['machine'])}; {run['started']}.",
        "",
        f"    {run['command']}",
        "",
        "Milliseconds per image, the median of the rounds' medians. decode, processor and stage run on the "
        "decode replica (LLMDecode), load in vLLM's engine process; embeddings is what the embeddings path "
        "does instead, for a model that takes them.",
        "",
        "| model | image | JPEG bytes | feature rows | feature bytes | decode | processor | stage | load | "
        "connector total | embeddings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in run["models"]:
        for name, s in m["sizes"].items():
            ms = s["ms"]
            embeddings = f"{ms['embeddings']:.3f}" if "embeddings" in ms else "-"
            lines.append(
                f"| `{m['model']}` | {name} | {s['jpeg_bytes']} | {s['feature_rows']} | {s['feature_bytes']} | "
                f"{ms['decode']:.2f} | {ms['processor']:.2f} | {ms['stage']:.2f} | {ms['load']:.2f} | "
                f"{s['connector_ms']:.2f} | {embeddings} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit("run it as: python -m bench ec-connector [options]")
