"""SIGTERM (a cluster scheduler's, `timeout`'s, `docker stop`'s) during `fastgrpo eval` and `fastgrpo export` stops them
as a Ctrl-C does: one line, exit 143, the previous results or export as they were, no hidden partial write left.
Before, Python's default killed them at once: no line, exit -15, and an export's hidden partial copy of the model (or
the new output folder) left beside the user's files, an evaluation's folder left with its lock. The SIGTERM tests run
the command in a child process (an unhandled SIGTERM would end pytest's). Also: eval's partial writes go when a Ctrl-C
lands as it writes, its files are fsynced before they are renamed into place, and a Ctrl-C a library swallowed as
export writes stops it as one it let through does (exit 130, nothing new in place)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastgrpo.train import evaluate, run_dir
from fastgrpo.train.cli import main
from tests.test_interrupt_eval_export import EVAL, QUIET, _entries, _files, as_export_writes, export_into
from tests.test_newcomer_cli import ctrl_c_swallowed

REPO = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 120
# Python run in the child before the CLI: `fastgrpo.train.<module>.<name>` wrapped to send the child a signal once
SIGNAL_IN = """
import importlib, os, signal, time
module = importlib.import_module("fastgrpo.train.{module}")
real = getattr(module, "{name}")
def signalled(*args, **kwargs):
    {before}
    {send}
    return real(*args, **kwargs)
setattr(module, "{name}", signalled)
"""
SEND = "os.kill(os.getpid(), signal.{signal})"
SWALLOWED_LINE = "(the signal swallowed)"  # what the child writes to stderr once its hook caught the signal
# as torch's numpy import does; the signal sent inside the `try`: its handler runs as os.kill returns
SWALLOWED = ("try:\n        " + SEND + "\n        time.sleep(5)\n    except KeyboardInterrupt:\n"
             "        os.write(2, b'" + SWALLOWED_LINE + "\\n')")


def _child(argv: list[str], hook: str = "") -> subprocess.CompletedProcess:
    """`python -m fastgrpo *argv` in a child process, with `hook` run first (SIGNAL_IN)."""
    script = f"{hook}\nimport sys\nfrom fastgrpo.__main__ import main\nsys.exit(main())\n"
    return subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)


def _signal_in(module: str, name: str, signum: str = "SIGTERM", before: str = "pass", swallowed: bool = False) -> str:
    send = (SWALLOWED if swallowed else SEND).format(signal=signum)
    return SIGNAL_IN.format(module=module, name=name, before=before, send=send)


def _ended_in_one_line(done: subprocess.CompletedProcess, command: str, line: str, code: int) -> None:
    assert (done.returncode, done.stderr.strip().splitlines()[-1:]) == (code, [f"fastgrpo {command}: {line}"]), \
        f"exit {done.returncode}; stderr:\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A built-in run of 2 steps with a checkpoint each, for export."""
    folder = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--max-steps", "2", "--save-steps", "1", "--output-dir", str(folder), *QUIET]) == 0
    return folder


# ---- export ----

@pytest.mark.parametrize("into", ["a new folder", "a previous export"])
def test_sigterm_as_export_writes_leaves_the_previous_export_and_no_partial_copy(run, tmp_path, into):
    """Before: killed (-15) with the tokenizer written into .export.tmp-<pid>/ beside the output folder, and a new
    output folder left empty."""
    out = tmp_path / "export"
    flags, before = export_into(run, out, into)
    # as the model's files are written: the tokenizer is, the run config and export.json are not yet
    hook = _signal_in("final_export", "finish_export", before="args[1].save_pretrained(args[0])")
    done = _child(["export", "--checkpoint", str(run), "--output-dir", str(out), *flags], hook)
    _ended_in_one_line(done, "export", "terminated", 143)
    assert (_files(out) if out.exists() else None) == before
    assert _entries(tmp_path) == ([] if into == "a new folder" else ["export"])  # no .export.tmp-<pid>


@pytest.mark.parametrize("swallowed", [False, True], ids=["let through", "swallowed by a library"])
def test_sigterm_as_export_loads_the_model_writes_nothing(run, tmp_path, swallowed):
    """Before: killed (-15), the output folder it created left behind; a SIGTERM a library swallowed as the model
    loaded would have let the export write. Now both stop before anything is written (stop_if_interrupted)."""
    out = tmp_path / "export"
    hook = _signal_in("default_task", "build_model", swallowed=swallowed)
    done = _child(["export", "--checkpoint", str(run), "--output-dir", str(out)], hook)
    _ended_in_one_line(done, "export", "terminated", 143)
    assert (SWALLOWED_LINE in done.stderr) == swallowed, done.stderr
    assert _entries(tmp_path) == []


