"""docs/families.md's family table and the README's family list are what scripts/family_table.py
makes from the installed vLLM's registry and the built-in checkpoints."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_family_table_is_current(tiny_checkpoint):
    sys.path.insert(0, str(ROOT / "scripts"))
    import family_table

    rows = family_table.rows()
    table = family_table.render(rows)
    assert family_table.doc_table((ROOT / "docs" / "families.md").read_text()) == table, (
        "docs/families.md's family table is stale: run .venv/bin/python scripts/family_table.py"
    )
    readme = family_table.readme_list(rows)
    assert (
        family_table.doc_table((ROOT / "README.md").read_text(), family_table.README_BEGIN, family_table.README_END)
        == readme
    ), "README.md's family list is stale: run .venv/bin/python scripts/family_table.py"
    # Every built-in family is served, has its row and is in the README; the registry is really
    # read (not an empty table).
    from pipeline.model.builtin import BUILDERS

    for family, builtin in BUILDERS.items():
        assert f"[{family}]" in table and builtin.name in readme, family
    assert sum(status.startswith("**served**") for *_, status in rows) == len(BUILDERS)
    assert table.count("\n| `") > 100
