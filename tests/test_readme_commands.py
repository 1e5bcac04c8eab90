"""Every `fastgrpo ...` command line README.md shows (```bash blocks and inline `code` spans, `torchrun ... -m fastgrpo`
forms too) is accepted by the CLI's parser, and every `--flag` span of its usage sections is a flag some command has.
Parsing only (fastgrpo.train.cli.parse_command_line): nothing loads a model or trains."""
import contextlib
import fnmatch
import io
import re
import shlex
from pathlib import Path

import pytest

from fastgrpo.train.cli import COMMANDS, build_parser, parse_command_line
from tests.markdown_code import block_lines, command_start_line, inline_spans, line_of

README = Path(__file__).parents[1] / "README.md"

# The sections whose `--flag` spans are fastgrpo's; the benchmark sections quote their scripts' flags beside them.
FLAG_SECTIONS = ("Train", "Several GPUs", "SFT, expert iteration and evaluation", "Use the kernels in your own loop",
                 "Rollouts with vLLM")
# Flags those sections quote for another program, and the program.
OTHER_PROGRAMS_FLAGS = {"--case": "python -m benchmarks.bench_multigpu"}
# Values the README writes as placeholders, and what the parser gets instead (a `...` for more flags is dropped).
PLACEHOLDERS = {"N": "2"}
# README.md had 30 commands and 89 flag spans; far fewer means the extractor broke, not the README.
MIN_COMMANDS = 25
MIN_FLAG_SPANS = 70


def program_index(words: list[str]) -> int | None:
    """Where `fastgrpo` is the program: the first word, or the module of `-m` (python / torchrun)."""
    if words[:1] == ["fastgrpo"]:
        return 0
    return next((i for i in range(1, len(words)) if words[i] == "fastgrpo" and words[i - 1] == "-m"), None)


def is_command(line: str) -> bool:
    words = re.sub(r"(^|\s)#.*", "", line).split()
    index = program_index(words)
    return index is not None and index + 1 < len(words)  # a bare `python -m fastgrpo` names the program only


def readme_commands(text: str) -> list[tuple[int, str]]:
    found = block_lines(text) + [(n, span) for n, _, span in inline_spans(text)]
    return sorted((n, line) for n, line in found if is_command(line))


def with_placeholders(tokens: list[str]) -> list[str]:
    return [PLACEHOLDERS.get(token, token) for token in tokens if token != "..."]


def parse_error(argv: list[str]) -> str | None:
    """None where the CLI's parser accepts `argv` (--help and --version exit 0: accepted), else its error line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse_command_line(argv)
        except SystemExit as stop:
            if stop.code:
                return err.getvalue().strip() or f"exit {stop.code}"
    return None


def command_error(line: str) -> str | None:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as err:
        return f"shell quoting: {err}"
    return parse_error(with_placeholders(tokens[program_index(tokens) + 1:]))


def bad_commands(text: str) -> list[str]:
    return [f"README.md:{n}: `{line}`: {error}" for n, line in readme_commands(text) if (error := command_error(line))]


def flag_spans(text: str) -> list[tuple[int, str]]:
    """Spans of FLAG_SECTIONS that start with a flag: `--resume`, `--lora-rank N`, `--fsdp-*`; a ` | ` between
    values (`--prompt-format raw | chat | r1_zero`) reads as one value."""
    return [(n, re.sub(r"\s*\|\s*", "|", span)) for n, section, span in inline_spans(text)
            if section in FLAG_SECTIONS and span.startswith("--")]


def command_flags() -> dict[str, set[str]]:
    parsers = build_parser().command_parsers
    return {name: {flag for action in sub._actions for flag in action.option_strings}  # argparse has no public list
            for name, sub in parsers.items()}


def flag_span_error(span: str, flags: dict[str, set[str]]) -> str | None:
    """None where each flag of `span` is some command's and one command that has its first flag parses the span."""
    tokens = span.split()
    names = [token for token in tokens if token.startswith("--")]
    if names[0] in OTHER_PROGRAMS_FLAGS:
        return None
    known = set().union(*flags.values())
    unknown = [name for name in names if not any(fnmatch.fnmatchcase(flag, name) for flag in known)]
    if unknown:
        return f"no fastgrpo command has {', '.join(unknown)}"
    if len(tokens) == 1 or "*" in span:  # a lone flag, or a family of them (`--fsdp-*`): no value to parse
        return None
    errors = [parse_error([name, *with_placeholders(tokens)]) for name, has in flags.items() if names[0] in has]
    return None if None in errors else errors[0]


