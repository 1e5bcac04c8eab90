"""`fastgrpo sft`, `fastgrpo ei` and `fastgrpo eval`: their flags, built-in presets and runs, as rows of
fastgrpo.train.cli.COMMANDS (run under its one-line errors: a ValueError is bad input, exit 2); `fastgrpo export`'s
flags and config too (fastgrpo.train.export_command runs it).

Precedence, as for `fastgrpo train`: dataclass defaults < the built-in presets (no --model: the tiny model's
settings; no --dataset: the built-in task's reward and prompt format) < YAML file (--config) < command-line flags;
eval of a --checkpoint, or of a run's exported final/ (--model), takes the run's prompt format and stop strings over
the presets (with both, the checkpoint's run: its weights are the ones evaluated).
Heavy modules (transformers, the trainers) are imported inside the run functions, so `fastgrpo --help` stays quick.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path

from fastgrpo.train import default_task
from fastgrpo.train.coercion import coerced
from fastgrpo.train.config import GRPOConfig, run_control_fields
from fastgrpo.train.config_flags import add_config_arguments
from fastgrpo.train.config_file import add_config_file_argument, check_record_output_dir, check_relative_paths
from fastgrpo.train.console import change, number, run_files
from fastgrpo.train.cuda_memory import use_expandable_segments
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.export_config import ExportConfig
from fastgrpo.train.input_checks import check_reward_count
from fastgrpo.train.memory_options import check_fsdp_applies
from fastgrpo.train.naming import setting
from fastgrpo.train.process_agreement import check_same_settings
from fastgrpo.train.ranks import process_count
from fastgrpo.train.resume_before_load import (
    check_base_before_load, check_export_before_load, check_resume_before_load, finished_at, finished_sft,
)
from fastgrpo.train.resumed_settings import resumed_run_settings
from fastgrpo.train.setting_sources import DATA_PRESET, MODEL_PRESET, SettingSources, from_file, record_sources
from fastgrpo.train.sft_config import SFTConfig

logger = logging.getLogger(__name__)

CONFIGS = {"train": GRPOConfig, "sft": SFTConfig, "ei": EIConfig, "eval": EvalConfig, "export": ExportConfig}
MODEL_PRESETS = {"train": default_task.PRESET, "sft": default_task.SFT_PRESET, "ei": default_task.EI_PRESET,
                 "eval": default_task.EVAL_PRESET}

SFT_HELP = "supervised fine-tuning on prompt/response rows (loss on the response tokens)"
EI_HELP = "expert iteration: sample, keep the correct completions, fine-tune on them, repeat"
EVAL_HELP = "evaluate a model or checkpoint with the rollout engine: per-example JSONL and a summary"


def description(name: str) -> str:
    config = CONFIGS[name].__name__
    checkpoint = " (and without a --checkpoint of a run on a real model)" if name == "eval" else ""
    resume = f" {resume_note(CONFIGS[name])}" if name in ("sft", "ei") else ""
    return (f"Every {config} field is a flag; flags override the YAML file given with --config. Without --model"
            f"{checkpoint}, the built-in tiny model's settings replace some defaults (each flag's help says so); "
            f"without --dataset, the built-in task is used.{resume}")


def resume_note(config_class: type) -> str:
    """What a resumable command's --help says of --resume: the settings it takes anew (run_control_fields)."""
    return ("--resume continues the newest complete checkpoint in --output-dir; these settings may change on resume, "
            "every other one must match the checkpoint's (or pass --resume-allow-changes): "
            f"{', '.join(run_control_fields(config_class))}. Of these, one that no flag and no config file sets keeps "
            "the run's value, except device and export.")


def _add_arguments(name: str):
    def add(parser: argparse.ArgumentParser) -> None:
        defaults = CONFIGS[name]()
        notes = {k: default_task.MICRO_BATCH_NOTE.format(v) if k == "micro_batch_size" else
                 f"{v} for the built-in model" for k, v in MODEL_PRESETS.get(name, {}).items()
                 if k == "micro_batch_size" or v != getattr(defaults, k)}  # no "32; 32 for the built-in model"
        notes.update({k: f"{v} without --dataset" for k, v in default_task.BUILTIN_DATA.get(name, {}).items()})
        add_config_file_argument(parser, CONFIGS[name].__name__)
        add_config_arguments(parser, CONFIGS[name], notes=notes)

    return add


