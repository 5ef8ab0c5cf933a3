"""docs/planning.md is the planning tools' own output: regenerate it when they change."""

from __future__ import annotations

import pytest

import importlib.util
from pathlib import Path

GENERATOR = Path(__file__).resolve().parents[2] / "docs" / "generate_planning.py"


@pytest.mark.slow
def test_planning_page_matches_what_the_tools_print_now():
    spec = importlib.util.spec_from_file_location("generate_planning", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.render()
    assert module.PAGE.read_text() == expected, (
        "docs/planning.md differs from the tools' output: run `python docs/generate_planning.py` and commit it"
    )
