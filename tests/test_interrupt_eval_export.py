"""Ctrl-C during `fastgrpo eval` and `fastgrpo export`: one line, exit 130, and no file that looks like a finished
result. A Ctrl-C that a library (or a reward function's bare `except:`) swallows stops the command too: eval at its
next batch, export before it writes; it ran to the end and exited 0 before. An evaluation writes its results.jsonl and
summary.json only once every batch is done, and an export fills a hidden folder renamed into place at the end: a
Ctrl-C in the middle leaves neither (nor the previous export's folder changed)."""
import os
import signal

import pytest

from fastgrpo.rollout import BuiltinEngine
from fastgrpo.train import default_task, final_export
from fastgrpo.train.cli import main
from tests.test_newcomer_cli import ctrl_c_swallowed

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
EVAL = ["--max-examples", "8", "--batch-size", "2"]  # 4 batches: a stop in the second skips two


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A built-in run of 2 steps with a checkpoint each, for export."""
    folder = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--max-steps", "2", "--save-steps", "1", "--output-dir", str(folder), *QUIET]) == 0
    return folder


def _command(name, run, out):
    return ["eval", *EVAL, "--output-dir", str(out)] if name == "eval" else \
        ["export", "--checkpoint", str(run), "--output-dir", str(out)]


def _entries(folder):
    """Every entry of `folder`, hidden ones too (a partial write's), as sorted names; None where it is missing."""
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else None


@pytest.mark.parametrize("after", ["goes on", "fails", "fails with an OSError"])
@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_ctrl_c_swallowed_as_the_model_loads_stops_in_one_line(run, tmp_path, capsys, monkeypatch, command, after):
    """Before: the swallowed one let eval evaluate and export write, exit 0 (`goes on`); an OSError it left (a cut
    read, which transformers reports as one) said `error: ...`, exit 1, instead of the interrupt."""
    build = default_task.build_model

    def build_model(*args, **kwargs):
        ctrl_c_swallowed()
        if after == "fails":
            raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from RecursionError()
        if after == "fails with an OSError":
            raise OSError("Unable to load weights from checkpoint file")
        return build(*args, **kwargs)

    monkeypatch.setattr(default_task, "build_model", build_model)
    batches = _counting_batches(monkeypatch)
    out = tmp_path / "out"
    assert main(_command(command, run, out)) == 130
    assert capsys.readouterr().err == f"fastgrpo {command}: interrupted\n"
    assert not batches  # eval stops before its first batch
    assert _entries(out) is None and _entries(tmp_path) == []  # nothing written, no hidden partial write
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler back
    monkeypatch.undo()
    assert main(_command(command, run, out)) == 0  # the same command again runs


def _reward_file(tmp_path, swallow_at: int):
    """A user's reward (the built-in task's) that swallows a Ctrl-C in its `swallow_at`-th call, as a reward with a
    bare `except:` around a grader does."""
    file = tmp_path / "my_reward.py"
    file.write_text(
        "import os, signal, time\n"
        "from fastgrpo.train.default_task import repeat_letter_reward\n"
        "calls = []\n"
        "def reward(prompts, completions, **columns):\n"
        "    calls.append(1)\n"
        f"    if len(calls) == {swallow_at}:\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(5)\n"
        "        except:  # noqa: E722 - what users write\n"
        "            pass\n"
        "    return repeat_letter_reward(prompts, completions, **columns)\n")
    return f"{file}:reward"


def _counting_batches(monkeypatch) -> list:
    calls = []
    generate = BuiltinEngine.generate

    def counted(self, *args, **kwargs):
        calls.append(1)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(BuiltinEngine, "generate", counted)
    return calls


def test_a_ctrl_c_a_reward_swallowed_stops_eval_at_the_next_batch(tmp_path, capsys, monkeypatch):
    """Before: the evaluation went on through every batch and wrote its results, exit 0."""
    batches = _counting_batches(monkeypatch)
    out = tmp_path / "eval"
    reward = ["--reward-funcs", _reward_file(tmp_path, swallow_at=2)]
    assert main(["eval", *EVAL, *reward, "--output-dir", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "fastgrpo eval: interrupted"
    assert len(batches) == 2, f"{len(batches)} batches generated of 4"
    assert _entries(out) is None  # no results.jsonl / summary.json: nothing that reads as the evaluation's


def test_a_ctrl_c_in_evals_generation_stops_it_without_results(tmp_path, capsys, monkeypatch):
    """Fine before the fix too: the evidence that a Ctrl-C that reaches Python stops eval in the batch it lands in,
    with no results file, and a second evaluation into the same folder runs."""
    batches = _counting_batches(monkeypatch)
    generate = BuiltinEngine.generate

    def interrupted_in_batch_2(self, *args, **kwargs):
        if len(batches) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(BuiltinEngine, "generate", interrupted_in_batch_2)
    out = tmp_path / "eval"
    assert main(["eval", *EVAL, "--output-dir", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "fastgrpo eval: interrupted"
    assert len(batches) == 2 and _entries(out) is None and _entries(tmp_path) == []
    monkeypatch.undo()
    assert main(["eval", *EVAL, "--output-dir", str(out)]) == 0
    assert _entries(out) == ["results.jsonl", "summary.json"]


def _files(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def export_into(run, out, into: str) -> tuple[list[str], dict | None]:
    """`out` made ready as `into` says ("a new folder", "an empty folder", "a previous export"): the flags an export
    into it takes, and its files before it (None: no folder)."""
    flags = []
    if into == "an empty folder":
        out.mkdir()
    elif into == "a previous export":
        assert main(["export", "--checkpoint", str(run / "checkpoint-1"), "--output-dir", str(out)]) == 0
        flags = ["--overwrite-output-dir"]
    return flags, (_files(out) if out.exists() else None)


def as_export_writes(monkeypatch, act) -> None:
    """export's model files written in part when act() runs: the tokenizer is, the run config and export.json not
    yet (final_export.finish_export patched)."""
    finish = final_export.finish_export

    def acting(folder, tokenizer, *args):
        tokenizer.save_pretrained(folder)
        act()
        return finish(folder, tokenizer, *args)

    monkeypatch.setattr(final_export, "finish_export", acting)


@pytest.mark.parametrize("into", ["a new folder", "an empty folder", "a previous export"])
def test_a_ctrl_c_as_export_writes_leaves_no_part_of_it(run, tmp_path, capsys, monkeypatch, into):
    """Fine before the fix too: the evidence that a Ctrl-C as the model's files are written (the tokenizer written,
    the run config and export.json not yet) leaves no output folder that looks like an export (a previous export
    --overwrite-output-dir replaces stays byte for byte) and no hidden partial copy beside it, and that the same
    export again runs."""
    out = tmp_path / "export"
    flags, before = export_into(run, out, into)
    as_export_writes(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGINT))
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(out), *flags]) == 130
    assert capsys.readouterr().err == "fastgrpo export: interrupted\n"
    assert (_files(out) if out.exists() else None) == before
    assert _entries(tmp_path) == ([] if into == "a new folder" else ["export"])  # no .export.tmp-<pid>
    monkeypatch.undo()
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(out), *flags]) == 0
    assert _files(out) == _files(run / "final")
