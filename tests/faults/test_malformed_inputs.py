"""Malformed hostfiles, `.deepspeed_env` files, and checkpoint `latest`, meta.json, shard and torch files, as an
attacker or a broken disk leaves them. For each: a clear error that names the file (exit 2 from `zerotrain`, a
CheckpointError from the API), never a traceback, nothing written outside the case's folder, no command run from
the data (every payload would create MARKER), and no memory taken for a size the data only claims.
docs/checkpoints.md, "Malformed inputs", tabulates these cases."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zerotrain
from conftest import user_env, zerotrain_script
from llama_workload import global_batch, make_model, param_groups, zero_config
from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.layout import FORMAT
from zerotrain.cli.main import main

MARKER = "MARKER"
SHARD = "shards_rank00000.safetensors"
FROZEN = "model.layers.0.self_attn.q_proj.weight"  # make_model(freeze_one=True): stored whole under module/


class WritesMarker:
    """Unpickling one runs open(path, "w"): what a crafted checkpoint does to a loader that trusts pickle."""
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


# --- the folders, the command line, and what must not happen -----------------------------------

@pytest.fixture
def case(tmp_path, monkeypatch):
    """tmp_path as the case's whole world: cwd/ and home/ inside it, the environment restored after."""
    saved_environ = dict(os.environ)  # `zerotrain launch` adds the deepspeed stand-in to os.environ
    for name in ("cwd", "home"):
        (tmp_path / name).mkdir()
    (tmp_path / "cwd" / "train.py").write_text("print('trained')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "4000")  # rich folds long lines at 80 columns off a terminal
    for name in ("DS_ENV_FILE", "ZEROTRAIN_JOB_ID", "ZEROTRAIN_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    beside = set(os.listdir(tmp_path.parent))
    yield tmp_path
    assert not (tmp_path / MARKER).exists(), "a command or pickle from the input ran"
    assert set(os.listdir(tmp_path.parent)) == beside, "something was written beside the case's folder"
    os.environ.clear()
    os.environ.update(saved_environ)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


def rows(table: list[tuple]) -> dict:
    """parametrize's argvalues and ids from a table whose rows start with the case's name."""
    return {"argvalues": [row[1:] for row in table], "ids": [row[0] for row in table]}


def write_input(path: Path, content: str | bytes, case: Path) -> None:
    """`content` into `path`, with {marker} standing for the case's MARKER path."""
    text = content.replace("{marker}", str(case / MARKER)) if isinstance(content, str) else content
    path.write_bytes(text.encode() if isinstance(text, str) else text)


# Cases also run through the installed `zerotrain` script, in a process of their own, as users run it.
AS_TYPED = {"ssh-option-as-host", "command-substitution-value", "latest-traversal-to-bait"}


@pytest.fixture
def cli(capsys, request):
    """cli(*ARGV): `zerotrain ARGV` in this process (the AS_TYPED cases: the installed script) -> status, out, err."""
    def run(*argv) -> tuple[int, str, str]:
        if getattr(request.node, "callspec", None) and request.node.callspec.id in AS_TYPED:
            proc = subprocess.run([zerotrain_script(), *map(str, argv)], capture_output=True, text=True,
                                  env=user_env(), timeout=120)  # cwd, HOME and COLUMNS: the case's
            return proc.returncode, proc.stdout, proc.stderr
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


def assert_refused(code: int, err: str, *names: str) -> None:
    """Exit 2 (the user's input, not a bug), one short message naming `names`, no traceback."""
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and "ZEROTRAIN_DEBUG" not in err, err[-2000:]
    assert len(err) < 4000, f"a {len(err)}-character message: {err[:300]}"
    for name in names:
        assert name in err, f"{name!r} not named in: {err[-2000:]}"


# --- hostfiles and --include/--exclude ----------------------------------------------------------

MB = 2**20
NODES = "node1 slots=1\nnode2 slots=1\n"
HOSTFILES = [  # (case, hostfile, what the message says[, flag, its value]); {marker}: the case's MARKER path
    ("empty", b"", "lists no hosts"),
    ("only-comments", b"# node1 slots=1\n\n", "lists no hosts"),
    ("binary-garbage", bytes(range(256)) * 8, "not UTF-8"),
    ("control-characters", b"\x01\x02\x7f slots=1\n", "which no host name can"),
    ("nul-in-host-name", b"node\x001 slots=1\n", "which no host name can"),
    ("negative-slots", b"node1 slots=-1\n", "not a whole number"),
    ("text-slots", b"node1 slots=abc\n", "not a whole number"),
    ("huge-slots", b"node1 slots=1000000000000\n", "more than the 1024"),
    ("5000-digit-slots", b"node1 slots=" + b"9" * 5000 + b"\n", "more than the 1024"),
    ("duplicate-host", b"node1 slots=1\nnode2 slots=1\nnode1 slots=2\n", "already listed on line 1"),
    ("semicolon-command", "node1;touch${IFS}{marker} slots=1\n", "';'"),
    ("command-substitution", "$(touch${IFS}{marker}) slots=1\n", "'$'"),
    ("backticks", "`touch${IFS}{marker}` slots=1\n", "'`'"),
    ("ssh-option-as-host", "-oProxyCommand=touch${IFS}{marker} slots=1\nnode2 slots=1\n", "starts with '-'"),
    ("carriage-return-injection", "node1 slots=1\r-oProxyCommand=touch${IFS}{marker} slots=1\n", "starts with '-'"),
    ("rich-markup-in-host", "node[/x] slots=1\nnode2 slots=1\n", "which no host name can"),
    ("user-at-host", "root@node1 slots=1\n", "'@'"),
    ("non-ascii-host", "nöde1 slots=1\n", "'ö'"),
    ("non-utf8-bytes", b"node1 slots=1\nn\xffde2 slots=1\n", "not UTF-8"),
    ("10MB-line", "n" * (10 * MB) + " slots=1\n", "characters long"),
    ("20MB-file", "node1 slots=1\n" + "#" * (20 * MB), "larger than 16 MiB"),
    ("include-5000-digit-slot", NODES, "past the 1024 slots", "--include", "node1:" + "9" * 5000),
    ("include-metacharacter-host", NODES, "not in", "--include", "node1;touch${IFS}{marker}"),
    ("exclude-every-slot", NODES, "removes every slot", "--exclude", "node1@node2"),
]


@pytest.mark.parametrize("content, says, flag, spec", **rows([(*row, None, None)[:5] for row in HOSTFILES]))
def test_malformed_hostfile_or_host_filter_is_refused_naming_it(case, cli, content, says, flag, spec):
    write_input(hostfile := case / "hostfile", content, case)
    flags = [flag, spec.replace("{marker}", str(case / MARKER))] if flag else []
    code, _, err = cli("launch", "--hostfile", hostfile, *flags, "--dry_run", "train.py")
    assert_refused(code, err, flag or str(hostfile), says)


# --- .deepspeed_env and what reaches the ssh command line ---------------------------------------

def dry_run_commands(cli, case: Path) -> tuple[list[dict], str]:
    """A 2-node `zerotrain launch --dry_run` (with a job id from the launching shell that tries to break out of
    its quotes): checks that ssh runs the node agent and nothing else; returns each node's job (its stdin), stderr."""
    job_id = f"x'; touch {case / MARKER}; '"
    os.environ["ZEROTRAIN_JOB_ID"] = job_id  # the case fixture restores the environment
    (case / "hostfile").write_text(NODES)
    code, out, err = cli("launch", "--hostfile", case / "hostfile", "--master_addr", "127.0.0.1", "--dry_run",
                         "train.py")
    assert code == 0, err[-2000:]
    argvs = [shlex.split(line) for line in out.splitlines() if line.startswith("ssh ")]
    for rank, (argv, host) in enumerate(zip(argvs, ("node1", "node2"), strict=True)):
        assert argv[-2] == host
        assert shlex.split(argv[-1]) == ["exec", "env", f"ZEROTRAIN_JOB_ID={job_id}", f"ZEROTRAIN_NODE_RANK={rank}",
                                         shlex.split(argv[-1])[4], "-u", "-m", "zerotrain.launcher.node_agent"], argv
    return [json.loads(line.split(": ", 1)[1]) for line in out.splitlines() if line.startswith("# stdin: ")], err


ENV_FILES = [  # (case, file content, variables every node gets, names left out, line the warning names)
    ("command-substitution-value", "NCCL_A=$(touch {marker})\n", {"NCCL_A": "$(touch {marker})"}, (), None),
    ("backtick-value", "NCCL_A=`touch {marker}`\n", {"NCCL_A": "`touch {marker}`"}, (), None),
    ("semicolon-value", "NCCL_A=1; touch {marker}\n", {"NCCL_A": "1; touch {marker}"}, (), None),
    ("quote-breaking-value", "NCCL_A='; touch {marker}; '\n", {"NCCL_A": "; touch {marker}; "}, (), None),
    ("escaped-newline-value", 'NCCL_A="1\\ntouch {marker}"\n', {"NCCL_A": "1\ntouch {marker}"}, (), None),
    ("value-spanning-lines", 'NCCL_A="1\ntouch {marker}"\n', {"NCCL_A": '"1'}, (), ":2:"),
    ("key-with-spaces", "NCCL A=1\n", {}, ("NCCL A", "NCCL"), ":1:"),
    ("key-not-an-identifier", "1NCCL=1\nNCCL-A=2\n", {}, ("1NCCL", "NCCL-A"), ":1-2:"),
    ("key-command-substitution", "$(touch {marker})=1\n", {}, (), ":1:"),
    ("export-injection", "export $(touch {marker})=1\n", {}, (), ":1:"),
    ("nul-byte", "NCCL_A=1\x00touch {marker}\n", {}, ("NCCL_A",), ":1:"),
    ("non-utf8-bytes", b"NCCL_A=\xff\xfe\n", {}, ("NCCL_A",), ":1:"),
    ("process-specific-names", "MASTER_ADDR=evil.example\nCUDA_VISIBLE_DEVICES=7\n", {},
     ("MASTER_ADDR", "CUDA_VISIBLE_DEVICES"), "ignored 2 variables"),
    ("200KB-value", "NCCL_A=" + "a" * 200_000 + "\nNCCL_B=2\n", {"NCCL_B": "2"}, ("NCCL_A",), ":1:"),
]


@pytest.mark.parametrize("content, kept, dropped, warns", **rows(ENV_FILES))
def test_env_file_values_reach_nodes_as_data_never_as_commands(case, cli, content, kept, dropped, warns):
    write_input(env_file := case / "cwd" / ".deepspeed_env", content, case)
    jobs, err = dry_run_commands(cli, case)
    for job in jobs:
        for name, value in kept.items():
            assert job["env"][name] == value.replace("{marker}", str(case / MARKER))
        assert not set(dropped) & set(job["env"])
    if warns:
        assert f"{env_file}{warns}" in err or (str(env_file) in err and warns in err), err


ENV_ERRORS = [("17MB-env-file", None, "larger than 16 MiB"),
              ("DS_ENV_FILE-command-substitution", "$(touch {marker})", "does not exist"),
              ("DS_ENV_FILE-a-folder", "{case}", "is not a file")]


@pytest.mark.parametrize("ds_env_file, says", **rows(ENV_ERRORS))
def test_unusable_env_file_is_refused_naming_it(case, cli, monkeypatch, ds_env_file, says):
    named = case / "cwd" / ".deepspeed_env"
    if ds_env_file is None:
        named.write_text("NCCL_A=1\n" + "#" * (17 * MB))
    else:
        named = ds_env_file.replace("{marker}", str(case / MARKER)).replace("{case}", str(case))
        monkeypatch.setenv("DS_ENV_FILE", named)
    (case / "hostfile").write_text(NODES)
    code, _, err = cli("launch", "--hostfile", case / "hostfile", "--master_addr", "127.0.0.1", "--dry_run", "train.py")
    assert_refused(code, err, str(named), says)


# --- checkpoints: one real save, copied and broken per case --------------------------------------

def new_engine():
    """A 1-process engine (ZeRO-2, Gloo) on the tiny Llama, one weight frozen so meta.json has a module entry."""
    model = make_model(freeze_one=True)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(2, 1, 1))
    return engine


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint folder saved by a 1-process engine (Gloo) after one step: global_step1 and `latest`."""
    root = tmp_path_factory.mktemp("saved")
    engine = new_engine()
    ids = global_batch(0)[: engine.train_micro_batch_size_per_gpu()]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(root)
    return root


@pytest.fixture
def ckpt(saved, case, monkeypatch):
    """The case's copy of the checkpoint in run/, another in bait/ (outside run/), and an allocation guard."""
    shutil.copytree(saved, case / "run")
    shutil.copytree(saved, case / "bait")
    empty = torch.empty

    def bounded_empty(*size, **kwargs):  # the reader must check sizes against the files before allocating
        numel = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size).numel()
        assert numel < 10**8, f"torch.empty of {numel} elements, a size only claimed by the input"
        return empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", bounded_empty)
    return case