add_sft_arguments, add_ei_arguments, add_eval_arguments, add_export_arguments = (
    _add_arguments(n) for n in ("sft", "ei", "eval", "export"))


def config_from_args(name: str, args: argparse.Namespace):
    """defaults < built-in presets (no --model: the tiny model's settings; no --dataset: its reward) < (eval
    --checkpoint) the run's prompt settings < (--resume) the run's run-control settings < YAML < flags, as a
    CONFIGS[name]."""
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "debug", "argv")}
    file = CONFIGS[name].file_settings(args.config)
    check_relative_paths(file, flags, args.config)
    if name in ("train", "sft", "ei"):  # a copied run's record names the original run as output_dir
        check_record_output_dir(file, flags, args.config)
    merged = coerced(CONFIGS[name], {**file, **flags})  # typed: YAML's `none`, "16", ~/ as a flag's
    run, source = trained_by(merged) if name == "eval" else (None, "")
    if run is not None:
        _check_rows_named(run, merged, source)
    # a run that trained the built-in model (its config names none) evaluates with the tiny model's presets, whether
    # eval loads it from a --checkpoint (with or without a --model path for its base) or from its final/ (64 positions
    # leave no room for the default 1024 new tokens)
    builtin_model = run.get("model") is None if run is not None else merged.get("model") is None
    model_preset = dict(MODEL_PRESETS.get(name, {})) if builtin_model else {}  # export has no presets
    data_preset = dict(default_task.BUILTIN_DATA.get(name, {})) if merged.get("dataset") is None else {}
    preset = {**model_preset, **data_preset}
    processes = process_count()  # under torchrun each process runs a share of a step's rows
    # model and dataset, which the presets depend on, are no run-control settings: a resume takes neither
    resumed = resumed_run_settings(CONFIGS[name], merged, preset, processes)
    merged = {**coerced(CONFIGS[name], resumed), **merged}
    from_run = _prompt_settings(run, merged, source) if run is not None else {}
    sources = SettingSources(CONFIGS[name], (model_preset, MODEL_PRESET), (data_preset, DATA_PRESET),
                             (from_run, f"from {source}"), (resumed, None),
                             (file, from_file(args.config) if file else None),
                             (flags, None))
    record_sources(sources)

    with sources.naming():
        config = CONFIGS[name].from_dict({**default_task.fit_micro_batch(preset, merged, processes),
                                          **from_run, **merged})
        check_fsdp_applies(config, resumed)  # train, sft, ei (eval has no fsdp_* fields)
        check_reward_count(config)  # train, ei, eval: before any data loads
    if model_preset:  # the tiny model: a second CPU thread only waits on busy cores
        default_task.use_one_cpu_thread(config.device)
    if name in ("train", "sft", "ei"):  # eval takes the run's format itself (_prompt_settings); export prompts nothing
        warn_prompt_format_unlike_export(config, merged)
        _warn_eval_dataset_unused(config)
    return config


def _check_rows_named(run: dict, merged: dict, source: str) -> None:
    """eval without --dataset evaluates on the built-in task's held-out rows: of weights whose run trained on its own
    data that measured a task they never saw (accuracy ~0, no word said). Refused unless a flag or YAML names the rows
    (--dataset none: the built-in ones)."""
    if run.get("dataset") is None or "dataset" in merged:
        return
    held_out = f" (its eval_dataset: {setting('dataset', run['eval_dataset'])})" if run.get("eval_dataset") else ""
    raise ValueError(f"dataset: {source} trained on {run['dataset']}, and eval without {setting('dataset')} "
                     f"evaluates on the built-in task's rows; pass the rows to evaluate on{held_out}, or "
                     f"{setting('dataset', 'none')} for the built-in task's")


def _warn_eval_dataset_unused(config) -> None:
    """An eval_dataset with eval_steps 0 (the default) is never read: said, as TRL users set eval_dataset alone."""
    if config.eval_dataset is not None and not config.eval_steps:
        unit = "rounds" if config.COMMAND == "ei" else "steps"
        logger.warning("eval_dataset: %s is not evaluated on, as eval_steps is 0 (off); pass %s to evaluate every N "
                       "%s", config.eval_dataset, setting("eval_steps", "N"), unit)


