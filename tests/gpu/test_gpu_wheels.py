"""The GPU check kit's wheels (benchmarks/gpu/wheel_plan.py, fetched by `make gpu-wheels`): the plan
covers pyproject.toml, keeps one version per distribution and DeepSpeed apart, and, where .whl/
was built, its manifest matches files that fit one device call and install on the GPU machine.
wheels.py itself, run on a made-up kit already at hand, keeps the planned wheels, removes an older
one, writes a manifest that --check accepts, and prints install lines that install each group.
All offline: nothing here downloads."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import shlex
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
    """An installable wheel of a module `name` that knows its VERSION."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n", f"{info}/METADATA": meta,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"]))


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
        said = done.stdout + done.stderr
        assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[gpu-wheels] check: OK", said
        plan_only = f"no {dest / 'manifest.json'}: checked the plan against pyproject.toml and the machine list only"
        assert (plan_only in done.stdout) == (dest == tmp_path), done.stdout  # a kit's manifest is compared


# --- wheels.py on a made-up kit whose wheels are at hand: nothing to download ------------------

@pytest.fixture
def kit_built(made_up_kit, monkeypatch, capsys):
    """wheels.py run on the made-up kit (with an older `dep` lying in it): (its folder, the module, what it printed)."""
    wheels = _load("wheels")
    monkeypatch.setattr(wheels, "plan", plan)  # the made-up plan, not its own import of wheel_plan

    def no_network(*args, **env):
        raise AssertionError(f"every planned wheel is at hand, yet wheels.py ran pip {args}")

    monkeypatch.setattr(wheels, "pip", no_network)
    _wheel(made_up_kit, "dep", "1.9", [])  # an older pin's wheel: two versions would stop the install
    assert wheels.main(["--dest", str(made_up_kit)]) == 0
    return made_up_kit, wheels, capsys.readouterr().out


def test_wheels_py_lands_the_planned_wheels_with_a_manifest_that_check_accepts(kit_built):
    kit, wheels, printed = kit_built
    data = json.loads((kit / "manifest.json").read_text())
    rows = {(w["file"], w["distribution"], w["version"], w["group"]) for w in data["wheels"]}
    assert rows == {("top-1.0-py3-none-any.whl", "top", "1.0", "zerotrain"),
                    ("dep-2.1-py3-none-any.whl", "dep", "2.1", "zerotrain"),
                    ("deepspeed/cmp-0.1-py3-none-any.whl", "cmp", "0.1", "comparison")}
    for w in data["wheels"]:
        assert (w["size"], w["sha256"]) == (len(b := (kit / w["file"]).read_bytes()), hashlib.sha256(b).hexdigest())
    assert data["total_bytes"] == sum(w["size"] for w in data["wheels"])
    assert not (kit / "dep-1.9-py3-none-any.whl").exists() and "removing" in printed
    assert "nothing downloaded" in printed
    assert wheels.main(["--check", "--dest", str(kit)]) == 0
    with zipfile.ZipFile(kit / "dep-2.1-py3-none-any.whl", "a") as zf:  # not the file the manifest recorded
        zf.writestr("dep/extra.py", "")
    assert wheels.main(["--check", "--dest", str(kit)]) == 1


@pytest.mark.slow
def test_the_install_lines_wheels_py_prints_install_each_group_offline(kit_built, tmp_path):
    kit, _, printed = kit_built
    prefix = "[gpu-wheels] install: "
    lines = [line[len(prefix):] for line in printed.splitlines() if line.startswith(prefix)]
    assert len(lines) == 2  # the zerotrain group, then the comparison group
    installed = {}
    for group, line in zip(("zerotrain", "comparison"), lines):
        site = tmp_path / group
        argv = [sys.executable if a == "python3" else a for a in shlex.split(line)]  # this Python plays the machine's
        argv = [str(site) if a.startswith("/tmp/zt-") else a for a in argv[:-1]] + sorted(glob.glob(argv[-1]))
        assert "--no-index" in argv  # the GPU machine has no network
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        # what is installed there: each distribution's metadata version, and its module's own
        done = subprocess.run([sys.executable, "-I", "-c", INSTALLED_PROBE, str(site)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        installed[group] = json.loads(done.stdout)
    assert installed == {"zerotrain": [["dep", "2.1", "2.1"], ["top", "1.0", "1.0"]],
                         "comparison": [["cmp", "0.1", "0.1"]]}


INSTALLED_PROBE = """import importlib, importlib.metadata, json, sys
sys.path.insert(0, sys.argv[1])
found = importlib.metadata.distributions(path=[sys.argv[1]])
print(json.dumps(sorted([d.name, d.version, importlib.import_module(d.name).VERSION] for d in found)))"""


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
