"""A bench_loop driver stopped by a signal (a device call's `timeout`, Ctrl-C) kills the case or model build it
runs: each has its own session, and one left running would hold the card through the next measurement on it."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the case process through /proc")


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:  # the process ended between children() and here (the driver's short-lived helpers do)
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"waited {seconds:g} s for {what}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_driver_kills_its_running_case(tmp_path, signum):
    driver = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_loop", "--dry-run", "--shapes", "tiny-qwen2-lora", "--systems",
         "fastgrpo", "--log-dir", str(tmp_path / "logs"), "--results-dir", str(tmp_path / "results")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cases = []
    try:
        cases = wait_for(lambda: [c for c in children(driver.pid) if "--child" in cmdline(c)],
                         120, "the driver to start its case")
        driver.send_signal(signum)
        output = driver.communicate(timeout=30)[0]
        # SIGKILLed, the case ends at once; left running, it would go on for seconds (a dry-run case takes ~6 s)
        wait_for(lambda: not any(alive(c) for c in cases), 2, f"the case {cases} to end after the driver's exit")
        assert driver.returncode == 128 + signum, output
        assert "killed 1 running case(s) or build(s)" in output, output
        assert not list((tmp_path / "results").glob(".*.partial"))
    finally:
        driver.kill()
        driver.wait()
        for case in cases:  # what a failing driver left behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(case, signal.SIGKILL)


def test_a_stopped_driver_kills_a_model_build_too(tmp_path):
    """The model folder's build runs through the same RunningCases.run as a case (a real build needs a GPU, so a
    stand-in command here): SIGTERM to the driver ends it."""
    script = ("import signal, sys; from benchmarks.bench_loop import RUNNING_CASES as R; "
              "signal.signal(signal.SIGTERM, R.stop); R.run([sys.executable, '-c', 'import time; time.sleep(60)'])")
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    builds = []
    try:
        builds = wait_for(lambda: [c for c in children(driver.pid) if "time.sleep" in cmdline(c)], 60,
                          "the driver to start its build")
        driver.send_signal(signal.SIGTERM)
        output = driver.communicate(timeout=30)[0]
        wait_for(lambda: not any(alive(c) for c in builds), 2, f"the build {builds} to end after the driver's exit")
        assert driver.returncode == 128 + signal.SIGTERM and "killed 1 running case(s) or build(s)" in output, output
    finally:
        driver.kill()
        driver.wait()
        for build in builds:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(build, signal.SIGKILL)


def test_a_stop_signal_while_a_build_registers_kills_it(tmp_path):
    """SIGTERM between a build's start and its registration (the stop handler runs on the main thread, which held
    the lock the handler takes): the driver waited for itself forever (the CI machine caught it once); now the run
    acts on the signal as it lets go of the lock, and the build dies with it."""
    script = ("import os, signal, subprocess, sys; from benchmarks.bench_loop import RUNNING_CASES as R; "
              "signal.signal(signal.SIGTERM, R.stop); start = subprocess.Popen\n"
              "def popen(*args, **kwargs):\n"
              "    proc = start(*args, **kwargs); print(proc.pid, flush=True); os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return proc\n"
              "subprocess.Popen = popen\n"
              "R.run([sys.executable, '-c', 'import time; time.sleep(60)'])")
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    build = None
    try:
        output = driver.communicate(timeout=30)[0]
        build = int(output.split()[0])
        wait_for(lambda: not alive(build), 2, f"the build {build} to end after the driver's exit")
        assert driver.returncode == 128 + signal.SIGTERM and "killed 1 running case(s) or build(s)" in output, output
    finally:
        driver.kill()
        driver.wait()
        if build is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(build, signal.SIGKILL)


def test_main_stops_cases_on_a_signal_while_it_runs_and_gives_the_handlers_back(tmp_path, monkeypatch):
    """Called from Python, main hands SIGTERM / SIGINT to RUNNING_CASES.stop while its cases run, then puts back the
    caller's handlers (left installed, a later Ctrl-C in the same process would meet a stop handler with nothing to
    stop)."""
    import benchmarks.bench_loop as bench

    during = []

    def run_case(case, log_dir, timeout, dry_run):  # the case as main built it, in place of its process
        during.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))
        return {"system": case.label, "completion": case.completion}

    monkeypatch.setattr(bench, "run_case", run_case)
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    bench.main(["--dry-run", "--shapes", "tiny-qwen2-lora", "--systems", "fastgrpo", "--results-dir",
                str(tmp_path / "results"), "--log-dir", str(tmp_path / "logs")])
    assert during == [(bench.RUNNING_CASES.stop, bench.RUNNING_CASES.stop)]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_main_gives_the_handlers_back_when_its_cases_stop_on_an_error(tmp_path):
    """An error inside main (a bad --shapes, a case that raises) puts back the caller's handlers too."""
    import benchmarks.bench_loop as bench

    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with pytest.raises(SystemExit, match="--shapes"):
        bench.main(["--dry-run", "--shapes", "tiny-qwen2-bogus", "--results-dir", str(tmp_path / "results"),
                    "--log-dir", str(tmp_path / "logs")])
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