def warn_prompt_format_unlike_export(config, merged: dict) -> None:
    """A run from another run's export (--model run/final) whose prompt format no flag or YAML file sets takes its
    command's default, and those differ (train: raw, sft: auto, ei: r1_zero): sft -> train -> ei with the defaults
    prompted a model in a format it never saw. Said, naming both; the built-in rows (no dataset) have their own."""
    from fastgrpo.train.final_export import read_exported_run_config

    if config.model is None or config.dataset is None or "prompt_format" in merged:
        return
    try:
        trained = (read_exported_run_config(config.model) or {}).get("prompt_format")
    except ValueError:  # a damaged record, which eval refuses: a warning has nothing to go on, and stops no run
        return
    if trained is not None and trained != config.prompt_format:
        logger.warning("prompt_format: %s was trained on %r prompts (its run_config.json), and this run prompts in "
                       "%r, the default: pass %s to prompt it as it learned, or %s to keep this", config.model,
                       trained, config.prompt_format, setting("prompt_format", trained),
                       setting("prompt_format", config.prompt_format))


def trained_by(merged: dict) -> tuple[dict | None, str]:
    """(config, description) of the run that trained the weights eval evaluates: a --checkpoint's run (its weights
    are loaded last, over a --model given as its base), or the run that exported a --model folder (its
    run_config.json: export_model); (None, "") for any other model. `fastgrpo export` calls it for its refusals of a
    --model beside its --checkpoint."""
    from fastgrpo.train.checkpoint import STATE_FILE, read_run_config
    from fastgrpo.train.final_export import read_exported_run_config
    from fastgrpo.train.loading import find_checkpoint

    model = merged.get("model")
    # a checkpoint holds a run_config.json too: it is no export, and not a model transformers can load
    if model is not None and (Path(model) / STATE_FILE).is_file():
        raise ValueError(f"model: {model} is a run's checkpoint, not a model folder: pass it as --checkpoint")
    exported = read_exported_run_config(model) if model is not None else None
    if merged.get("checkpoint") is None:
        return exported, f"the run that exported {model}"
    checkpoint = find_checkpoint(merged["checkpoint"])
    run = read_run_config(checkpoint)
    if exported is not None:
        _check_export_as_base(model, exported, checkpoint, run)
    return run, "the checkpoint's run"


def _check_export_as_base(model: str, exported: dict, checkpoint: Path, run: dict) -> None:
    """--model, a run's export, as the base model of --checkpoint (whose run's settings apply: its weights are the
    ones evaluated). The export of the checkpoint's own LoRA run has the adapter merged in already: refused, since
    loading the checkpoint's adapter over it applies it twice. Another run's export that the checkpoint's run did not
    record as its base is said, in one line."""
    own = exported == run or Path(model).resolve() == checkpoint.resolve().parent / "final"
    if own and run.get("lora_rank", 0) > 0:
        raise ValueError(f"model: {model} is the export of the run of {checkpoint}, its LoRA adapter merged in: the "
                         f"checkpoint's adapter loaded over it would apply twice; evaluate one of them ("
                         f"{setting('model')} {model}, or {setting('checkpoint')} {checkpoint})")
    base = run.get("model")
    if not own and (base is None or Path(base).resolve() != Path(model).resolve()):
        logger.warning("model: %s is the export of another run than %s's: the weights evaluated are the "
                       "checkpoint's, loaded over it as the base model, with the prompt settings of the checkpoint's "
                       "run", model, checkpoint)


# what eval takes from the run that trained its model unless YAML or a flag sets it: the model learned to answer
# prompts in that format and to stop at those strings; a differently wrapped prompt would measure something else
RUN_PROMPT_SETTINGS = ("prompt_format", "stop")


def _prompt_settings(run: dict, merged: dict, source: str) -> dict:
    """The run's RUN_PROMPT_SETTINGS that neither YAML nor a flag gives, said in the log."""
    taken = {k: run[k] for k in RUN_PROMPT_SETTINGS if run.get(k) is not None and k not in merged}
    if taken:
        said = ", ".join(f"{k} {v!r}" for k, v in taken.items())
        logger.info("%s as %s trained (a flag or the YAML file overrides)", said, source)
    return taken


