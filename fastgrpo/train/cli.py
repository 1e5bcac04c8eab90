"""`fastgrpo <command> ...` (also `python -m fastgrpo <command> ...`, e.g. under torchrun).

Commands are rows of COMMANDS: a name, its help, a function adding its flags and a function running it. main()
parses, finds the row and runs it under fastgrpo.train.errors.run_command, which turns every ending into one line
and an exit code (2: bad input, 1: the run could not go on, 130 / 143: SIGINT / SIGTERM, after a checkpoint where
a run loop took the signal); `--debug`, added to every command, shows tracebacks instead. To add a command, append a
Command whose `run` raises ValueError for bad input, and import what is heavy inside `run`.

`fastgrpo train [--config X.yaml] [--field value ...]` builds the model, data and rewards a config names and
trains. With neither --model nor --dataset it runs the built-in default (fastgrpo.train.default_task) on the CPU;
either one alone swaps in the user's model or data.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Callable

from fastgrpo.train import default_task
from fastgrpo.train.commands import (
    EI_HELP, EVAL_HELP, SFT_HELP, add_ei_arguments, add_eval_arguments, add_export_arguments, add_sft_arguments,
    config_from_args, description, join_processes, resume_note, run_ei, run_eval, run_sft,
)
from fastgrpo.train.coercion import BOOL_WORDS
from fastgrpo.train.command_fields import elsewhere, trl_counterpart, trl_without
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.config_flags import add_config_arguments
from fastgrpo.train.config_file import add_config_file_argument
from fastgrpo.train.console import change, run_files
from fastgrpo.train.errors import RunError, run_command
from fastgrpo.train.export_command import EXPORT_DESCRIPTION, EXPORT_HELP, run_export
from fastgrpo.train.interrupts import interrupted_while_starting, sigterm_as_ctrl_c, starting_signals
from fastgrpo.train.naming import flag
from fastgrpo.train.resume_before_load import (
    check_base_before_load, check_export_before_load, check_resume_before_load, finished_run,
)
from fastgrpo.train.setting_sources import naming_recorded_sources
from fastgrpo.train.versions import library_versions


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.ArgumentParser, argparse.Namespace], int]  # (its parser, parsed args) -> exit code
    description: str = ""


class _Version(argparse.Action):
    """--version: fastgrpo's version and those of the libraries it runs on (argparse's own action re-wraps it)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the versions and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from fastgrpo.train.ranks import is_main_process

        if is_main_process():  # under torchrun every process parses the same command line: rank 0 says it once
            found = library_versions()
            ours = found.pop("fastgrpo")
            print(f"fastgrpo {ours} ({', '.join(f'{name} {v}' for name, v in found.items())})")
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse with one line for bad input (a command's usage block runs to ~50 lines) and whole flag names only:
    an abbreviation accepted today could name another flag once one is added."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def print_help(self, file=None):
        from fastgrpo.train.ranks import is_main_process

        if is_main_process():  # --help: rank 0 prints it, the other processes of a torchrun launch exit 0 quietly
            super().print_help(file)

    def error(self, message):
        from fastgrpo.train.ranks import is_main_process, rank_0_ended

        # under torchrun every process parses the same command line: rank 0 says it once
        said = not is_main_process() and rank_0_ended()
        self.exit(2, None if said else f"{self.prog}: error: {message} (see {self.prog} --help)\n")


MAX_FLAGS_NAMED = 6  # in a hint for a flag several start with


def _unrecognized(extra: list[str], parser: argparse.ArgumentParser, command: str, argv: list[str]) -> str:
    """argparse's 'unrecognized arguments' naming, for each unknown flag, this command's counterpart of a TRL flag, the
    other command it belongs to (and this command's counterpart), the flags it starts (--reward: --reward-funcs, ...)
    or else the closest flag of the command; for a `true` after a true / false flag, that the flag takes none."""
    known = [option for action in parser._actions for option in action.option_strings  # argparse has no public list
             if option not in ("-h", "--help")]
    hints = []
    for arg in extra:
        name = arg.split("=")[0]
        hint = _bool_flags_value(arg, parser, argv) if not arg.startswith("--") else (
            _trl_flag(name, command) or _other_commands_flag(name, command) or _flags_starting(name, known)
            or _closest_flag(name, known))
        hints.append(f"{arg} ({hint})" if hint else arg)
    return "unrecognized arguments: " + " ".join(hints)


def _trl_flag(name: str, command: str) -> str | None:
    """"TRL's name; here --dtype bfloat16" for --bf16 (command_fields.TRL_NAMES, which YAML keys get too), in TRL's
    spelling (--use_peft) or ours (--use-peft); for a TRL_WITHOUT flag, why it needs none; None for another flag or
    one `command` has no counterpart of."""
    key = name[2:].replace("-", "_")
    found = trl_counterpart(key, command)
    if found is None:
        return trl_without(key, command)
    field, how = found
    if how.startswith(": "):  # "dtype: bfloat16" -> "--dtype bfloat16"
        how = f" {how[2:]}"
    elif how.startswith(" ("):  # a note: not in parentheses inside the hint's own
        how = f", {how[2:-1]}"
    return f"TRL's name; here {flag(field)}{how}"


def _bool_flags_value(arg: str, parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """"--export takes no value: --export turns it on, --no-export off" for the `true` of `--export true` (TRL's
    flags take one); None for another value."""
    if arg.lower() not in BOOL_WORDS:
        return None
    switches = {option: action.option_strings for action in parser._actions
                if isinstance(action, argparse.BooleanOptionalAction) for option in action.option_strings}
    before = next((previous for previous, this in zip(argv, argv[1:]) if this == arg and previous in switches), None)
    if before is None:
        return None
    on, off = switches[before]
    return f"{before} takes no value: {on} turns it on, {off} off"


def _flags_starting(name: str, known: list[str]) -> str | None:
    """"did you mean --reward-funcs, --reward-weights or --reward-errors?" for --reward, the first word of each (of
    more than MAX_FLAGS_NAMED, the first ones and how many)."""
    found = [f for f in known if f.startswith(f"{name}-")]
    if len(found) > MAX_FLAGS_NAMED:
        return f"one of the {len(found)} flags {name}-*: {', '.join(found[:MAX_FLAGS_NAMED - 1])}, ..."
    if len(found) > 1:
        return f"did you mean {', '.join(found[:-1])} or {found[-1]}?"
    return f"did you mean {found[0]}?" if found else None


def _closest_flag(name: str, known: list[str]) -> str | None:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return f"did you mean {close[0]}?" if close else None


def _other_commands_flag(name: str, command: str) -> str | None:
    """'a `fastgrpo train` / `fastgrpo sft` flag; ei counts rounds with --ei-steps' for --max-steps under ei (and
    for --no-X of a bool field); None for a flag no other command has, or a value."""
    if not name.startswith("--"):
        return None
    field = name[2:].replace("-", "_")
    return elsewhere(field, command, as_flag=True) or elsewhere(field.removeprefix("no_"), command, as_flag=True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fastgrpo", description="Memory-lean GRPO post-training.")
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)
    parser.command_parsers = {}
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.description or command.help)
        sub.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
        command.add_arguments(sub)
        parser.command_parsers[command.name] = sub
    return parser


def parse_command_line(argv: list[str]) -> tuple[Command, argparse.ArgumentParser, argparse.Namespace]:
    """The command `argv` names, its parser and the parsed flags; runs nothing (bad input exits 2 in one line)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)
    subparser = parser.command_parsers[command.name]
    if extra:
        subparser.error(_unrecognized(extra, subparser, command.name, argv))
    return command, subparser, args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, subparser, args = parse_command_line(argv)
    args.argv = argv  # for a command's "continue with ..." hint
    from fastgrpo.offload import OffloadMemoryError
    from fastgrpo.rewards.scoring import RewardError

    if not sys.stderr.isatty():  # HF's own bars (loading, writing shards) are one long line in a log file
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with starting_signals():
        return run_command(f"fastgrpo {command.name}", lambda: _naming_sources(args, command.run, subparser),
                           debug=args.debug, run_errors=(RewardError, OffloadMemoryError))


def _naming_sources(args: argparse.Namespace, run: Callable, parser: argparse.ArgumentParser) -> int:
    """run(parser, args), where a ValueError about a setting names where the value came from, as the command's
    config_from_args recorded it: `dtype (from run.yaml): expected one of [...], got 'bf16'`. An error after a Ctrl-C
    that a library swallowed (starting_signals) is the interrupt's doing (a half-imported module; a cut read, which
    transformers reports as an OSError): run_command says it as the interrupt, not as the error (--debug: its
    traceback). A SIGTERM outside a run loop's InterruptGuard (as the model loads; all of eval and export) stops the
    command as a Ctrl-C there does (sigterm_as_ctrl_c): one line, exit 143, the output folder's lock released."""
    try:
        with naming_recorded_sources(), sigterm_as_ctrl_c():
            return run(parser, args)
    except Exception as err:
        if interrupted_while_starting():
            raise KeyboardInterrupt from err
        raise


