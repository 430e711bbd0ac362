"""docs/families.md's family table is what scripts/family_table.py makes from the installed vLLM's registry."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_family_table_is_current(tiny_checkpoint):
    sys.path.insert(0, str(ROOT / "scripts"))
    import family_table

    table = family_table.render()
    assert family_table.doc_table((ROOT / "docs" / "families.md").read_text()) == table, \
        "docs/families.md's family table is stale: run .venv/bin/python scripts/family_table.py"
    # Every served built-in family has its row, and the registry is really read (not an empty table).
    from pipeline.models.builtin import SERVED_FAMILIES

    for family in SERVED_FAMILIES:
        assert f"[{family}]" in table, family
    assert table.count("\n| `") > 100
