"""The model-family table of docs/families.md, from vLLM's own model registry.

    .venv/bin/python scripts/family_table.py          # rewrite the table in docs/families.md
    .venv/bin/python scripts/family_table.py --check  # exit 1 when docs/families.md's table is stale

One row per multimodal architecture the installed vLLM registers: served by Iris
(the built-in checkpoint and the test that proves it), or why not. "Why not" is
read from vLLM's source of the architecture's multimodal processing (its processor
and processing-info classes, with the vLLM classes they inherit from): whether it
takes image input at all, and whether it accepts precomputed image embeddings (an
`ImageEmbeddingItems` branch, or dict-form `embedding_fields` for images), which
is what Iris feeds the decoder. Built-in checkpoints that
vLLM serves but takes no embeddings for are proven unserved by a test
(Iris refuses them at start-up).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- family-table:begin -->", "<!-- family-table:end -->"
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
    modules = {cls.__module__ for part in (factory.processor, factory.info)
               for cls in (inspect.getmro(part) if isinstance(part, type) else [part])
               if cls.__module__.startswith("vllm.model_executor.models.")}
    return "\n".join(inspect.getsource(sys.modules[m]) for m in sorted(modules))


def _builtin_architectures() -> dict[str, tuple[str, bool]]:
    """architecture -> (built-in family, served), from the built-in tiny checkpoints' configs."""
    sys.path.insert(0, str(ROOT))
    from pipeline.models.builtin import BUILDERS
    from pipeline.models.source import resolve_model

    found = {}
    for family, builtin in BUILDERS.items():
        config = json.loads((Path(resolve_model(f"builtin:tiny-{family.replace('_', '-')}")) / "config.json").read_text())
        found[config["architectures"][0]] = (family, builtin.served)
    return found


def takes_image_embeddings(arch: str) -> bool:
    """Whether vLLM's multimodal processing of `arch` has an image-embedding input (read from
    its source): Iris then hands the decoder embeddings, else the EC connector."""
    source = _processing_source(arch)
    return bool("ImageEmbeddingItems" in source or re.search(r'embedding_fields\s*=\s*\{\s*"image"', source))


def _why_not(arch: str) -> str:
    try:
        source = _processing_source(arch)
    except Exception as err:  # e.g. an optional dependency of that model file is not installed
        return f"not inspected: {type(err).__name__} on import"
    if '"image"' not in source and "'image'" not in source:
        return "no image input"
    path = "image embeddings" if takes_image_embeddings(arch) else "the EC connector (vLLM takes no image embeddings)"
    return f"would take {path}; no built-in checkpoint or test in Iris yet"


def rows() -> list[tuple[str, str, str]]:
    """(architecture, vLLM model file, Iris) for every multimodal architecture of the installed vLLM."""
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS, _PREVIOUSLY_SUPPORTED_MODELS

    builtins = _builtin_architectures()
    table = []
    for arch, (module, _) in sorted(_MULTIMODAL_MODELS.items()):
        if arch in builtins:
            family, served = builtins[arch]
            name = f"`builtin:tiny-{family.replace('_', '-')}`"
            status = (f"**served**: {name}, `tests/test_families.py` [{family}]" if served else
                      f"no: vLLM takes no image embeddings for it ({name} refused at start-up, "
                      "`tests/test_vision_model.py`)")
        else:
            status = _why_not(arch)
        table.append((arch, f"{module.removeprefix('vllm.model_executor.models.')}.py", status))
    for arch, name in REMOVED_VLMS.items():
        if arch in _PREVIOUSLY_SUPPORTED_MODELS:
            table.append((arch, "-", f"no: {name}, removed from vLLM in {_PREVIOUSLY_SUPPORTED_MODELS[arch]}"))
    return table


def render() -> str:
    import vllm

    table = rows()
    served = sum(1 for *_, s in table if s.startswith("**served**"))
    lines = [BEGIN,
             f"Made by `scripts/family_table.py` from vLLM {vllm.__version__}'s model registry: "
             f"{len(table)} multimodal architectures, {served} served and tested end to end.",
             "",
             "| architecture | vLLM model file | Iris |",
             "|---|---|---|"]
    lines += [f"| `{arch}` | `{module}` | {status} |" for arch, module, status in table]
    lines.append(END)
    return "\n".join(lines)


def doc_table(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/families.md's table is stale")
    args = parser.parse_args()
    text = DOC.read_text()
    table = render()
    if args.check:
        if doc_table(text) != table:
            sys.exit("docs/families.md's family table is stale: run scripts/family_table.py")
        return
    DOC.write_text(text.replace(doc_table(text), table))
    print(f"docs/families.md: family table written ({table.count(chr(10)) - 4} rows)")


if __name__ == "__main__":
    main()
