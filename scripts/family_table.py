"""The model-family table of docs/families.md and the README's family list, from vLLM's own
model registry.

    .venv/bin/python scripts/family_table.py          # rewrite both
    .venv/bin/python scripts/family_table.py --check  # exit 1 when either is stale

One row per multimodal architecture the installed vLLM registers: served by Iris (how its
features reach the decoder, as Iris's own start-up check decides on the built-in checkpoint,
the checkpoint and the test that proves it), or why not. For the others the path is read from
vLLM's source of the architecture's multimodal processing (its processor and processing-info
classes, with the vLLM classes they inherit from): the EC connector where it accepts no
precomputed image embeddings (no `ImageEmbeddingItems` branch, no dict-form `embedding_fields`
for images), else embeddings if vLLM takes the model's own features back unchanged.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "families.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- family-table:begin -->", "<!-- family-table:end -->"
README_BEGIN, README_END = "<!-- families:begin -->", "<!-- families:end -->"
# Architectures no built-in checkpoint can stand for, and why.
NO_BUILTIN: dict[str, str] = {}
REMOVED_VLMS = {"MllamaForConditionalGeneration": "Llama 3.2 Vision", "Phi4MMForCausalLM": "Phi-4-multimodal"}


def _processing_source(arch: str) -> str:
    """The source of the modules that hold the architecture's multimodal processing (its
    processor and processing-info classes and every vLLM class they inherit from)."""
    import inspect

    from vllm.model_executor.models.registry import ModelRegistry

    model_cls = ModelRegistry._try_load_model_cls(arch)
    if model_cls is None:
        raise ImportError(f"vLLM could not import {arch}")
    factory = model_cls._processor_factory
    # A factory part is a class, or a function that picks one (LLaVA's: LLaVA or Pixtral-HF): its module.
    modules = {
        cls.__module__
        for part in (factory.processor, factory.info)
        for cls in (inspect.getmro(part) if isinstance(part, type) else [part])
        if cls.__module__.startswith("vllm.model_executor.models.")
    }
    return "\n".join(inspect.getsource(sys.modules[m]) for m in sorted(modules))


def _builtin_architectures() -> dict[str, tuple[str, object, str]]:
    """architecture -> (built-in family, its Builtin, how its image features reach the decoder), from
    the built-in tiny checkpoints: their configs, and Iris's own start-up check on each."""
    sys.path.insert(0, str(ROOT))
    from pipeline.model.builtin import BUILDERS
    from pipeline.model.embedding_form import CONNECTOR
    from pipeline.model.source import resolve_model
    from pipeline.model.vision_model import VisionModel

    found = {}
    for family, builtin in BUILDERS.items():
        checkpoint = resolve_model(f"builtin:tiny-{family.replace('_', '-')}")
        vision = VisionModel(checkpoint, settings=builtin.engine_args)
        vision.load_encoder()
        path = "the EC connector" if vision.forms["image"].delivery == CONNECTOR else "image embeddings"
        # The architecture vLLM resolved from the checkpoint's config, in whatever format it is.
        found[vision.vllm_config.model_config.architecture] = (family, builtin, path)
    return found


def takes_image_embeddings(arch: str) -> bool:
    """Whether vLLM's multimodal processing of `arch` has an image-embedding input (read from
    its source); without one, Iris hands the decoder its features through the EC connector."""
    source = _processing_source(arch)
    return bool("ImageEmbeddingItems" in source or re.search(r'embedding_fields\s*=\s*\{\s*"image"', source))


def _why_not(arch: str) -> str:
    try:
        source = _processing_source(arch)
    except Exception as err:  # e.g. an optional dependency of that model file is not installed
        return f"not inspected: {type(err).__name__} on import"
    if '"image"' not in source and "'image'" not in source:
        return "no image input"
    path = "image embeddings if vLLM takes them back unchanged" if takes_image_embeddings(arch) else "the EC connector"
    return f"not tested: no built-in checkpoint yet; Iris would serve it through {path}"


TESTS = {"app": "tests/test_families.py", "engine": "tests/test_family_engines.py"}


def rows() -> list[tuple[str, str, str]]:
    """(architecture, vLLM model file, Iris) for every multimodal architecture of the installed vLLM."""
    from vllm.model_executor.models.registry import (
        _MULTIMODAL_MODELS,
        _PREVIOUSLY_SUPPORTED_MODELS,
    )

    builtins = _builtin_architectures()
    table = []
    for arch, (module, _) in sorted(_MULTIMODAL_MODELS.items()):
        if arch in NO_BUILTIN:
            status = NO_BUILTIN[arch]
        elif arch in builtins:
            family, builtin, path = builtins[arch]
            status = (
                f"**served** through {path}: `builtin:tiny-{family.replace('_', '-')}`, "
                f"`{TESTS[builtin.tested]}` [{family}]"
            )
        else:
            status = _why_not(arch)
        table.append((arch, f"{module.removeprefix('vllm.model_executor.models.')}.py", status))
    for arch, name in REMOVED_VLMS.items():
        if arch in _PREVIOUSLY_SUPPORTED_MODELS:
            table.append((arch, "-", f"no: {name}, removed from vLLM in {_PREVIOUSLY_SUPPORTED_MODELS[arch]}"))
    return table


def render(table: list[tuple[str, str, str]] | None = None) -> str:
    import vllm

    table = table or rows()
    served = [s for *_, s in table if s.startswith("**served**")]
    connector = sum("the EC connector" in s for s in served)
    lines = [
        BEGIN,
        f"Made by `scripts/family_table.py` from vLLM {vllm.__version__}'s model registry: "
        f"{len(table)} multimodal architectures, {len(served)} served and tested ({len(served) - connector} "
        f"through image embeddings, {connector} through the EC connector).",
        "",
        "| architecture | vLLM model file | Iris |",
        "|---|---|---|",
    ]
    lines += [f"| `{arch}` | `{module}` | {status} |" for arch, module, status in table]
    lines.append(END)
    return "\n".join(lines)


def readme_list(table: list[tuple[str, str, str]] | None = None) -> str:
    """The README's sentence of served families, from the table's served rows."""
    from pipeline.model.builtin import BUILDERS

    table = table or rows()
    by_path: dict[str, list[str]] = {"image embeddings": [], "the EC connector": []}
    for *_, status in table:
        match = re.match(r"\*\*served\*\* through (.+?): .*\[(\w+)\]$", status)
        if match:
            by_path[match.group(1)].append(BUILDERS[match.group(2)].name)
    embeddings, connector = (", ".join(sorted(names, key=str.lower)) for names in by_path.values())
    return (
        f"{README_BEGIN}{embeddings}; through Iris's EC connector, where vLLM takes no image embeddings "
        f"(or none for images of other sizes in one prompt): {connector}{README_END}"
    )


def doc_table(text: str, begin: str = BEGIN, end: str = END) -> str:
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[start:stop]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the table or the README's list is stale")
    args = parser.parse_args()
    table = rows()
    rendered = {DOC: (render(table), BEGIN, END), README: (readme_list(table), README_BEGIN, README_END)}
    for path, (new, begin, end) in rendered.items():
        text = path.read_text()
        if args.check:
            if doc_table(text, begin, end) != new:
                sys.exit(f"{path.name}'s family list is stale: run scripts/family_table.py")
            continue
        path.write_text(text.replace(doc_table(text, begin, end), new))
        print(f"{path.relative_to(ROOT)}: family list written")


if __name__ == "__main__":
    main()