TAG = Path("run") / "global_step1"
META_JSON, SHARD_AT, STATE_PT, RNG_PT = (TAG / name for name in ("meta.json", SHARD, "state.pt", "rng_rank00000.pt"))


def put(relative: Path | str, data) -> "callable":
    """A breakage: the file at `relative` (in the case's folder) gets `data` (bytes, text, or f(case))."""
    def breakage(c: Path) -> None:
        path, value = c / relative, data(c) if callable(data) else data
        if path.is_dir():
            shutil.rmtree(path)
        path.write_bytes(value.encode() if isinstance(value, str) else value)
    return breakage


def meta(change) -> "callable":
    """A breakage: change(meta_dict) edits meta.json."""
    def breakage(c: Path) -> None:
        loaded = json.loads((c / META_JSON).read_text())
        change(loaded)
        (c / META_JSON).write_text(json.dumps(loaded))
    return breakage


def first_slice(m: dict, **param_fields) -> list:
    """The first slice meta.json lists, [NAME, START, NUMEL], after updating its parameter with `param_fields`."""
    m["params"][m["files"][SHARD][0][0]].update(param_fields)
    return m["files"][SHARD][0]


def shard(change, key=None) -> "callable":
    """A breakage: the shard's tensor `key` (default: a master slice) becomes change(tensor); None drops it."""
    def breakage(c: Path) -> None:
        tensors = load_file(c / SHARD_AT)
        name = key or next(k for k in sorted(tensors) if k.startswith("master/") and tensors[k].numel() > 1)
        replaced = change(tensors.pop(name))
        if replaced is not None:
            tensors[name] = replaced.contiguous().clone()
        save_file(tensors, str(c / SHARD_AT), metadata={"format": FORMAT})
    return breakage


