"""The configuration reference in docs/configuration.md, rendered from the pydantic models.

    .venv/bin/python scripts/gen_config_docs.py          # rewrite the reference in docs/configuration.md
    .venv/bin/python scripts/gen_config_docs.py --check  # exit 1 when the reference is stale

The root is `IrisConfig` (deployments/config.py, the application `args` of
serve_config.yaml); every field whose type is itself a pydantic model (`cache`:
`CacheConfig` in cache_service/config.py, `media`: `MediaLimits` in pipeline/media/limits.py)
gets a table of its own, under its dotted name. One row per field: its name, its
type with the bounds pydantic enforces, its default, and its description.

The description is the field's `Field(description=...)` (or its attribute docstring,
which pydantic turns into one under `use_attribute_docstrings`); a field with neither
shows "—". Nothing here is written by hand, so a field added to a
model, a changed default or a new description makes `--check` (and tests/test_docs.py)
fail until this script is run again.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
MiB, GiB = 1 << 20, 1 << 30


def _root_model() -> type:
    sys.path.insert(0, str(ROOT))
    from deployments.config import IrisConfig

    return IrisConfig


# ---------------------------------------------------------------------------
# Descriptions from the source, for fields without Field(description=...)
# ---------------------------------------------------------------------------


def description(model: type, name: str) -> str:
    return " ".join((model.model_fields[name].description or "").split())


# ---------------------------------------------------------------------------
# Types, bounds, defaults
# ---------------------------------------------------------------------------

_BOUNDS = (
    ("gt", ">"),
    ("ge", "≥"),
    ("lt", "<"),
    ("le", "≤"),
    ("multiple_of", "multiple of"),
    ("min_length", "length ≥"),
    ("max_length", "length ≤"),
    ("pattern", "pattern"),
)


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for attr, word in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{word} {value}")
    return ", ".join(parts)


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Annotated:
        metadata = list(args[1:])
        for item in args[1:]:  # Field(...) inside Annotated carries its bounds in its own metadata
            metadata += list(getattr(item, "metadata", []))
        bounds = _bounds(metadata)
        return f"{_type(args[0])} ({bounds})" if bounds else _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a).replace("'", '"') for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]" if args else name
    if annotation is Any:
        return "Any"
    return getattr(annotation, "__name__", str(annotation))


def _field_type(info: Any) -> str:
    text = _type(info.annotation)
    bounds = _bounds(info.metadata)
    return f"{text} ({bounds})" if bounds else text


def _yaml(value: Any) -> str:
    """A value as it would be written in serve_config.yaml (flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (set, frozenset)):
        return "[" + ", ".join(_yaml(v) for v in sorted(value)) + "]"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(info: Any) -> str:
    from pydantic_core import PydanticUndefined

    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    text = f"`{_yaml(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and value >= MiB:
        for unit, size in (("GiB", GiB), ("MiB", MiB)):
            if value % size == 0:
                return f"{text} ({value // size} {unit})"
    return text


def _nested_model(annotation: Any) -> type | None:
    from pydantic import BaseModel

    candidates = [annotation, *typing.get_args(annotation)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _where(model: type) -> str:
    try:
        path = Path(inspect.getsourcefile(model)).resolve().relative_to(ROOT)
    except (TypeError, ValueError):
        return f"`{model.__name__}`"
    return f"`{model.__name__}` in [{path.as_posix()}](../{path.as_posix()})"


def _tables(model: type, prefix: str, title: str, out: list[str]) -> None:
    nested = []
    out += [
        f"### {title}",
        "",
        f"{_where(model)}."
        + (
            " Unknown keys stop start-up with a message naming them."
            if model.model_config.get("extra") == "forbid"
            else ""
        ),
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _nested_model(info.annotation)
        if sub is not None:
            if typing.get_origin(info.annotation) is dict:  # models by name: one table for any entry
                path = f"{path}.<name>"
            nested.append((sub, path))
            anchor = re.sub(r"[^\w\- ]", "", path).lower()  # GitHub's anchor of the table's heading
            default = f"see [`{path}`](#{anchor})"
        else:
            default = _default(info)
        row = [
            f"`{path}`",
            f"`{_type(info.annotation) if sub else _field_type(info)}`",
            default,
            description(model, name) or "—",
        ]
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    out.append("")
    for sub, path in nested:
        _tables(sub, f"{path}.", path, out)


def render(model: type | None = None) -> str:
    """The reference section, markers included, for `model` (default: IrisConfig)."""
    model = model or _root_model()
    out = [
        BEGIN,
        "<!-- Made by scripts/gen_config_docs.py from the pydantic models: do not edit by hand. -->",
        "",
        "Made by `scripts/gen_config_docs.py` from the pydantic models (`--check` says whether this "
        "is stale; `tests/test_docs.py` fails when it is). Types are Python's: `None` is YAML's `null`, "
        "a `frozenset` is written as a YAML list. Bounds in brackets are enforced at start-up.",
        "",
    ]
    _tables(model, "", "args", out)
    out.append(END)
    return "\n".join(out)


def doc_section(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the reference in the doc is stale")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page holding the markers (default: %(default)s)")
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    section = render()
    if args.check:
        if doc_section(text) != section:
            print(f"{args.doc}: the configuration reference is stale: run scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(text.replace(doc_section(text), section))
    print(f"{args.doc}: configuration reference written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
