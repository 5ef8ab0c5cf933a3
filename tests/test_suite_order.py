"""The suite's own scheduling: conftest starts the longest modules first (so the pytest-xdist
workers end together). The modules it names must exist, or a renamed one would silently run
last again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import LONGEST_MODULES, _module_order

TESTS = Path(__file__).parent


def test_every_module_started_first_exists():
    missing = [m for m in LONGEST_MODULES if not (TESTS / m).is_file()]
    assert not missing, f"conftest.LONGEST_MODULES names modules that are gone: {missing}"


def test_listed_modules_sort_first_in_their_listed_order_and_the_rest_keep_theirs():
    paths = ["bench/test_split.py", LONGEST_MODULES[1], "test_cli.py", LONGEST_MODULES[0], "bench/test_split.py"]
    items = [SimpleNamespace(fspath=TESTS / p, name=str(i)) for i, p in enumerate(paths)]
    items.sort(key=_module_order)
    assert [i.name for i in items] == ["3", "1", "0", "2", "4"]