def files_as(name_of) -> "callable":
    """A breakage of meta.json: its one shard file listed under name_of(case) instead."""
    return lambda c: meta(lambda m: m.update(files={name_of(c): m["files"][SHARD]}))(c)


def named_file(case_name: str) -> str:
    """The file a case's message must name: its kind, the first word of its name."""
    kind = case_name.split("-")[0]
    return {"meta": "meta.json", "latest": "latest", "shard": SHARD, "state": "state.pt", "rng": "rng_rank00000.pt",
            "tag": "checkpoint tag"}[kind]


HEADER = json.dumps({"master/x/0": {"dtype": "F32", "shape": [10**15], "data_offsets": [0, 4 * 10**15]}}).encode()
MODULE_KEY = f"module/{FROZEN}/0"
META_TEXTS = {"not-json": "not json at", "empty": "", "json-array": "[1, 2, 3]", "binary": bytes(range(128, 256)),
              "nested-100k-deep": "[" * 100_000 + "]" * 100_000}
SHAPES = {"a-string": "2048", "nan": [float("nan")], "bool": [True], "negative": [-1, -2048], "10**15": [10**15],
          "2**70-elements": [2**35, 2**35]}  # the first parameter's shape in meta.json
LATEST = {"dotdot": "../../etc", "traversal-to-bait": "../bait/global_step1", "empty": "", "dot": ".", "1MB": "g" * MB,
          "multi-line": "global_step1\nglobal_step2\n", "nul": "global_step1\0", "non-utf8": b"global_step\xff"}