def _check_sources(config) -> None:
    from fastgrpo.train.dataset_source import check_local_dataset_sources
    from fastgrpo.train.sources import check_model_source, resolve_device

    resolve_device(config.device)
    check_local_dataset_sources(config)  # a mistyped data path: before the model's Hub request and its tokenizer
    if config.model is not None:
        check_model_source(config.model)


def check_checkpoint_base(checkpoint: Path, model: str | None) -> None:
    """The base model a checkpoint's weights load over, before anything loads: without `model` (its new path), the
    one its run recorded is still where the run found it (a moved folder failed inside transformers, 'Repo id must
    be in the form ...', not naming --model); either way, it is the one its run trained on, or another base named as
    `model`, which a warning says (check_base_unchanged)."""
    from fastgrpo.train.base_fingerprint import check_base_unchanged
    from fastgrpo.train.checkpoint import read_run_config
    from fastgrpo.train.sources import check_model_source

    run = read_run_config(checkpoint)
    base = run.get("model")
    if model is None and base is not None:  # None: the built-in model
        try:
            check_model_source(base)
        except ValueError as err:
            raise ValueError(f"{err} (the base model of {checkpoint}'s run): pass its new path as "
                             f"{setting('model')}") from None
    check_base_unchanged(run, checkpoint, model)


def join_processes(config):
    """The Distributed of this process. Under torchrun: joins its process group (collectives wait config.ddp_timeout
    seconds) and takes this rank's GPU (init_distributed), then checks that every process resolved the same settings.
    A DeepSpeed launch (accelerate's) is refused first. Call after use_expandable_segments: under NCCL the check's
    all-gather allocates CUDA memory."""
    from fastgrpo.train.process_group import check_launcher, init_distributed

    check_launcher(config.COMMAND)
    dist = init_distributed(config.device, config.ddp_timeout)
    check_same_settings(dist, config)
    return dist


def _load_model(config, tokenizer):
    from fastgrpo.train.loading import load_model_and_tokenizer
    from fastgrpo.train.sources import naming_the_model

    with naming_the_model(config.model):
        model, _ = load_model_and_tokenizer(config, tokenizer)
    return model


def _train(config, dist, finished, tokenizer, make_trainer, args) -> list[dict]:
    """Lock the output folder (rank 0, under torchrun), check a resume against the checkpoint, say there is nothing
    to train when the resumed run is finished (finished(): finished_run's line, or None), else check final/ can take
    the export, load the model (its tokenizer: the one the command loaded), build and run the trainer."""
    import torch

    from fastgrpo.offload import OffloadMemoryError
    from fastgrpo.train.errors import RunError
    from fastgrpo.train.interrupts import Interrupted, resume_command, start_over_command

    with dist.run_directory(config.output_dir) as run_dir:
        run_dir.prepare(resume=config.resume, overwrite=config.overwrite_output_dir, command=config.COMMAND)
        check_resume_before_load(config)
        nothing_to_do = finished()
        if nothing_to_do is not None:
            if dist.is_main:
                print(f"fastgrpo {config.COMMAND}: {nothing_to_do}")
            return []
        check_base_before_load(config)
        check_export_before_load(config, dist)
        torch.manual_seed(config.seed)  # LoRA's initialization
        trainer = make_trainer(_load_model(config, tokenizer))
        try:
            return trainer.train(run_dir)
        except Interrupted as stop:
            stop.how_to_resume = f"`{resume_command(args.argv)}`"
            stop.how_to_restart = "run the same command again"
            stop.how_to_start_over = f"`{start_over_command(args.argv)}`"
            raise
        except OffloadMemoryError as err:  # the pool's max_bytes is this run's offload_host_memory_gib
            raise RunError(f"{err} [max_bytes: --offload-host-memory-gib]") from err