def bad_flag_spans(text: str) -> list[str]:
    flags = command_flags()
    return [f"README.md:{n}: `{span}`: {error}" for n, span in flag_spans(text)
            if (error := flag_span_error(span, flags))]


def test_readme_commands_parse():
    text = README.read_text()
    commands = readme_commands(text)
    assert len(commands) >= MIN_COMMANDS, f"only {len(commands)} `fastgrpo ...` commands found in README.md"
    tokens = [shlex.split(line, comments=True) for _, line in commands]
    shown = {words[program_index(words) + 1] for words in tokens}
    assert {command.name for command in COMMANDS} <= shown, f"README.md shows commands {sorted(shown)} only"
    bad = bad_commands(text)
    assert not bad, "README.md commands the CLI refuses:\n" + "\n".join(bad)


def test_readme_flag_spans_are_fastgrpo_flags():
    text = README.read_text()
    sections = {section for _, section, _ in inline_spans(text)}
    assert set(FLAG_SECTIONS) <= sections, f"README.md has no section {sorted(set(FLAG_SECTIONS) - sections)}"
    spans = flag_spans(text)
    assert len(spans) >= MIN_FLAG_SPANS, f"only {len(spans)} `--flag` spans found in README.md's {FLAG_SECTIONS}"
    bad = bad_flag_spans(text)
    assert not bad, "README.md flags no fastgrpo command takes:\n" + "\n".join(bad)


@pytest.mark.parametrize("old, new, named", [
    ("--max-completion-length 1024", "--max-completion-lenght 1024", "--max-completion-lenght"),  # a continued line
    ("--beta 0.04", "--learning-rat 3e-6 --beta 0.04", "--learning-rat"),
    ("-m fastgrpo train ", "-m fastgrpo trian ", "trian"),  # torchrun, in a ```bash block
    ("`fastgrpo train --rollout-correction", "`fastgrpo train --rollout-corection", "--rollout-corection"),  # inline
    ("`torchrun --nproc_per_node N -m fastgrpo ei", "`torchrun --nproc_per_node N -m fastgrpo ei --ei-step 2",
     "--ei-step"),
    ("fastgrpo eval --model run/final", "fastgrpo evaluate --model run/final", "evaluate"),
    ("--max-seq-length 4096", "--max-seq-length 4k", "4k"),  # an int flag's value
])
def test_a_wrong_readme_command_is_named_with_its_line(old, new, named):
    _check_named(old, new, named, bad_commands, command_start_line)


def _check_named(old: str, new: str, named: str, find_bad, line_at) -> None:
    """README's text with `old` replaced by `new`: find_bad reports exactly one line, naming `named`, at the line
    line_at gives for the change."""
    text = README.read_text()
    assert old in text, f"README.md no longer has {old!r}: pick another place to break"
    broken = text.replace(old, new, 1)
    bad = find_bad(broken)
    assert len(bad) == 1 and named in bad[0], bad
    assert bad[0].startswith(f"README.md:{line_at(broken, broken.index(new))}: `"), bad


@pytest.mark.parametrize("old, new, named", [
    ("`--resume-allow-changes`", "`--resume-allow-change`", "--resume-allow-change"),
    ("`--fsdp-*`", "`--fdsp-*`", "--fdsp-*"),  # a family of flags
    ("`--lora-rank N`", "`--lora-rnk N`", "--lora-rnk"),
    ("`--vllm-execution`", "`--vllm-executor`", "--vllm-executor"),
    ("`--truncate-prompts`", "`--truncate-prompts 5`", "5"),  # a switch given a value
    ("`--offload-host-memory-gib N`", "`--offload-host-memory-gib lots`", "lots"),  # a float flag's value
])
def test_a_wrong_readme_flag_is_named_with_its_line(old, new, named):
    _check_named(old, new, named, bad_flag_spans, line_of)