SHARD_BYTES = {"zero-bytes": b"", "random-bytes": bytes((i * 7919) % 251 for i in range(8192)),
               "header-length-2**62": struct.pack("<Q", 2**62) + b"{}",
               "header-claims-10**15-elements": struct.pack("<Q", len(HEADER)) + HEADER + bytes(64)}
SLICES = {"slice-wrong-dtype": (lambda t: t.half(), None), "slice-integers": (lambda t: t.long(), None),
          "slice-wrong-shape": (lambda t: t[:-1], None), "slice-missing": (lambda t: None, None),
          "module-wrong-dtype": (lambda t: t.long(), MODULE_KEY),
          "module-wrong-shape": (lambda t: t.reshape(-1), MODULE_KEY)}
BROKEN_CHECKPOINTS = [  # (case, how the copy in run/ is broken); the case's first word is the file to be named
    *((f"meta-{name}", put(META_JSON, text)) for name, text in META_TEXTS.items()),
    *((f"meta-shape-{name}", meta(lambda m, v=shape: first_slice(m, shape=v))) for name, shape in SHAPES.items()),
    *((f"latest-{name}", put("run/latest", text)) for name, text in LATEST.items()),
    *((f"shard-{name}", put(SHARD_AT, data)) for name, data in SHARD_BYTES.items()),
    *((f"shard-{name}", shard(*change)) for name, change in SLICES.items()),
    ("meta-truncated", put(META_JSON, lambda c: (c / META_JSON).read_text()[:700])),
    ("meta-is-a-folder", lambda c: ((c / META_JSON).unlink(), (c / META_JSON).mkdir())),
    ("meta-missing-files", meta(lambda m: m.pop("files"))),
    ("meta-missing-params", meta(lambda m: m.pop("params"))),
    ("meta-params-a-list", meta(lambda m: m.update(params=[]))),
    ("meta-huge-claimed-slice", meta(lambda m: first_slice(m, shape=[10**15]).__setitem__(2, 10**15))),
    ("meta-negative-start", meta(lambda m: first_slice(m).__setitem__(1, -5))),
    ("meta-overlapping-slices", meta(lambda m: m["files"][SHARD].append(first_slice(m)))),
    ("meta-slice-of-unknown-param", meta(lambda m: first_slice(m).__setitem__(0, "nonexistent"))),
    ("meta-world-size-0", meta(lambda m: m.update(world_size=0))),
    ("meta-world-size-a-string", meta(lambda m: m.update(world_size="1"))),
    ("meta-world-size-mismatch", files_as(lambda c: "shards_rank00003.safetensors")),
    ("meta-counters-wrong-type", meta(lambda m: m["counters"].update(global_steps="1"))),
    ("meta-unknown-module-dtype", meta(lambda m: m["module"][FROZEN].update(dtype="Tensor"))),
    ("meta-hf-config-a-list", meta(lambda m: m.update(hf_config=[1]))),
    ("meta-file-name-traversal", files_as(lambda c: f"../../bait/global_step1/{SHARD}")),
    ("meta-file-name-absolute", files_as(lambda c: str(c / "bait" / "global_step1" / SHARD))),
    ("meta-file-name-nul", files_as(lambda c: SHARD + "\0x")),
    ("meta-file-name-state-pt", files_as(lambda c: "state.pt")),
    ("latest-absolute-path", put("run/latest", lambda c: str(c / "bait" / "global_step1"))),
    ("latest-hidden-folder", lambda c: (shutil.copytree(c / TAG, c / "run/.hidden"), put("run/latest", ".hidden")(c))),
    ("shard-truncated", put(SHARD_AT, lambda c: (c / SHARD_AT).read_bytes()[:5000])),
    ("shard-pickle-payload", put(SHARD_AT, lambda c: pickle.dumps(WritesMarker(c / MARKER)))),
    ("shard-is-a-folder", lambda c: ((c / SHARD_AT).unlink(), (c / SHARD_AT).mkdir())),
    ("shard-missing", lambda c: (c / SHARD_AT).unlink()),
    ("tag-flag-a-path", lambda c: ["--tag", "../bait/global_step1"]),  # what a breakage returns: flags to add
]


