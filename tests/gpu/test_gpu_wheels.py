"""The GPU check kit's wheels (benchmarks/gpu/wheel_plan.py, fetched by `make gpu-wheels`): the plan
covers pyproject.toml, keeps one version per distribution and DeepSpeed apart, and, where .whl/
was built, its manifest matches files that fit one device call and install on the GPU machine.
All offline: nothing here downloads."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / "benchmarks" / "gpu"
KIT = ROOT / ".whl"
MANIFEST = KIT / "manifest.json"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plan = _load("wheel_plan")
needs_kit = pytest.mark.skipif(not MANIFEST.exists(), reason="no .whl/manifest.json: run `make gpu-wheels`")


# --- the plan, against pyproject.toml and the machine's package list ---------------------------

def test_every_pyproject_dependency_is_on_the_gpu_machine_or_pinned_in_the_kit():
    machine = plan.read_machine_packages()
    pins = {canonicalize_name(n): v for n, v in plan.PINS["zerotrain"].items()}
    for req in plan.project_requirements():
        name = canonicalize_name(req.name)
        assert name in machine or name in pins, (
            f"pyproject.toml needs {req}, which the GPU machine lacks (benchmarks/gpu/gpu_machine_packages.txt) "
            f"and the kit does not carry: add '{name}': '<version>' (and its missing dependencies) to "
            f"PINS['zerotrain'] in benchmarks/gpu/wheel_plan.py, then run `make gpu-wheels`")
        have = pins.get(name) or machine[name]
        assert have is None or req.specifier.contains(str(have), prereleases=True), (
            f"pyproject.toml needs {req}, but the kit/machine has {name}=={have}: pin a matching version "
            f"in PINS['zerotrain'] in benchmarks/gpu/wheel_plan.py")
    errors, _ = plan.walk(machine, None)
    assert errors == []


def test_a_new_dependency_missing_from_the_kit_is_reported_with_what_to_add(monkeypatch):
    real = plan.project_requirements()
    monkeypatch.setattr(plan, "project_requirements", lambda: [*real, Requirement("zz-new-dep>=1")])
    errors, _ = plan.walk(plan.read_machine_packages(), None)
    assert any("zz-new-dep" in e and "PINS['zerotrain']" in e for e in errors), errors


def test_machine_list_has_normalized_unique_names_and_parses():
    machine = plan.read_machine_packages()
    assert all(canonicalize_name(n) == n for n in machine)
    assert str(machine["torch"]).startswith("2.11.0") and machine["huggingface-hub"] is not None
    assert "pydantic" not in machine and "deepspeed" not in machine  # why the kit exists


def test_plan_pins_one_version_per_distribution_under_its_normalized_name(monkeypatch):
    rows = plan.pinned()
    names = [n for n, _, _ in rows]
    assert len(names) == len(set(names))
    assert all(canonicalize_name(n) == n for g in plan.PINS.values() for n in g)
    monkeypatch.setitem(plan.PINS, "comparison", {**plan.PINS["comparison"], "pydantic": "2.0.0"})
    with pytest.raises(ValueError, match="more than one group"):
        plan.pinned()


def test_deepspeed_is_carried_only_in_the_comparison_group():
    assert "deepspeed" in plan.PINS["comparison"]
    assert "deepspeed" not in plan.PINS["zerotrain"]
    assert plan.GROUP_DIRS == {"zerotrain": "", "comparison": "deepspeed"}
    assert all(canonicalize_name(r.name) != "deepspeed" for r in plan.project_requirements())


def test_target_tags_accept_only_what_installs_on_cp312_manylinux_x86_64():
    ok = ["a-1-py3-none-any.whl", "a-1-py312-none-any.whl", "a-1-cp312-abi3-manylinux_2_17_x86_64.whl",
          "a-1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"]
    bad = ["a-1-cp311-cp311-manylinux_2_17_x86_64.whl", "a-1-cp312-cp312-manylinux_2_17_aarch64.whl",
           "a-1-cp312-cp312-macosx_11_0_arm64.whl", "a-1-cp312-cp312-manylinux_2_34_x86_64.whl"]
    assert [plan.installable(f) for f in ok] == [True] * len(ok)
    assert [plan.installable(f) for f in bad] == [False] * len(bad)


# --- the Requires-Dist walk, on small made-up wheels ------------------------------------------

def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)


@pytest.fixture
def made_up_kit(tmp_path, monkeypatch):
    """A kit of `top` (needed by pyproject) -> `dep>=2`, and `cmp` in the comparison group."""
    _wheel(tmp_path, "top", "1.0", ["dep>=2", "winonly; sys_platform == 'win32'",
                                    "devonly; extra == 'dev'", "numpy>=1.17"])
    _wheel(tmp_path, "dep", "2.1", [])
    _wheel(tmp_path / "deepspeed", "cmp", "0.1", ["top", "torch>=2"])
    monkeypatch.setattr(plan, "project_requirements", lambda: [Requirement("top"), Requirement("torch>=2.5")])
    monkeypatch.setattr(plan, "COMPARISON_ROOTS", ["cmp"])
    monkeypatch.setattr(plan, "PINS", {"zerotrain": {"top": "1.0", "dep": "2.1"}, "comparison": {"cmp": "0.1"}})
    return tmp_path


def test_walk_follows_requires_dist_and_skips_extras_and_other_platforms(made_up_kit):
    errors, trusted = plan.walk(plan.read_machine_packages(), made_up_kit)
    assert errors == [] and trusted == []


def test_walk_reports_a_pin_that_breaks_a_requirement(made_up_kit, monkeypatch):
    _wheel(made_up_kit, "dep", "1.0", [])
    monkeypatch.setitem(plan.PINS, "zerotrain", {"top": "1.0", "dep": "1.0"})
    errors, _ = plan.walk(plan.read_machine_packages(), made_up_kit)
    assert any("top 1.0 needs dep>=2" in e and "change the pin" in e for e in errors), errors


def test_walk_reports_a_pin_nothing_needs_and_one_in_the_wrong_group(made_up_kit, monkeypatch):
    _wheel(made_up_kit, "stale", "1.0", [])
    _wheel(made_up_kit / "deepspeed", "dep", "2.1", [])
    monkeypatch.setattr(plan, "PINS", {"zerotrain": {"top": "1.0", "stale": "1.0"},
                                       "comparison": {"cmp": "0.1", "dep": "2.1"}})
    errors = "\n".join(plan.walk(plan.read_machine_packages(), made_up_kit)[0])
    assert "has stale, which nothing needs" in errors
    assert "pinned in the comparison group: move it to 'zerotrain'" in errors


def test_walk_follows_the_extras_a_requirement_asks_for(made_up_kit):
    _wheel(made_up_kit, "top", "1.0", ["dep[fast]>=2"])
    _wheel(made_up_kit, "dep", "2.1", ["speedy; extra == 'fast'"])
    errors, _ = plan.walk(plan.read_machine_packages(), made_up_kit)
    assert any("dep 2.1 needs speedy" in e and "lacks" in e for e in errors), errors


def test_walk_reports_a_machine_package_too_old_for_a_pinned_wheel(made_up_kit):
    _wheel(made_up_kit, "dep", "2.1", ["numpy>=9"])
    errors, _ = plan.walk(plan.read_machine_packages(), made_up_kit)
    assert any("numpy>=9" in e and "the GPU machine has numpy==" in e for e in errors), errors


# --- the CLI's offline --check --------------------------------------------------------------

def test_check_mode_reports_a_manifest_that_does_not_match_the_files(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    cmd = [sys.executable, str(GPU_DIR / "wheels.py"), "--check", "--dest", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "does not match the plan" in done.stderr, done.stdout + done.stderr


def test_check_mode_passes_without_a_kit_and_on_the_kit_built_here(tmp_path):
    for dest in [tmp_path] + ([KIT] if MANIFEST.exists() else []):
        cmd = [sys.executable, str(GPU_DIR / "wheels.py"), "--check", "--dest", str(dest)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


# --- the kit in .whl/, where `make gpu-wheels` built it -----------------------------------

@needs_kit
def test_kit_files_are_present_with_their_recorded_size_and_hash():
    for w in json.loads(MANIFEST.read_text())["wheels"]:
        path = KIT / w["file"]
        assert path.is_file(), f"{path} is listed in {MANIFEST} but missing: run `make gpu-wheels`"
        assert path.stat().st_size == w["size"] and hashlib.sha256(path.read_bytes()).hexdigest() == w["sha256"]


@needs_kit
def test_kit_fits_one_device_call():
    data = json.loads(MANIFEST.read_text())
    assert data["total_bytes"] == sum(w["size"] for w in data["wheels"]) <= 64 * 2**20


@needs_kit
def test_kit_holds_exactly_the_plan_one_version_each_in_its_group_folder():
    data = json.loads(MANIFEST.read_text())
    assert sorted((w["distribution"], w["version"], w["group"]) for w in data["wheels"]) == sorted(plan.pinned())
    for w in data["wheels"]:
        assert Path(w["file"]).parent == Path(plan.GROUP_DIRS[w["group"]])
    for folder in {KIT / d for d in plan.GROUP_DIRS.values()}:
        names = [parse_wheel_filename(p.name)[0] for p in folder.glob("*.whl")]
        assert len(names) == len(set(names)), f"two versions of one distribution in {folder}: {names}"


@needs_kit
def test_every_kit_wheel_installs_on_cp312_manylinux_x86_64():
    for w in json.loads(MANIFEST.read_text())["wheels"]:
        _, _, _, tags = parse_wheel_filename(Path(w["file"]).name)
        assert tags & plan.target_tags(), f"{w['file']} does not install on the GPU machine (cp312, x86_64)"


@needs_kit
def test_every_kit_wheels_requirements_are_met_by_the_kit_or_the_machine():
    errors, _ = plan.walk(plan.read_machine_packages(), KIT)
    assert errors == []
