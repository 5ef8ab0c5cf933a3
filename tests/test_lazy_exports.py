"""config/lazy_exports.py: a package's public names are imported on first use and then behave as
an eager `from .module import name` in its __init__ would (zerotrain, zerotrain.config and
zerotrain.checkpoint use it so that `zerotrain --help` does not import torch)."""

from __future__ import annotations

import importlib
import sys

import pytest

PACKAGE_INIT = '''
from zerotrain.config.lazy_exports import export_lazily

export_lazily(__name__, {"build": "{pkg}.build", "Helper": "{pkg}.parts"}, submodules=["extra"])
'''


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package `lazypkg_<n>` whose `build` is a function in its submodule `build` (as
    zerotrain.checkpoint's `consolidate` is), `Helper` a class in `parts`, `extra` a submodule."""
    name = f"lazypkg_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text(PACKAGE_INIT.replace("{pkg}", name))
    (root / "build.py").write_text("def build():\n    return 'built'\n")
    (root / "parts.py").write_text("class Helper:\n    pass\n")
    (root / "extra.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def test_a_name_is_imported_only_when_asked_for(package):
    pkg = importlib.import_module(package)
    assert f"{package}.parts" not in sys.modules and f"{package}.build" not in sys.modules
    assert pkg.Helper.__name__ == "Helper"
    assert f"{package}.parts" in sys.modules and f"{package}.build" not in sys.modules
    assert "build" in dir(pkg) and "extra" in dir(pkg)


def test_a_function_named_like_its_submodule_stays_the_function_after_the_submodule_is_imported(package):
    importlib.import_module(f"{package}.build")  # the import system binds the module on the package
    pkg = sys.modules[package]
    assert callable(pkg.build) and pkg.build() == "built"
    namespace: dict = {}
    exec(f"from {package} import build", namespace)
    assert namespace["build"]() == "built"


def test_a_submodule_name_gives_the_module(package):
    pkg = importlib.import_module(package)
    assert pkg.extra.VALUE == 1 and pkg.extra is sys.modules[f"{package}.extra"]


def test_an_unknown_name_is_an_attribute_error_naming_the_package(package):
    pkg = importlib.import_module(package)
    with pytest.raises(AttributeError, match=rf"module '{package}' has no attribute 'missing'"):
        pkg.missing  # noqa: B018
    assert not hasattr(pkg, "missing")

