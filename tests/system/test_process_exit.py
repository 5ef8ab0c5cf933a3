"""Leaving without the interpreter's teardown loses nothing a normal exit keeps: threads finish,
atexit handlers run, buffered output is written, the status is Python's; only the teardown (module
objects' finalizers) is skipped. The `zerotrain` command and `zerotrain train`'s ranks end this way."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import user_env, zerotrain_script

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from zerotrain.system.process_exit import exit_now, run_then_exit

    out = Path(sys.argv[1])

    class Finalized:
        def __del__(self):  # runs in the interpreter's teardown only
            out.joinpath("teardown").write_text("ran")

    kept = Finalized()
    atexit.register(lambda: out.joinpath("atexit").write_text("ran"))

    def late_writer():
        time.sleep(0.5)
        out.joinpath("thread").write_text("done")

    threading.Thread(target=late_writer).start()  # not a daemon: an exit waits for it
    pool = ThreadPoolExecutor(1)  # its idle worker must not hold the exit up
    pool.submit(time.sleep, 0.2)
    sys.stdout.write("no newline, still buffered")
    mode = sys.argv[2]
    if mode == "exit_now":
        exit_now(3)
    def main():
        if mode == "message":
            sys.exit("stopped: a message")
        return 4
    run_then_exit(main)
""")


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return subprocess.run([sys.executable, str(script), str(tmp_path), mode], capture_output=True, text=True,
                          timeout=60, env=user_env())


def test_exit_now_waits_for_threads_runs_atexit_flushes_output_and_skips_only_the_teardown(tmp_path):
    done = _run(tmp_path, "exit_now")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "no newline, still buffered"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists(), "the interpreter's teardown ran: the exit saved nothing"


def test_run_then_exit_gives_the_status_python_would(tmp_path):
    returned = _run(tmp_path, "return")
    assert returned.returncode == 4, returned.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"

    message = _run(tmp_path, "message")
    assert message.returncode == 1
    assert message.stderr.strip() == "stopped: a message"  # as Python prints sys.exit("...")


def test_the_zerotrain_command_keeps_its_exit_status_and_output(tmp_path):
    helped = subprocess.run([zerotrain_script(), "--help"], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env=user_env())
    assert helped.returncode == 0 and "usage: zerotrain" in helped.stdout
    wrong = subprocess.run([zerotrain_script(), "no-such-command"], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path, env=user_env())
    assert wrong.returncode == 2 and "invalid choice" in wrong.stderr  # argparse's usage error, as before


def test_a_failed_rank_ends_through_system_exit_so_the_bootstrap_sees_it():
    import pytest

    from zerotrain.system.process_exit import end_rank

    with pytest.raises(SystemExit) as ended:
        end_rank(3)
    assert ended.value.code == 3
