"""`zerotrain bench comm`: the bandwidth formulas against hand-computed values and the bytes moved, and the
command on two loopback sshd nodes (127.0.0.21, .22) through `zerotrain launch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from zerotrain.bench.bandwidth import (
    COLLECTIVES, MARKER, PairResult, bandwidth_row, bus_factor, bytes_sent_per_rank, collective_bytes, counter_bytes,
    diagnose_pairs, element_counts, format_bytes, format_size, format_time_us, parse_size, size_list, slowest_pair,
)

from zerotrain.bench.comm import run_worker

from conftest import device_env, on_gpu, zerotrain_script
from free_ports import free_port

MB = 1 << 20


# --- the formulas ------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks, all_reduce, gather_scatter", [(2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_bus_factor_is_nccl_tests_correction(ranks, all_reduce, gather_scatter):
    # doc/PERFORMANCE.md: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n.
    assert bus_factor("all_reduce", ranks) == all_reduce
    assert bus_factor("all_gather", ranks) == bus_factor("reduce_scatter", ranks) == gather_scatter


def test_bandwidths_from_size_and_time_by_hand():
    # 64 MiB all-reduce over 4 ranks in 10 ms: algbw = 67108864 B / 0.01 s = 6.7108864 GB/s; busbw x 1.5.
    row = bandwidth_row("all_reduce", 64 * MB, 4, 0.01, counted_bytes=2 * 64 * MB)
    assert row.algbw_gbps == pytest.approx(6.7108864)
    assert row.busbw_gbps == pytest.approx(10.0663296)
    assert row.elements == 16 * MB
    # 1 GiB all-gather (total output) over 8 ranks in 0.1 s: 10.737 GB/s, busbw x 7/8.
    row = bandwidth_row("all_gather", 1 << 30, 8, 0.1, counted_bytes=1 << 30)
    assert row.algbw_gbps == pytest.approx(10.73741824)
    assert row.busbw_gbps == pytest.approx(9.39524096)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_busbw_times_time_is_the_bytes_each_rank_sends(collective, ranks):
    size = 16 * MB
    inputs, outputs = element_counts(collective, size, ranks)
    assert collective_bytes(collective, inputs, outputs) == size
    chunk = size // ranks  # bytes: the 1/n share every rank owns
    # Sent per rank by a ring, counted chunk by chunk: n-1 chunks per pass, 2 passes for all-reduce.
    by_hand = {"all_reduce": 2 * (ranks - 1) * chunk, "all_gather": (ranks - 1) * chunk,
               "reduce_scatter": (ranks - 1) * chunk}[collective]
    assert bytes_sent_per_rank(collective, size, ranks) == by_hand
    # COMM_COUNTER's accounting (zerotrain.comm.distributed): all-reduce 2S, all-gather out S, reduce-scatter in S.
    assert counter_bytes(collective, size) == {"all_reduce": 2 * size}.get(collective, size)
    assert counter_bytes(collective, size) * (ranks - 1) / ranks == by_hand
    row = bandwidth_row(collective, size, ranks, 0.0123, counted_bytes=counter_bytes(collective, size))
    assert row.busbw_gbps * 1e9 * row.time_s == pytest.approx(by_hand)
    assert row.bytes_problem() is None


def test_tensor_sizes_follow_nccl_tests_per_rank_counts():
    # All-gather: S is the output, each rank sends S/n; reduce-scatter: S is the input, each rank gets S/n.
    assert element_counts("all_gather", 4096, 4) == (256, 1024)
    assert element_counts("reduce_scatter", 4096, 4) == (1024, 256)
    assert element_counts("all_reduce", 4096, 4) == (1024, 1024)
    # A size that does not split into n chunks is rounded down, as nccl-tests do.
    inputs, outputs = element_counts("all_gather", 1024, 3)
    assert (inputs, outputs) == (85, 255) and collective_bytes("all_gather", inputs, outputs) == 1020


def test_bytes_problem_names_a_counter_that_disagrees():
    row = bandwidth_row("all_reduce", MB, 4, 0.001, counted_bytes=MB)  # counted as if it were a one-pass op
    assert "COMM_COUNTER recorded" in row.bytes_problem()


def test_sizes_parse_and_step_by_powers():
    assert [parse_size(t) for t in ("1K", "64M", "1G", "4096", "2mb")] == [1024, 64 * MB, 1 << 30, 4096, 2 * MB]
    assert [format_size(s) for s in size_list(1024, 1 << 30)] == [
        "1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M", "256M", "1G"]
    assert size_list(1024, 8192, factor=2) == [1024, 2048, 4096, 8192]
    assert size_list(1024, 10000) == [1024, 4096, 10000]  # the largest size is always measured
    assert [format_bytes(b) for b in (100663296, 1536, 768)] == ["96M", "1.5K", "768B"]
    assert [format_time_us(t) for t in (0.187, 0.0012345, 0.00001234)] == ["187,000", "1,234.5", "12.34"]
    for bad in ("0", "-1K", "1T", "lots"):
        with pytest.raises(ValueError, match="cannot read the size"):
            parse_size(bad)


def test_pairs_tell_a_slow_node_from_a_slow_link():
    def pairs(speeds: dict) -> list[PairResult]:
        return [PairResult(tuple(p.split("-")), s) for p, s in speeds.items()]

    # d is slow with everyone: a slow node, not three slow links.
    slow_node = pairs({"a-b": 10, "a-c": 10, "b-c": 10, "a-d": 3, "b-d": 3, "c-d": 3})
    assert diagnose_pairs(slow_node)["slow_nodes"] == ["d"] and diagnose_pairs(slow_node)["slow_links"] == []
    # Only b-c is slow: a link; b and c are fine with the others.
    slow_link = pairs({"a-b": 10, "a-c": 10, "a-d": 10, "b-c": 2, "b-d": 10, "c-d": 10})
    found = diagnose_pairs(slow_link)
    assert found == {"median_gbps": 10, "slow_nodes": [], "slow_links": [["b", "c"]]}
    assert slowest_pair(slow_link).nodes == ("b", "c")
    failed = pairs({"a-b": 10, "a-c": None, "b-c": 9})
    assert slowest_pair(failed).nodes == ("a", "c") and diagnose_pairs(failed)["slow_links"] == [["a", "c"]]


# --- collecting a launch's results -------------------------------------------------------------

def test_marked_lines_are_collected_behind_the_launchers_host_rank_prefix():
    row = bandwidth_row("all_reduce", 4096, 2, 0.001, counted_bytes=8192).as_dict()
    script = (f"print('[node1 0]: {MARKER} start ' + {json.dumps(json.dumps({'ranks': 2}))}); print('noise'); "
              f"print('[node1 0]: {MARKER} row ' + {json.dumps(json.dumps(row))})")
    run = run_worker([sys.executable, "-c", script], timeout_s=60)
    assert run.exit_code == 0 and run.error is None
    assert run.start == {"ranks": 2} and [r.as_dict() for r in run.rows] == [row]
    assert run.output_tail == ["noise"]


def test_a_launch_past_the_timeout_is_stopped_and_reported():
    script = "import time; print('started', flush=True); time.sleep(120)"
    start = time.monotonic()
    run = run_worker([sys.executable, "-c", script], timeout_s=1)
    assert time.monotonic() - start < 30
    assert run.timed_out and run.error == "timed out" and run.exit_code != 0


# --- the command on two sshd nodes --------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.mark.slow
def test_comm_on_two_nodes_prints_every_collective_and_size_and_the_pair(make_ssh_nodes, tmp_path):
    cluster = make_ssh_nodes(["127.0.0.21", "127.0.0.22"])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = tmp_path / "comm.json"
    done = subprocess.run(
        [zerotrain_script(), "bench", "comm", str(cluster.hostfile(slots=2)), "--ssh_args", cluster.ssh_args,
         "--master_port", str(free_port("127.0.0.21")), "--max-size", "64K", "--warmup", "1", "--iters", "3",
         "--json", str(out)],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["nodes"] == ["127.0.0.21", "127.0.0.22"] and result["ranks"] == 4
    assert result["backend"] == "gloo" and result["all_nodes"]["error"] is None
    rows = result["all_nodes"]["rows"]
    sizes = [1024, 4096, 16384, 65536]
    assert [(r["collective"], r["size"]) for r in rows] == [(c, s) for c in COLLECTIVES for s in sizes]
    for r in rows:
        assert r["ranks"] == 4 and r["wrong"] == 0
        assert r["time_s"] > 0 and r["algbw_gbps"] > 0 and r["busbw_gbps"] > 0
        assert r["counted_bytes"] == counter_bytes(r["collective"], r["size"])  # COMM_COUNTER saw these bytes
        assert r["busbw_gbps"] * 1e9 * r["time_s"] == pytest.approx(bytes_sent_per_rank(r["collective"], r["size"], 4))
    for name in COLLECTIVES:
        assert f"{name}: 4 ranks on 2 nodes (gloo)" in done.stdout
    assert "64K" in done.stdout and "busbw (GB/s)" in done.stdout
    [pair] = result["pairs"]
    assert pair["nodes"] == ["127.0.0.21", "127.0.0.22"] and pair["size"] == 65536
    assert pair["busbw_gbps"] > 0 and pair["error"] is None
    assert result["slowest_pair"]["nodes"] == pair["nodes"]
    assert "node pairs: all_reduce 64K" in done.stdout and "slowest pair: 127.0.0.21 - 127.0.0.22" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", on_gpu("gpu", "gpu-1process")])
def test_comm_on_this_machine_alone_measures_every_collective(tmp_path, device):
    """A one-host hostfile naming this machine: 2 Gloo ranks on the CPU, or the one GPU over NCCL."""
    import torch

    slots = 1 if device == "gpu" else 2
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={slots}\n")
    out = tmp_path / "comm.json"
    done = subprocess.run(
        [zerotrain_script(), "bench", "comm", str(hostfile), "--max-size", "64K", "--warmup", "1", "--iters", "3",
         "--master_port", str(free_port("127.0.0.1")), "--json", str(out)],
        cwd=tmp_path, env={**_env(), **device_env(device)}, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    on_cuda = device == "gpu" and torch.cuda.is_available()
    assert result["ranks"] == slots and result["backend"] == ("nccl" if on_cuda else "gloo")
    assert result["all_nodes"]["error"] is None
    rows = result["all_nodes"]["rows"]
    assert [(r["collective"], r["size"]) for r in rows] == [(c, s) for c in COLLECTIVES for s in (1024, 4096, 16384, 65536)]
    assert all(r["wrong"] == 0 and r["time_s"] > 0 for r in rows)


@pytest.mark.slow
def test_comm_names_an_unreadable_hostfile(zerotrain_cli, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=two\n")
    done = zerotrain_cli("bench", "comm", hostfile)
    assert done.returncode == 2
    assert str(hostfile) in done.stderr and "slots" in done.stderr