def test_sigterm_under_debug_shows_the_traceback_and_still_exits_143(run, tmp_path):
    """--debug shows the traceback instead of the line; raised on, the Terminated (a KeyboardInterrupt) ended the
    process with exit 1, which a scheduler reads as a failure, not as its own stop."""
    done = _child(["export", "--checkpoint", str(run), "--output-dir", str(tmp_path / "export"), "--debug"],
                  _signal_in("default_task", "build_model"))
    assert done.returncode == 143, done.stderr
    assert "Traceback" in done.stderr and done.stderr.strip().endswith("Terminated"), done.stderr
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("into", ["a new folder", "a previous export"])
def test_a_ctrl_c_swallowed_as_export_writes_puts_nothing_in_place(run, tmp_path, capsys, monkeypatch, into):
    """As a Ctrl-C that reaches Python there (test_interrupt_eval_export), and as eval, which checks for one after
    each batch and writes nothing once it did: exit 130, the previous export (or none) in place. Before: the export
    was written, exit 0, though the user had asked it to stop."""
    out = tmp_path / "export"
    flags, before = export_into(run, out, into)
    as_export_writes(monkeypatch, ctrl_c_swallowed)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(out), *flags]) == 130
    assert capsys.readouterr().err == "fastgrpo export: interrupted\n"
    assert (_files(out) if out.exists() else None) == before
    assert _entries(tmp_path) == ([] if into == "a new folder" else ["export"])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # Python's own handling back


# ---- eval ----

def _previous_results(out: Path) -> dict:
    assert main(["eval", *EVAL, "--output-dir", str(out)]) == 0
    return _files(out)


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_as_eval_writes_its_results_leaves_the_previous_ones_and_no_partial_write(tmp_path, signum):
    """Landing as results.jsonl's hidden partial write is filled. Before: that partial write (.results.jsonl.tmp) was
    left in the output folder beside the previous results (SIGINT: exit 130; SIGTERM: killed, -15)."""
    out = tmp_path / "eval"
    before = _previous_results(out)
    hook = _signal_in("evaluate", "write_beside", signum, before="args[0].with_name(f'.{args[0].name}.tmp').touch()")
    done = _child(["eval", *EVAL, "--output-dir", str(out), "--overwrite-output-dir"], hook)
    _ended_in_one_line(done, "eval", "interrupted" if signum == "SIGINT" else "terminated",
                       130 if signum == "SIGINT" else 143)
    assert _files(out) == before  # no .results.jsonl.tmp (nor the lock) beside them


@pytest.mark.parametrize(("into", "swallowed"), [("a new folder", False), ("previous results", False),
                                                 ("previous results", True)])
def test_sigterm_as_eval_generates_leaves_the_previous_results(tmp_path, into, swallowed):
    """A user's reward that receives the SIGTERM in its second batch (of 4), or swallows it there with a bare
    `except:` (eval stops after that batch). Before: killed (-15), the output folder left with the lock file in it."""
    out = tmp_path / "eval"
    before = _previous_results(out) if into == "previous results" else None
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "import os, signal, time\n"
        "from fastgrpo.train.default_task import repeat_letter_reward\n"
        "calls = []\n"
        "def reward(prompts, completions, **columns):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "            time.sleep(5)\n"
        f"        except {'BaseException' if swallowed else 'Exception'}:\n"
        "            pass\n"
        "    return repeat_letter_reward(prompts, completions, **columns)\n")
    done = _child(["eval", *EVAL, "--reward-funcs", f"{reward}:reward", "--output-dir", str(out),
                   "--overwrite-output-dir"])
    _ended_in_one_line(done, "eval", "terminated", 143)
    assert (_files(out) if out.exists() else None) == before


def test_eval_fsyncs_its_files_before_renaming_them_and_the_folder_after(tmp_path, monkeypatch):
    """A power loss after a rename whose file's data had not reached the disk leaves results.jsonl or summary.json
    empty (or cut) under its final name. Before: no fsync at all."""
    events, real_replace = [], os.replace
    def fsync(path):
        events.append(("fsync", path.name, _text(path)))

    monkeypatch.setattr(evaluate, "fsync_path", fsync)  # the folder's
    monkeypatch.setattr(run_dir, "fsync_path", fsync)  # each file's, as write_beside writes it
    monkeypatch.setattr(evaluate.os, "replace", lambda src, dst: (events.append(("rename", Path(dst).name, None)),
                                                                  real_replace(src, dst)))
    records, summary = [{"index": 0, "completion": "a"}], {"accuracy": 1.0}
    evaluate.write_eval(records, summary, tmp_path / "results.jsonl", tmp_path / "summary.json")
    written = {name: _text(tmp_path / name) for name in ("results.jsonl", "summary.json")}
    assert json.loads(written["summary.json"]) == summary
    for name, text in written.items():  # each fsynced whole, under its hidden name, before its rename
        synced = events.index(("fsync", f".{name}.tmp", text))
        assert synced < events.index(("rename", name, None)), events
    assert events[-1] == ("fsync", tmp_path.name, None), events  # the renames themselves made durable
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results.jsonl", "summary.json"]


def _text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None