def run_sft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from fastgrpo.train.early_checks import check_sft_rows_before_load
    from fastgrpo.train.input_checks import check_lengths_before_load
    from fastgrpo.train.loading import load_run_datasets, tokenizer_before_load
    from fastgrpo.train.sft import SFTTrainer, check_process_split

    config = config_from_args("sft", args)
    use_expandable_segments()  # before the first CUDA allocation
    _check_sources(config)
    dist = join_processes(config)
    check_process_split(config, dist.world_size)
    check_lengths_before_load(config)  # against the model's config.json, before its tokenizer loads
    tokenizer = tokenizer_before_load(config.model)  # once: every check and the trainer take it
    # read once: the trainer takes them
    rows, evaluated = load_run_datasets(config, tokenizer, lambda: default_task.build_sft_dataset(seed=config.seed))
    examples = check_sft_rows_before_load(config, rows, tokenizer)  # tokenized once: the trainer takes them
    history = _train(config, dist, lambda: finished_sft(config, len(rows)), tokenizer,
                     lambda model: SFTTrainer(model, tokenizer, rows, config, examples=examples, eval_rows=evaluated),
                     args)
    if history and dist.is_main:
        first, last = history[0], history[-1]
        print(f"{change('loss', first, last, fmt='{:.4f}')}; {run_files(config.output_dir, config.export)}")
    return 0


