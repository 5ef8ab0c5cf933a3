"""The GPU check kit's wheel plan (issue 22): what the lent GPU machine (Python 3.12.3, Linux
x86_64, no network) lacks of zerotrain's runtime needs, pinned one version each, and the offline
checks of that plan against pyproject.toml, the machine's package list and the wheels' metadata.
benchmarks/gpu/wheels.py fetches what it names; tests/gpu/test_gpu_wheels.py checks it."""

from __future__ import annotations

import re
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.tags import Tag, compatible_tags, cpython_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # any pip carries a copy, so a bare Python with pip runs the kit
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import Tag, compatible_tags, cpython_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

HERE = Path(__file__).resolve().parent
PYPROJECT = HERE.parents[1] / "pyproject.toml"
MACHINE_LIST = HERE / "gpu_machine_packages.txt"
MAX_BYTES = 64 * 2**20  # what the device tool carries per call, wheels and working tree together

# The GPU machine's interpreter. pip matches a manylinux_2_N tag only for an N named here, so a new
# pin whose wheel carries another N needs it added here (the install lines are made from TARGET).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
for _p in PLATFORMS:
    TARGET += ["--platform", _p]
MARKERS = {  # environment markers as Python 3.12.3 on Linux x86_64 evaluates them
    "python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_python_implementation": "CPython", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_release": "", "platform_version": "",
}

# Group -> folder under DEST, and what the group is for (its roots).
GROUP_DIRS = {"zerotrain": "", "comparison": "deepspeed"}
COMPARISON_ROOTS = ["deepspeed"]
# The one version of each distribution the kit carries. Every pin must be needed (the walk
# over Requires-Dist checks that) and compatible with the machine's packages.
PINS: dict[str, dict[str, str]] = {
    "zerotrain": {
        "pydantic": "2.14.4",
        "pydantic-core": "2.50.5",  # exactly what pydantic 2.14.4 requires
        "annotated-types": "0.8.0",
        "typing-inspection": "0.4.5",
        # The machine has typing-extensions at an unrecorded version (torch's own index ships
        # older ones) and pydantic-core 2.50.5 needs >=4.16.0: carry it rather than guess.
        "typing-extensions": "4.16.0",
        "hjson": "3.1.0",
        # 5.2.0 wants huggingface-hub>=1.31 (machine: 1.33.0) and pyarrow>=24 (unrecorded).
        "datasets": "5.2.0",
        "dill": "0.4.1",  # datasets: dill<0.4.2
        "multiprocess": "0.70.19",  # datasets: multiprocess<0.70.20; needs dill>=0.4.1
    },
    "comparison": {"deepspeed": "0.19.8"},
}
# DeepSpeed ships only an sdist. Built here as a pure-Python wheel with no ops compiled (they
# JIT-build on the GPU machine, which has nvcc and ninja); DS_ACCELERATOR=cuda makes the metadata
# what a pip install on the GPU machine writes (nvidia-ml-py, accelerator_name='cuda').
SDIST_BUILDS = {"deepspeed": {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}}


def read_machine_packages(path: Path = MACHINE_LIST) -> dict[str, Version | None]:
    """The GPU machine's distributions: canonical name -> version (None where none was recorded)."""
    found: dict[str, Version | None] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if canonicalize_name(name) != name.strip() or name in found:
            raise ValueError(f"{path}:{n}: {line!r} is not a normalized, unique name (see its header)")
        found[name.strip()] = Version(version) if version else None
    return found


def project_requirements(path: Path = PYPROJECT) -> list[Requirement]:
    """zerotrain's runtime requirements: `[project].dependencies` of pyproject.toml."""
    with open(path, "rb") as f:
        return [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]


def pinned() -> list[tuple[str, str, str]]:
    """The plan as (distribution, version, group), one row per distribution."""
    rows = [(canonicalize_name(n), v, g) for g, pins in PINS.items() for n, v in pins.items()]
    names = [r[0] for r in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"PINS names {twice} in more than one group: keep one version of each")
    return rows


