"""Evaluation with the rollout engine: generate for each row's prompt, score, write per-example JSONL + a summary.

`evaluate` is the one code path of `fastgrpo eval` and of the periodic evaluation inside `train`, `sft` and `ei`
(`PeriodicEval`, every --eval-steps). With the `r1_zero_math` reward alone (the default of `eval`) each example
also gets the course's split: format_reward (the `</think> <answer> ... </answer>` shape) and answer_reward (that
shape with the right answer; the reward is the answer reward). Other rewards leave those two fields null.
A completion counts as correct when its (weighted) reward is >= correct_threshold; accuracy is the correct fraction.
With several completions per prompt the summary has pass@k too (pass_at_k), and with several reward functions the
mean of each (rewards/<name>, as in train's metrics). What the reward functions log with TRL's log_metric is in the
summary under its own name, the mean over the whole evaluation (fastgrpo.rewards.reward_logs); a name the summary
takes (summary_names) stops the evaluation at the batch that logs it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from fastgrpo.loss.grpo import weighted_rewards
from fastgrpo.rewards import r1_zero_math_reward
from fastgrpo.rewards.answers import r1_zero_grades
from fastgrpo.rewards.reward_logs import RewardLogs, TakenNames, merged_means
from fastgrpo.rewards.scoring import RewardError, nan_mean, reward_names, score, traceback_of, warn_unscored
from fastgrpo.rollout import RolloutEngine, SamplingParams
from fastgrpo.rollout.base import accepts_prompt_keys
from fastgrpo.train.atomic_folder import fsync_path
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.input_checks import check_reward_rows, check_reward_setup
from fastgrpo.train.interrupts import stop_if_interrupted
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import as_wrapped, prompt_ids
from fastgrpo.train.run_dir import partial_write, write_beside
from fastgrpo.train.step_rewards import add_logged_metrics, completion_id_lists, metric_names, refuse_taken
from fastgrpo.train.step_rewards import trainer_state as default_trainer_state
from fastgrpo.train.versions import library_versions

logger = logging.getLogger(__name__)
# what PeriodicEval ("step") and `fastgrpo eval` (the model's source, the dataset, the config) add to a summary
SUMMARY_ADDED = ("step", "model", "checkpoint", "dataset", "config")
# the summary's own fields (summarize, then evaluate's settings); pass@k are taken by their prefix
SUMMARY_FIELDS = ("num_examples", "num_samples", "accuracy", "reward", "format_rate", "answer_rate",
                  "completion_length", "completion_length_correct", "completion_length_wrong", "completion_length_max",
                  "truncated_frac", "reward_funcs", "reward_errors", "seconds", "tokens_per_s", "sampling", "versions",
                  "date")


def summary_names(reward_names: Sequence[str]) -> TakenNames:
    """The names an evaluation's summary takes (with rewards/<name> of each of `reward_names`): a reward function's
    log_metric may take none of them, in `fastgrpo eval` or in a periodic evaluation of a run."""
    return metric_names((*SUMMARY_FIELDS, *SUMMARY_ADDED), reward_names) | TakenNames(prefixes=("pass@",))


def logged_metrics(summary: dict) -> dict:
    """What the reward functions logged with log_metric in an evaluation's summary: {name: mean}, in name order."""
    taken = summary_names(summary["reward_funcs"])
    return {name: value for name, value in summary.items() if name not in taken}