def run_ei(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from fastgrpo.train.early_checks import check_sampling_before_load
    from fastgrpo.train.expert_iteration import ExpertIteration, check_process_split
    from fastgrpo.train.input_checks import check_lengths_before_load
    from fastgrpo.train.loading import load_run_datasets, resolve_reward, tokenizer_before_load
    from fastgrpo.train.naming import setting

    config = config_from_args("ei", args)
    use_expandable_segments()  # before the first CUDA allocation
    _check_sources(config)
    dist = join_processes(config)
    check_process_split(config, dist.world_size)
    reward_funcs = [resolve_reward(name) for name in config.reward_funcs]
    check_lengths_before_load(config)  # against the model's config.json, before its tokenizer loads
    tokenizer = tokenizer_before_load(config.model)  # once: every check and the trainer take it
    # read once: the trainer takes them; the built-in rows: the GRPO task's
    rows, evaluated = load_run_datasets(config, tokenizer)
    prompt_ids = check_sampling_before_load(config, rows, reward_funcs, tokenizer)
    history = _train(config, dist,
                     lambda: finished_at(config, config.ei_steps, "round", setting("ei_steps", config.ei_steps),
                                          "ei_steps"),
                     tokenizer,
                     lambda model: ExpertIteration(model, tokenizer, reward_funcs, rows, config, prompt_ids=prompt_ids,
                                                   eval_rows=evaluated),
                     args)
    if history and dist.is_main:
        first, last = history[0], history[-1]
        print(f"{change('reward', first, last, unit='round')}, {change('kept_frac', first, last, unit='round')}; "
              f"{run_files(config.output_dir, config.export)}")
    return 0


def run_eval(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from fastgrpo.rollout import BuiltinEngine
    from fastgrpo.train.early_checks import eval_task_before_load
    from fastgrpo.train.eval_model import evaluated_model
    from fastgrpo.train.evaluate import evaluate, log_generations, logged_metrics, write_eval
    from fastgrpo.train.interrupts import stop_if_interrupted
    from fastgrpo.train.loading import find_checkpoint, load_dataset, resolve_reward, tokenizer_before_load
    from fastgrpo.train.start_line import log_start

    config = config_from_args("eval", args)
    use_expandable_segments()  # before the first CUDA allocation
    _check_sources(config)
    dist = join_processes(config)  # under torchrun each process evaluates every N-th row
    reward_funcs = [resolve_reward(name) for name in config.reward_funcs]
    checkpoint = find_checkpoint(config.checkpoint) if config.checkpoint is not None else None
    if checkpoint is not None:
        check_checkpoint_base(checkpoint, config.model)  # before its tokenizer loads
    # once: every check and the evaluation take it (a --checkpoint's without --model: its run's model's)
    tokenizer = tokenizer_before_load(evaluated_model(config.model, checkpoint))
    rows = load_dataset(config, lambda: default_task.build_held_out_dataset(num_rows=config.max_examples or 64,
                                                                            seed=config.seed), tokenizer)
    task = eval_task_before_load(config, rows, reward_funcs, checkpoint, tokenizer)  # rows' and lengths' errors
    output = Path(config.output_dir)
    with _eval_directory(dist, output, config) as run_dir:
        torch.manual_seed(config.seed)
        # every process loads the whole model; a failure on one (a GPU out of memory) stops them all
        model, source = dist.raise_together(lambda: _load_eval(config, checkpoint, task, tokenizer))
        _check_one_checkpoint(dist, source)
        stop_if_interrupted()  # a Ctrl-C a library swallowed as the model loaded (evaluate checks after each batch)
        if dist.is_main:
            log_start("evaluating", model, next(model.parameters()).device, dist.world_size,
                      f"{len(task.rows)} examples x {config.num_generations} completion(s) (up to "
                      f"{config.max_new_tokens} tokens)", trains=False)
        records, summary = evaluate(BuiltinEngine(model, tokenizer), tokenizer, task, config.sampling(),
                                    stop=config.stop_strings, num_generations=config.num_generations,
                                    seed=config.seed, batch_size=config.batch_size,
                                    reward_errors=config.reward_errors, dist=dist)
        summary = {**summary, **source, "dataset": config.dataset, "config": config.to_dict()}
        if dist.is_main:
            written = (output / "results.jsonl", output / "summary.json")
            write_eval(records, summary, *written)
            run_dir.replace_previous(written)  # --overwrite-output-dir: the previous results stayed until now
    if not dist.is_main:
        return 0
    log_generations(records, config.log_generations, "sample")
    rates = "" if summary["format_rate"] is None else (f", format {summary['format_rate']:.3f}, "
                                                       f"answer {summary['answer_rate']:.3f}")
    best_of = f", pass@{config.num_generations} {summary[f'pass@{config.num_generations}']:.3f}" \
        if config.num_generations > 1 else ""
    logged = "".join(f", {name} {number(value)}" for name, value in logged_metrics(summary).items())  # log_metric's
    print(f"accuracy {summary['accuracy']:.3f}{best_of}, reward {number(summary['reward'])}{rates}{logged} over "
          f"{summary['num_samples']} completions; {output / 'results.jsonl'}, {output / 'summary.json'}")
    return 0


@contextlib.contextmanager
def _eval_directory(dist, output: Path, config):
    """Rank 0 locks and prepares `fastgrpo eval`'s output folder, and yields its RunDirectory; the other processes
    wait, raise its refusal, and get None. Another evaluation's files there are refused (or, overwritten, kept until
    the new results replace them: RunDirectory.replace_previous); a train run's folder may take its results, its
    checkpoint-<step>/ and final/ may not (RunDirectory)."""
    from fastgrpo.train.run_dir import EVAL_ARTIFACTS, RunDirectory

    with contextlib.ExitStack() as stack:
        def prepare() -> RunDirectory | None:
            if not dist.is_main:
                return None
            run_dir = stack.enter_context(RunDirectory(output, artifacts=EVAL_ARTIFACTS, resumable=False))
            # command: a refusal names the files an evaluation's results, not "another run"
            run_dir.prepare(resume=False, overwrite=config.overwrite_output_dir, command=config.COMMAND,
                            replace_at_end=True)
            return run_dir

        yield dist.raise_together(prepare)


def _load_eval(config, checkpoint: Path | None, task, tokenizer):
    """(model, source) of `fastgrpo eval`: the model evaluated (tokenizer: its, as the command loaded it), with room
    for task's prompts and max_new_tokens in its positions."""
    from fastgrpo.train.eval_model import load_evaluated_model
    from fastgrpo.train.evaluate import check_positions
    from fastgrpo.train.input_checks import model_positions
    from fastgrpo.train.prompts import as_wrapped
    from fastgrpo.train.sources import naming_the_model

    with naming_the_model(config.model):
        model, source = load_evaluated_model(config, checkpoint, tokenizer)
    positions = model_positions(model)
    if positions is not None:
        check_positions(task.prompt_ids, positions, config.max_new_tokens, "max_new_tokens", "dataset",
                        as_wrapped(config.prompt_format))
    return model, source


def _check_one_checkpoint(dist, source: dict) -> None:
    """Under torchrun, refuse an evaluation whose processes loaded different checkpoints (a run still training
    deleted the one named as they loaded it: load_evaluated_model took its newest), which would mix their results."""
    from fastgrpo.train.ranks import raised_on_every_process

    loaded = sorted({str(found["checkpoint"]) for found in dist.gather_objects(source)})
    if len(loaded) > 1:
        raise raised_on_every_process(ValueError(
            f"checkpoint: torchrun's processes loaded different checkpoints ({', '.join(loaded)}) as their run "
            "deleted older ones (--save-total-limit); pass one checkpoint that stays"))