def wheel_path(dest: Path, name: str, version: str, group: str) -> Path | None:
    """The wheel of `name==version` in its group's folder, if it is there."""
    folder = dest / GROUP_DIRS[group]
    for path in sorted(folder.glob("*.whl")):
        wname, wversion, _, _ = parse_wheel_filename(path.name)
        if wname == name and wversion == Version(version):
            return path
    return None


def wheel_requirements(path: Path) -> list[Requirement]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = Parser().parsestr(zf.read(meta).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def applies(req: Requirement, extras: frozenset[str]) -> bool:
    """Whether `req` is needed on the GPU machine when its parent is installed with `extras`."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**MARKERS, "extra": e}) for e in extras | {""})


def walk(machine: dict[str, Version | None], dest: Path | None) -> tuple[list[str], list[str]]:
    """Checks the plan against pyproject, the machine and (where DEST holds the wheels) every
    wheel's Requires-Dist, transitively. Returns (errors, requirements taken on trust)."""
    rows = pinned()
    pins = {n: (Version(v), g) for n, v, g in rows}
    errors: list[str] = []
    trusted: set[str] = set()
    reached: dict[str, set[str]] = {"zerotrain": set(), "comparison": set()}
    missing_meta = 0
    roots = {"zerotrain": project_requirements(), "comparison": [Requirement(r) for r in COMPARISON_ROOTS]}
    for group, group_roots in roots.items():
        seen: set[tuple[str, frozenset[str]]] = set()
        queue = [("pyproject.toml" if group == "zerotrain" else "the comparison group", r) for r in group_roots]
        while queue:
            parent, req = queue.pop()
            name = canonicalize_name(req.name)
            if name in pins and (group == "comparison" or pins[name][1] == "zerotrain"):
                version = pins[name][0]
                if not req.specifier.contains(version, prereleases=True):
                    errors.append(f"{parent} needs {req}, but PINS has {name}=={version}: change the pin")
                if (name, frozenset(req.extras)) in seen:
                    continue
                seen.add((name, frozenset(req.extras)))  # an extra can add requirements: walk again
                reached[group].add(name)
                wheel = dest and wheel_path(dest, name, str(version), pins[name][1])
                if not wheel:
                    missing_meta += 1
                    continue
                queue += [(f"{name} {version}", r) for r in wheel_requirements(wheel)
                          if applies(r, frozenset(req.extras))]
            elif name in machine:
                have = machine[name]
                if have is None:
                    if str(req.specifier):
                        trusted.add(f"{parent} needs {req}: the machine's version is not recorded")
                elif not req.specifier.contains(have, prereleases=True):
                    errors.append(f"{parent} needs {req}, the GPU machine has {name}=={have}: "
                                  f"add a newer {name} to PINS[{group!r}] in benchmarks/gpu/wheel_plan.py")
            elif name in pins:  # a comparison-group pin that zerotrain needs
                errors.append(f"{parent} needs {name}, pinned in the comparison group: move it to 'zerotrain'")
            else:
                errors.append(f"{parent} needs {req}, which the GPU machine lacks: add "
                              f"'{name}': '<version>' to PINS[{group!r}] in benchmarks/gpu/wheel_plan.py")
    if not missing_meta:  # with every wheel's metadata read, each pin must be needed by its group
        for name, _, group in rows:
            if name not in reached[group]:
                errors.append(f"PINS[{group!r}] has {name}, which nothing needs: remove it")
    return errors, sorted(trusted)


def target_tags() -> set[Tag]:
    """Every wheel tag that pip accepts for the GPU machine with the TARGET flags."""
    tags = set(cpython_tags((3, 12), abis=["cp312", "abi3", "none"], platforms=list(PLATFORMS)))
    return tags | set(compatible_tags((3, 12), "cp312", platforms=list(PLATFORMS)))


def installable(filename: str) -> bool:
    """Whether a wheel of this filename installs on the GPU machine (cp312, manylinux x86_64)."""
    return bool(parse_wheel_filename(filename)[3] & target_tags())


def install_line(site: str, wheels: str) -> str:
    """The shell command that installs `wheels` (a glob) into `site` on the GPU machine, offline.
    The TARGET flags make the same line work on another Python here (CI runs it on 3.11)."""
    return ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
            f"--only-binary=:all: {' '.join(TARGET)} --target {site} {wheels}")
