"""The docs hold together: the configuration reference in docs/configuration.md is what
scripts/gen_config_docs.py renders from the pydantic models, every relative link in README.md
and docs/*.md reaches an existing file (and heading), and the README keeps the test command
that .ci/run runs. Fast: no Ray, no vLLM engine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from pydantic import Field, create_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_config_docs  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ---------------------------------------------------------------------------
# The configuration reference
# ---------------------------------------------------------------------------


def current_section() -> str:
    return gen_config_docs.doc_section(gen_config_docs.DOC.read_text())


def test_config_reference_is_current():
    assert current_section() == gen_config_docs.render(), (
        "docs/configuration.md's reference is stale: run .venv/bin/python scripts/gen_config_docs.py"
    )


def test_every_field_of_every_model_has_a_row():
    from cache_service.config import CacheConfig
    from deployments.config import IrisConfig
    from pipeline.media.limits import MediaLimits

    section = current_section()
    for prefix, model in (("", IrisConfig), ("cache.", CacheConfig), ("media.", MediaLimits)):
        for name in model.model_fields:
            assert f"| `{prefix}{name}` |" in section, f"{prefix}{name} missing from docs/configuration.md"


def test_a_field_added_to_a_model_makes_the_reference_stale():
    """What happens when an engineer adds a field and forgets the docs: the render differs."""
    from cache_service.config import CacheConfig
    from deployments.config import IrisConfig
    from pipeline.media.limits import MediaLimits

    top = create_model(
        "IrisConfig",
        __base__=IrisConfig,
        new_knob=(int, Field(7, ge=1, description="A knob added after the docs were made.")),
    )
    rendered = gen_config_docs.render(top)
    assert rendered != current_section()
    assert "| `new_knob` | `int (≥ 1)` | `7` | A knob added after the docs were made. |" in rendered

    # The same for a field of a nested model, `cache` and `media` alike.
    cache = create_model("CacheConfig", __base__=CacheConfig, new_cache_knob=(float, 0.5))
    media = create_model("MediaLimits", __base__=MediaLimits, new_media_knob=(bool, True))
    nested = create_model(
        "IrisConfig",
        __base__=IrisConfig,
        cache=(cache, Field(default_factory=cache)),
        media=(media, Field(default_factory=media)),
    )
    rendered = gen_config_docs.render(nested)
    assert rendered != current_section()
    assert "| `cache.new_cache_knob` | `float` | `0.5` | — |" in rendered
    assert "| `media.new_media_knob` | `bool` | `true` | — |" in rendered
    # Inherited fields keep the descriptions their own class's source gives them.
    assert "Decompression-bomb guard" in rendered


def test_a_changed_default_makes_the_reference_stale():
    from deployments.config import IrisConfig

    changed = create_model("IrisConfig", __base__=IrisConfig, request_timeout_s=(float, Field(301, gt=0)))
    assert gen_config_docs.render(changed) != current_section()


def test_check_mode(tmp_path, capsys):
    doc = tmp_path / "configuration.md"
    doc.write_text(gen_config_docs.DOC.read_text())
    assert gen_config_docs.main(["--check", "--doc", str(doc)]) == 0
    doc.write_text(doc.read_text().replace("| `model` |", "| `renamed_model` |"))
    assert gen_config_docs.main(["--check", "--doc", str(doc)]) == 1
    assert "stale" in capsys.readouterr().err
    assert gen_config_docs.main(["--doc", str(doc)]) == 0  # rewrite, then it is current again
    assert gen_config_docs.main(["--check", "--doc", str(doc)]) == 0
    assert doc.read_text() == gen_config_docs.DOC.read_text()


def test_every_field_is_described_in_its_model():
    """The reference's descriptions come from `Field(description=...)` alone: a field added without
    one fails here, not as a row of "—"."""
    from cache_service.config import CacheConfig
    from deployments.config import IrisConfig
    from pipeline.media.limits import MediaLimits

    undescribed = [
        f"{model.__name__}.{name}"
        for model in (IrisConfig, CacheConfig, MediaLimits)
        for name in model.model_fields
        if not gen_config_docs.description(model, name)
    ]
    assert not undescribed, undescribed


# ---------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:id|name)=\"([^\"]+)\"", re.I)


def without_code(text: str) -> str:
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markdown links reduced to their text, lower case,
    everything but letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    found, seen = set(), {}
    for _, heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found | set(HTML_ANCHOR.findall(text))


def links(path: Path) -> list[str]:
    return LINK.findall(without_code(path.read_text()))


def test_slug_matches_github():
    assert (
        slug("Why vLLM's model class in the replica, not an encoder-only vLLM engine")
        == "why-vllms-model-class-in-the-replica-not-an-encoder-only-vllm-engine"
    )
    assert slug("Results (CPU figures)") == "results-cpu-figures"
    assert slug("autoscale.json") == "autoscalejson"
    assert slug("`cache.redis_url` and [Redis](x.md)") == "cacheredis_url-and-redis"


def test_link_checker_sees_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Some part\n\n```bash\n# not a heading\n[x](missing.md)\n```\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#some-part) [bad anchor](a.md#not-a-heading) [bad file](nowhere.md) "
        "`[code](gone.md)` [web](https://example.com) [self](#own)\n\n## Own\n"
    )
    assert broken_links(page) == ["a.md#not-a-heading", "nowhere.md"]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert links(page), f"{page.name}: no links found (is the link pattern broken?)"
    assert broken_links(page) == [], f"{page.relative_to(ROOT)}: broken relative links"


# ---------------------------------------------------------------------------
# The README's contract with CI
# ---------------------------------------------------------------------------


def test_readme_keeps_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    command = ci[-1].strip()
    assert command == "bash scripts/install.sh && .venv/bin/python -m pytest"
    assert command in (ROOT / "README.md").read_text()


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move detail to docs/"