@dataclasses.dataclass
class EvalTask:
    """Rows to evaluate on (reward functions read their columns), each with its prompt's token ids."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    prompt_column: str
    reward_funcs: list[Callable]
    reward_weights: list[float] | None = None
    correct_threshold: float = 1.0

    @property
    def splits_r1_zero(self) -> bool:
        return self.reward_funcs == [r1_zero_math_reward]


def first_rows(rows, max_examples: int) -> list:
    """The rows an evaluation samples: the first max_examples (0: all), as a list."""
    if max_examples < 0:
        raise ValueError(f"max_examples: expected >= 0 (0: every row), got {max_examples}")
    count = 0 if rows is None else min(len(rows), max_examples) if max_examples else len(rows)
    return [rows[i] for i in range(count)]


def build_eval_task(rows, tokenizer, *, prompt_column: str, prompt_format: str, reward_funcs: Sequence[Callable],
                    reward_weights: Sequence[float] | None = None, correct_threshold: float = 1.0,
                    max_examples: int = 0, max_prompt_length: int | None = None,
                    max_positions: int | None = None, max_new_tokens: int = 0,
                    new_tokens_field: str = "max_new_tokens", field: str = "eval_dataset") -> EvalTask:
    """The first max_examples rows (0: all) with their prompt ids; `field` names the dataset in errors. A prompt
    over max_prompt_length, or prompts that max_new_tokens more would take past the model's max_positions
    (input_checks.model_positions), are refused here, naming the row and the config field of max_new_tokens, before
    anything is generated."""
    check_reward_setup(reward_funcs, reward_weights)
    rows = first_rows(rows, max_examples)
    check_reward_rows(rows, prompt_column, reward_funcs, field)
    ids = []
    wrapped = as_wrapped(prompt_format)
    for i, row in enumerate(rows):
        try:
            ids.append(prompt_ids(tokenizer, row[prompt_column], prompt_format))
        except ValueError as err:
            raise ValueError(f"{field}: row {i}: {err}") from None
        n = len(ids[-1])
        if max_prompt_length is not None and n > max_prompt_length:
            raise ValueError(f"{field}: row {i} has a {n}-token prompt{wrapped}, over max_prompt_length "
                             f"({max_prompt_length})")
    if max_positions is not None:
        check_positions(ids, max_positions, max_new_tokens, new_tokens_field, field, wrapped)
    return EvalTask(rows, ids, prompt_column, list(reward_funcs), reward_weights and list(reward_weights),
                    correct_threshold)


def check_positions(ids: list[list[int]], max_positions: int, max_new_tokens: int, new_tokens_field: str,
                     field: str, wrapped: str) -> None:
    """Refuse prompts that max_new_tokens more would take past max_positions: the error names the longest prompt's
    row and the largest max_new_tokens that leaves room for every prompt."""
    i = max(range(len(ids)), key=lambda k: len(ids[k]))
    n = len(ids[i])
    if n + max_new_tokens <= max_positions:
        return
    room = max_positions - n
    fix = f"or lower {setting(new_tokens_field)} to {room} or less" if room > 0 else \
        "(it leaves no position for a new token)"
    raise ValueError(f"{field}: row {i} has a {n}-token prompt{wrapped}; with {max_new_tokens} new tokens that is "
                     f"{n + max_new_tokens} positions, over the model's max_position_embeddings ({max_positions}): "
                     f"shorten the prompts {fix}")


def check_reward_failures(failures: dict, reward_errors: str, *, warn: bool = True) -> None:
    """What a command does with score()'s failures: "raise" stops with a RewardError naming the first failing
    function; "skip" logs each (their failed samples scored 0) when warn (False: another process logs them)."""
    if not failures:
        return
    if reward_errors == "skip":
        if warn:
            for name, failure in failures.items():
                logger.warning("reward function %s failed; its failed samples score 0: %s", name, failure)
        return
    name, failure = next(iter(failures.items()))
    raise RewardError(f"reward function {name} {failure}{getattr(failure, 'raised_at', '')}; "  # merged: plain text
                      f"{setting('reward_errors', 'skip')} scores such rows 0 instead") from traceback_of(failure)


def evaluate(engine: RolloutEngine, tokenizer, task: EvalTask, sampling: SamplingParams, *, stop=None,
             num_generations: int = 1, seed: int = 0, batch_size: int = 64, reward_errors: str = "raise",
             dist: Distributed | None = None, trainer_state=None) -> tuple[list[dict], dict]:
    """Generate num_generations completions per row, batch_size prompts per engine call; (records, summary).
    reward_errors: see check_reward_failures; the summary counts the failures of each function either way.
    trainer_state: what reward functions get as `trainer_state` (a run's progress; default: step 0 of 0).
    dist: under torchrun, the processes' group: each process generates and scores every world_size-th row (its
    samples keyed by the row's position, so they are the ones one process draws); rank 0 gathers and returns the
    whole evaluation, in row order, and logs the rewards' warnings of it; the others return ([], {}) (rank 0 alone
    writes and reports it). A failure on any process raises on all."""
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1 prompts per rollout call, got {batch_size}")
    dist = dist or Distributed()
    names = reward_names(task.reward_funcs)
    t0 = time.perf_counter()
    positions = list(range(dist.rank, len(task.rows), dist.world_size))
    # fewer rows than processes: one left without a row evaluates row 0 and drops it, as under FSDP2 every process
    # must run the model (a backward prefetches by the forwards each process saw: one without them hung the next)
    padded = not positions and len(task.rows) > 0
    trainer_state = trainer_state if trainer_state is not None else default_trainer_state()
    share = dist.raise_together(lambda: _evaluate_rows(engine, tokenizer, task, sampling, [0] if padded else positions,
                                                       stop=stop, num_generations=num_generations, seed=seed,
                                                       batch_size=batch_size, reward_errors=reward_errors,
                                                       trainer_state=trainer_state))
    shares = dist.gather_on_main(([], {}, ({}, {})) if padded else share)  # only rank 0 writes and logs it
    if shares is None:  # not rank 0
        return [], {}
    records = sorted((r for own, _, _ in shares for r in own), key=lambda r: (r["index"], r["sample"]))
    errors = _merged_errors([errors for _, errors, _ in shares])
    _warn_of_rewards(records, errors, reward_errors, num_generations)
    seconds, tokens = time.perf_counter() - t0, sum(r["length"] for r in records)
    settings = {"sampling": {**dataclasses.asdict(sampling), "num_generations": num_generations, "seed": seed,
                             "stop": stop},
                "versions": library_versions(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    summary = {**summarize(records, names, errors, seconds, tokens), **settings}
    logged = merged_means([logged for _, _, logged in shares])  # each under its own name, as in a training step's
    return records, add_logged_metrics(summary, logged, summary_names(names))


def _evaluate_rows(engine: RolloutEngine, tokenizer, task: EvalTask, sampling: SamplingParams, positions: list[int],
                   *, stop, num_generations: int, seed: int, batch_size: int,
                   reward_errors: str, trainer_state) -> tuple[list[dict], dict, tuple[dict, dict]]:
    """(records, {function name: its last failure's message}, (values, sources) of what the reward functions logged:
    RewardLogs) of the rows at `positions`, batch_size per call."""
    names = reward_names(task.reward_funcs)
    weights = torch.tensor(task.reward_weights or [1.0] * len(names), dtype=torch.float64)
    records, errors, logs = [], {}, RewardLogs(taken=summary_names(names))
    keyed = accepts_prompt_keys(engine)
    engine.reacquire_memory()
    for start in range(0, len(positions), batch_size):
        batch = positions[start:start + batch_size]
        rows, ids = [task.rows[i] for i in batch], [task.prompt_ids[i] for i in batch]
        # keyed by row: a row's samples do not depend on batch_size, on the rows beside it or on the process
        keys = {"prompt_keys": batch} if keyed else {}
        out = engine.generate(ids, num_generations=num_generations, sampling=sampling, stop=stop,
                              seed=seed if keyed else seed + batch[0], **keys)
        expanded = [row for row in rows for _ in range(num_generations)]
        prompt_texts = tokenizer.batch_decode(ids)  # what the model saw, chat template and special tokens included
        prompts = [row[task.prompt_column] for row in expanded]
        columns = {k: [row.get(k) for row in expanded] for k in rows[0] if k != task.prompt_column}
        per_func, failures = score(task.reward_funcs, prompts, out.texts, columns,  # per_func: [n, F]
                                   completion_ids=completion_id_lists(out.completion_ids, out.completion_mask),
                                   trainer_state=trainer_state, logs=logs)
        refuse_taken(logs)
        check_reward_failures(failures, reward_errors, warn=False)  # skipped: evaluate warns of the whole
        for name, failure in failures.items():
            errors[name] = str(failure)
        rewards = weighted_rewards(per_func, weights)  # rewards: [n]; NaN where no function applied
        rewards = [None if math.isnan(r) else r for r in rewards.tolist()]  # null in the JSON
        lengths = out.completion_mask.sum(-1).tolist()
        for k, (row, text) in enumerate(zip(expanded, out.texts)):
            grades = r1_zero_grades(text, row["answer"]) if task.splits_r1_zero else (None, None)
            record = {
                "index": batch[k // num_generations], "sample": k % num_generations,
                "prompt": prompt_texts[k // num_generations], "completion": text,
                "format_reward": grades[0], "answer_reward": grades[1], "reward": rewards[k],
                "correct": rewards[k] is not None and rewards[k] >= task.correct_threshold, "length": int(lengths[k]),
                "finish_reason": out.finish_reasons[k],
            }
            if len(names) > 1:
                record.update({f"rewards/{name}": nan_mean(per_func[k, j]) for j, name in enumerate(names)})
            if "answer" in row:
                record["answer"] = row["answer"]
            records.append(record)
        stop_if_interrupted()  # `fastgrpo eval`: a Ctrl-C that a reward function or library swallowed in this batch
    engine.release_memory()
    return records, errors, (logs.values, logs.sources)


def _warn_of_rewards(records: list[dict], errors: dict, reward_errors: str, num_generations: int) -> None:
    """The rewards' warnings of a whole evaluation, once: each function's skipped failures, the unscored completions."""
    check_reward_failures(errors, reward_errors)
    rewards = torch.tensor([math.nan if r["reward"] is None else r["reward"] for r in records], dtype=torch.float64)
    warn_unscored(rewards, lambda k: f"row {records[k]['index']} (completion {records[k]['sample'] + 1} of "
                                     f"{num_generations})")


def _merged_errors(shares: list[dict]) -> dict:
    """The processes' {function name: failure message} as one: the first failing process's message, whose row counts
    are of its rows alone, so it says so and which processes failed too (one process: its message as is)."""
    failed_on: dict[str, list[tuple[int, str]]] = {}
    for rank, errors in enumerate(shares):
        for name, message in errors.items():
            failed_on.setdefault(name, []).append((rank, message))
    if len(shares) == 1:
        return {name: found[0][1] for name, found in failed_on.items()}
    merged = {}
    for name, ((rank, message), *others) in failed_on.items():
        also = f"; process{'es' if len(others) > 1 else ''} {', '.join(str(r) for r, _ in others)} failed too" \
            if others else ""
        merged[name] = f"{message} (in process {rank}'s rows{also})"
    return merged


def _mean(values):
    """The mean of the values that are not None (an unscored completion's reward); None when none are."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(records: list[dict], names: list[str], errors: dict, seconds: float, tokens: int) -> dict:
    """The summary of an evaluation's records: each number is recomputable from the per-example JSONL."""
    correct = [r for r in records if r["correct"]]
    wrong = [r for r in records if not r["correct"]]
    split = records[0]["format_reward"] is not None
    # means only (no rewards/<name>/std as train logs): the summary gives no number's spread, not even the reward's;
    # each sample's scores are in the records
    per_func = {f"rewards/{name}": _mean(r[f"rewards/{name}"] for r in records) for name in names} \
        if len(names) > 1 else {}
    return {
        "num_examples": len({r["index"] for r in records}),
        "num_samples": len(records),
        "accuracy": _mean(r["correct"] for r in records),
        **pass_at_k(records),
        "reward": _mean(r["reward"] for r in records),
        **per_func,
        "format_rate": _mean(r["format_reward"] for r in records) if split else None,
        "answer_rate": _mean(r["answer_reward"] for r in records) if split else None,
        "completion_length": _mean(r["length"] for r in records),
        "completion_length_correct": _mean(r["length"] for r in correct),
        "completion_length_wrong": _mean(r["length"] for r in wrong),
        "completion_length_max": max(r["length"] for r in records),
        "truncated_frac": _mean(r["finish_reason"] == "length" for r in records),
        "reward_funcs": names,
        "reward_errors": errors,
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
    }


def pass_at_k(records: list[dict]) -> dict:
    """pass@k for k = 1, 2, 4, ... and n, the samples per example, when n > 1 ({} for one sample: pass@1 is the
    accuracy): the unbiased estimator of Chen et al. 2021 (HumanEval), the chance that k of an example's n samples
    drawn without replacement hold a correct one, 1 - C(n - c, k) / C(n, k) with c correct, averaged over examples."""
    counts: dict[int, list[int]] = {}  # index: [samples, correct]
    for r in records:
        count = counts.setdefault(r["index"], [0, 0])
        count[0] += 1
        count[1] += bool(r["correct"])
    n = min(samples for samples, _ in counts.values())
    if n < 2:
        return {}
    ks = sorted({*(2 ** i for i in range(n.bit_length()) if 2 ** i < n), n})
    return {f"pass@{k}": sum(1 - math.comb(samples - c, k) / math.comb(samples, k) for samples, c in counts.values())
            / len(counts) for k in ks}


def write_eval(records: list[dict], summary: dict, examples_path: str | Path, summary_path: str | Path) -> None:
    """One JSON line per completion to examples_path; the summary as a JSON object to summary_path. Both are written
    in full beside their names and fsynced, then renamed over them, the summary last and a previous summary deleted
    before the results change: a kill leaves the previous files as they were, or the results without a summary, never
    cut-off results, nor one evaluation's results beside another's summary; a power loss once it returned, the new
    files. An error or an interrupt as they are written deletes the partial writes beside them."""
    examples_path, summary_path = Path(examples_path), Path(summary_path)
    texts = {examples_path: "".join(json.dumps(r) + "\n" for r in records),
             summary_path: json.dumps(summary, indent=2) + "\n"}
    try:
        for path, text in texts.items():
            write_beside(path, text)  # fsynced
        summary_path.unlink(missing_ok=True)
        for path in texts:
            os.replace(partial_write(path), path)
    finally:
        for path in texts:  # an interrupt's: what was written (or began to be) before it
            partial_write(path).unlink(missing_ok=True)
    for folder in {path.parent for path in texts}:  # the renames
        fsync_path(folder)


def log_generations(records: list[dict], count: int, title: str) -> None:
    """A few generations to the console log: the first `count` records, prompt tail and completion."""
    for r in records[:count]:
        logger.info("%s | ...%s -> %r | reward %.3f%s", title, r["prompt"][-60:], r["completion"][:200],
                    math.nan if r["reward"] is None else r["reward"],
                    "" if r["format_reward"] is None else f" (format {r['format_reward']:.0f}, "
                                                          f"answer {r['answer_reward']:.0f})")