# ---- fastgrpo train ----
TRAIN_DESCRIPTION = (
    "Every GRPOConfig field is a flag; flags override the YAML file given with --config. Without --model, the "
    "built-in tiny model's settings (fastgrpo.train.default_task.PRESET) replace some defaults (each flag's help "
    f"says so); without --dataset, the built-in task and its reward are used. {resume_note(GRPOConfig)}"
)


def _preset_notes() -> dict[str, str]:
    defaults = GRPOConfig()
    notes = {name: f"{value} for the built-in model" for name, value in default_task.PRESET.items()
             if value != getattr(defaults, name)}
    notes["reward_funcs"] = f"{default_task.REWARD_FUNCS} without --dataset"
    notes["micro_batch_size"] = default_task.MICRO_BATCH_NOTE.format(default_task.PRESET["micro_batch_size"])
    return notes


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_file_argument(parser, "GRPOConfig")
    add_config_arguments(parser, GRPOConfig, notes=_preset_notes())


def run_train(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from fastgrpo.offload import OffloadMemoryError
    from fastgrpo.train.cuda_memory import use_expandable_segments
    from fastgrpo.train.interrupts import Interrupted, resume_command, start_over_command
    from fastgrpo.train.loading import (load_model_and_tokenizer, load_run_datasets, resolve_reward,
                                        tokenizer_before_load)
    from fastgrpo.train.dataset_source import check_local_dataset_sources
    from fastgrpo.train.early_checks import check_sampling_before_load
    from fastgrpo.train.input_checks import check_lengths_before_load
    from fastgrpo.train.sources import check_model_source, naming_the_model, resolve_device
    from fastgrpo.train.trainer import GRPOTrainer

    # Everything a user can get wrong is checked before the model loads.
    config = config_from_args("train", args)
    use_expandable_segments(config.rollout_engine)  # before the first CUDA allocation
    resolve_device(config.device)
    dist = join_processes(config)  # under torchrun: join its process group, take this rank's GPU
    check_local_dataset_sources(config)  # a mistyped data path: before the model's Hub request and its tokenizer
    if config.model is not None:
        check_model_source(config.model)
    reward_funcs = [resolve_reward(name) for name in config.reward_funcs]
    check_lengths_before_load(config)  # against the model's config.json, before its tokenizer loads
    tokenizer = tokenizer_before_load(config.model)  # once: every check, the model's load and the trainer take it
    dataset, eval_rows = load_run_datasets(config, tokenizer)  # read once: the trainer takes them
    prompt_ids = check_sampling_before_load(config, dataset, reward_funcs, tokenizer)
    if dist.active:
        dist.check_sizes(config)
    with dist.run_directory(config.output_dir) as run_dir:  # rank 0 locks and prepares it
        run_dir.prepare(resume=config.resume, overwrite=config.overwrite_output_dir, command=config.COMMAND)
        check_resume_before_load(config)
        nothing_to_do = finished_run(config)
        if nothing_to_do is not None:
            if dist.is_main:
                print(f"fastgrpo train: {nothing_to_do}")
            return 0
        check_base_before_load(config)
        check_export_before_load(config, dist)
        torch.manual_seed(config.seed)  # LoRA's initialization
        with naming_the_model(config.model):
            model, _ = load_model_and_tokenizer(config, tokenizer)
        trainer = GRPOTrainer(model, tokenizer, reward_funcs, dataset, config, prompt_ids=prompt_ids,
                              eval_rows=eval_rows)
        try:
            history = trainer.train(run_dir)
        except Interrupted as stop:
            stop.how_to_resume = f"`{resume_command(args.argv)}`"
            stop.how_to_restart = "run the same command again"
            stop.how_to_start_over = f"`{start_over_command(args.argv)}`"
            raise
        except OffloadMemoryError as err:  # the pool's max_bytes is this run's offload_host_memory_gib
            raise RunError(f"{err} [max_bytes: --offload-host-memory-gib]") from err
    if history and dist.is_main:
        first, last = history[0], history[-1]
        print(f"{change('reward', first, last)}; {run_files(config.output_dir, config.export)}")
    return 0


COMMANDS: list[Command] = [
    Command("train", "run GRPO training", add_train_arguments, run_train, TRAIN_DESCRIPTION),
    Command("sft", SFT_HELP, add_sft_arguments, run_sft, description("sft")),
    Command("ei", EI_HELP, add_ei_arguments, run_ei, description("ei")),
    Command("eval", EVAL_HELP, add_eval_arguments, run_eval, description("eval")),
    Command("export", EXPORT_HELP, add_export_arguments, run_export, EXPORT_DESCRIPTION),
]

if __name__ == "__main__":
    sys.exit(main())
