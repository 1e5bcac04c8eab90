"""Every benchmark command README.md, benchmarks/*.md and the benchmark scripts' docstrings show names a script,
flags and values it takes: a
`python -m benchmarks.<script> ...` (or torchrun's `-m benchmarks.<script>`) is parsed by the script's own argparse
parser, stopped right after parsing (nothing is built, timed or written); a `pytest benchmarks/<file>[::test]` names
a file and tests that exist. And each script answers --help with its usage and does nothing else."""
import argparse
import contextlib
import importlib
import io
import re
import runpy
import shlex
import signal
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.markdown_code import block_lines, inline_spans, line_of

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "benchmarks").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.py"))]
# The scripts with a command line, and the pytest suites (host_probe, common, e2e are libraries).
SCRIPTS = sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py") if "ArgumentParser(" in path.read_text())
SUITES = sorted(path.stem for path in (ROOT / "benchmarks").glob("bench_*.py")
                if re.search(r"^def test_", path.read_text(), flags=re.M))
# Values the docs write as placeholders, and what the parser gets instead; a `...` (more of the same) is dropped.
PLACEHOLDERS = {"P": "4", "A": "fastgrpo", "B": "trl", "S": "fastgrpo"}
# A docstring line that is a command (not prose that mentions one): an indented program, after VAR=value settings.
COMMAND_LINE = re.compile(r"^\s+(\w+=\S+\s+)*(python3?|torchrun)\s")
SHELL_SEPARATORS = {";", "&&", "||", "|", "&"}
# The docs showed 50 benchmark commands and the docstrings more; far fewer means the extractor broke, not the docs.
MIN_COMMANDS = 80


class Parsed(Exception):
    """Raised in place of running a script once its parser has accepted the command line."""


def doc_lines(path: Path) -> list[tuple[int, str]]:
    """A markdown file's ```bash lines and `code` spans; a script's docstring lines (its usage) and spans."""
    text = path.read_text()
    if path.suffix == ".py":
        text = '"""'.join(text.split('"""')[:2])  # the docstring, which opens each script's first line
        usage = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if COMMAND_LINE.match(line)]
        return usage + [(n, span) for n, _, span in inline_spans(text)]
    return block_lines(text) + [(n, span) for n, _, span in inline_spans(text)]


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line: its words split at ; && || | &."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands = [[]]
    for word in lexer:
        commands.append([]) if word in SHELL_SEPARATORS else commands[-1].append(word)
    return [words for words in commands if words]


def benchmark_command(words: list[str]) -> tuple[str, list[str]] | None:
    """('benchmarks.<script>', its argv) or ('pytest', its argv) where `words` run a benchmark, else None."""
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1].startswith("benchmarks."):
            return words[i + 1], words[i + 2:]
        if word == "-m" and words[i + 1] == "pytest" and any(w.startswith("benchmarks/") for w in words[i + 2:]):
            return "pytest", words[i + 2:]
    return None


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def doc_commands(path: Path) -> list[tuple[str, str, list[str]]]:
    """(where, program, argv) of each benchmark command `path` shows; a span cut off by the docs' quoting is skipped."""
    found = []
    for n, line in doc_lines(path):
        if "benchmarks" not in line:
            continue
        try:  # a list the docs wrap after a comma (`--variants a,b,` / `c`) comes back as `a,b, c`
            commands = shell_commands(line.replace(", ", ","))
        except ValueError:  # an unbalanced quote: prose, not a command
            continue
        found += [(f"{shown(path)}:{n}", *command) for words in commands
                  if (command := benchmark_command(words))]
    return found


def with_placeholders(argv: list[str]) -> list[str]:
    """`...` dropped, also as a list's last item (`--variants a,b,...`); an optional part's brackets (`[--top 5]`)
    dropped; placeholder words replaced."""
    argv = [re.sub(r",\.\.\.$", "", word.removeprefix("[").removesuffix("]")) for word in argv if word != "..."]
    return [PLACEHOLDERS.get(word, word) for word in argv]


def script_error(module: str, argv: list[str]) -> str | None:
    """None where `module`'s parser accepts `argv` (--help included), else the parser's last line."""
    if "ArgumentParser(" not in (ROOT / (module.replace(".", "/") + ".py")).read_text():
        return "no argparse parser: calling its main() would run it"
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        parse_args(parser, args, namespace)
        raise Parsed

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            mock.patch.object(sys, "argv", [module, *argv]), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            importlib.import_module(module).main()
        except Parsed:
            return None
        except SystemExit as stop:
            if not stop.code:
                return None
            return (err.getvalue().strip().splitlines() or [f"exit {stop.code}"])[-1]
    return "its main() returned without parsing a command line"


def pytest_error(argv: list[str]) -> str | None:
    """None where each `benchmarks/...` path of `argv` exists and each ::test it names is defined in its file."""
    for target in (word for word in argv if word.startswith("benchmarks/")):
        path, *tests = target.split("::")
        if not (ROOT / path).is_file():
            return f"no file {path}"
        source = (ROOT / path).read_text()
        missing = [name for name in tests if not re.search(rf"^\s*def {re.escape(name.split('[')[0])}\(", source,
                                                           flags=re.M)]
        if missing:
            return f"{path} has no test {', '.join(missing)}"
    return None