@pytest.mark.parametrize("name, breakage", BROKEN_CHECKPOINTS, ids=[row[0] for row in BROKEN_CHECKPOINTS])
def test_broken_checkpoint_is_refused_by_consolidate_naming_the_file(ckpt, cli, name, breakage):
    flags = breakage(ckpt)
    before = _files(ckpt)
    code, _, err = cli("consolidate", ckpt / "run", ckpt / "out", *(flags if isinstance(flags, list) else []))
    assert_refused(code, err, named_file(name))
    assert _files(ckpt) == before, "a failed consolidation left files behind"


def test_a_tag_inside_meta_json_is_never_used_as_a_path(ckpt, cli):
    meta(lambda m: m.update(tag=f"../../{MARKER}"))(ckpt)
    before = _files(ckpt)
    code, _, err = cli("consolidate", ckpt / "run", ckpt / "out")
    assert code == 0, err
    assert {f for f in _files(ckpt) - before} == {"out/model.safetensors"}


def test_the_marker_payload_would_run_if_unpickled(tmp_path):
    """The pickle cases prove something only if the payload works: here it is unpickled on purpose."""
    pickle.loads(pickle.dumps(WritesMarker(tmp_path / MARKER)))
    assert (tmp_path / MARKER).exists()


ENGINE_LOADS = [  # (case, breakage): what engine.load_checkpoint refuses; the first word is the file to be named
    ("state-pickle-payload", put(STATE_PT, lambda c: pickle.dumps(WritesMarker(c / MARKER)))),
    ("state-torch-save-payload", lambda c: torch.save({"client_state": WritesMarker(c / MARKER)}, c / STATE_PT)),
    ("state-not-a-dict", lambda c: torch.save([1, 2], c / STATE_PT)),
    ("rng-pickle-payload", put(RNG_PT, lambda c: pickle.dumps(WritesMarker(c / MARKER)))),
    ("rng-wrong-structure", lambda c: torch.save({"torch": torch.zeros(3), "python": 1}, c / RNG_PT)),
    ("meta-param-groups-missing", meta(lambda m: m.pop("param_groups"))),
    ("meta-group-scalar-dtype-a-function", meta(lambda m: m["group_scalars"][0]["step"].update(dtype="load"))),
    ("meta-lr-a-string", meta(lambda m: m["param_groups"][0].update(lr="$(touch x)"))),
    ("meta-module-of-another-model", lambda c: (meta(lambda m: m["module"][FROZEN].update(shape=[1000]))(c),
                                                shard(lambda t: t.reshape(-1)[:1000], MODULE_KEY)(c))),
    ("latest-absolute-path", put("run/latest", lambda c: str(c / "bait" / "global_step1"))),
]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the crafted pickles
@pytest.mark.parametrize("name, breakage", ENGINE_LOADS, ids=[row[0] for row in ENGINE_LOADS])
def test_broken_checkpoint_is_refused_by_load_checkpoint_naming_the_file(ckpt, name, breakage):
    breakage(ckpt)
    engine = new_engine()
    with pytest.raises(CheckpointError, match=named_file(name).replace(".", r"\.")):
        engine.load_checkpoint(str(ckpt / "run"))
