"""The configuration reference is generated from the schema: the committed page must match it."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import iter_fields
from kvtier.config_doc import DOC_PATH, render

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_configuration_reference_is_what_the_schema_renders() -> None:
    committed = (ROOT / DOC_PATH).read_text(encoding="utf-8")
    assert committed == render(), (
        f"{DOC_PATH} is out of date with src/kvtier/config.py: run "
        "`PYTHONPATH=src python -m kvtier.config_doc --write` and commit the result")


def test_every_setting_has_help_and_appears_in_the_reference() -> None:
    page = render()
    for path, f in iter_fields():
        assert f.metadata["help"].strip(), f"{path} has no help text"
        assert f"`{path}`" in page
        if f.metadata.get("alias"):
            assert f"`{f.metadata['alias']}`" in page