def command_error(program: str, argv: list[str]) -> str | None:
    argv = with_placeholders(argv)
    if program == "pytest":
        return pytest_error(argv)
    if not (ROOT / (program.replace(".", "/") + ".py")).is_file():
        return f"no script {program}"
    return script_error(program, argv)


def bad_commands(paths: list[Path]) -> list[str]:
    return [f"{where}: `{program} {shlex.join(argv)}`: {error}" for path in paths
            for where, program, argv in doc_commands(path) if (error := command_error(program, argv))]


def test_doc_benchmark_commands_parse():
    commands = [command for path in DOCS for command in doc_commands(path)]
    assert len(commands) >= MIN_COMMANDS, f"only {len(commands)} benchmark commands found in {len(DOCS)} docs"
    bad = bad_commands(DOCS)
    assert not bad, "benchmark commands the scripts refuse:\n" + "\n".join(bad)


@pytest.mark.parametrize("old, new, named", [
    ("python -m benchmarks.bench_loop --gpus 0,1", "python -m benchmarks.bench_loop --gpsu 0,1", "--gpsu"),
    ("python -m pytest benchmarks/bench_sft.py", "python -m pytest benchmarks/bench_sfft.py", "bench_sfft.py"),
    ("python -m benchmarks.profile_rollout --shapes", "python -m benchmarks.profile_rolout --shapes",
     "profile_rolout"),
])
def test_a_wrong_benchmark_command_is_named_with_its_line(old, new, named, tmp_path):
    text = DOCS[0].read_text()
    assert old in text, f"README.md no longer has {old!r}: pick another place to break"
    broken = tmp_path / "README.md"
    broken.write_text(text.replace(old, new, 1))
    bad = [line for line in bad_commands([broken]) if named in line]
    assert len(bad) == 1, bad
    assert f"README.md:{line_of(broken.read_text(), broken.read_text().index(new))}: `" in bad[0], bad


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_answers_help_and_does_nothing_else(script, capsys):
    """--help prints the usage and exits 0 before anything runs (report.py and loop_targets.py rewrote the results
    files instead)."""
    with mock.patch.object(sys, "argv", [script, "--help"]), pytest.raises(SystemExit) as done:
        importlib.import_module(f"benchmarks.{script}").main()
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: another script imported it
@pytest.mark.parametrize("suite", SUITES)
def test_a_pytest_suite_run_as_a_script_says_how_to_run_it(suite):
    """`python -m benchmarks.bench_e2e --help` ran nothing and exited 0, silently."""
    with mock.patch.object(sys, "argv", [suite, "--help"]), pytest.raises(SystemExit) as done:
        runpy.run_module(f"benchmarks.{suite}", run_name="__main__")
    assert done.value.code == f"benchmarks/{suite}.py is a pytest suite, not a script: run python -m pytest " \
                              f"benchmarks/{suite}.py -q -s"


# The scripts that time on a GPU (bench_multigpu has its own CPU mode, FASTGRPO_BENCH_CPU=1).
GPU_SCRIPTS = sorted(set(SCRIPTS) - {"loop_targets", "report", "trace_gaps", "bench_multigpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA answers")
@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_a_gpu_benchmark_without_cuda_says_so_in_one_line(script, tmp_path, monkeypatch, capsys):
    """They failed on their first CUDA tensor with a traceback (profile_rollout wrote rollout_profile-cpu.json)."""
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with mock.patch.object(sys, "argv", [script]), pytest.raises(SystemExit) as done:
        importlib.import_module(f"benchmarks.{script}").main()
    # bench_loop installed its stop handlers first, and they outlived the call: a later test's SIGINT met them
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    said = str(done.value.code) if isinstance(done.value.code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert "needs a CUDA GPU (torch.cuda.is_available() is False)" in said
    assert not list(tmp_path.iterdir())


def test_bench_multigpu_refuses_a_rows_file_that_is_not_there(tmp_path, monkeypatch, capsys):
    """A misspelt --summarize path: the parser's one line naming the flag, and no results file (it wrote one of no
    rows, which on the same card pushes the suite's real rows down into earlier_runs)."""
    from benchmarks import bench_multigpu, common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    argv = ["bench_multigpu", "--summarize", str(tmp_path / "rows.jsnol"), "--suite", "multigpu_mb16"]
    with mock.patch.object(sys, "argv", argv), pytest.raises(SystemExit) as done:
        bench_multigpu.main()
    assert done.value.code == 2
    assert "--summarize: expected the rows file that --case launches appended to" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_dry_run_times_one_call_after_one_warm_up():
    """Off CUDA kernel_us runs the call twice, not four times: bench_decode_attention's dry run took over 5 minutes
    on 2 CPU cores, its interpreted calls seconds each."""
    from benchmarks.common import kernel_us

    ran = []
    assert kernel_us([lambda: ran.append("first copy"), lambda: ran.append("second copy")], "cpu") >= 0
    assert ran == ["first copy", "first copy"]
