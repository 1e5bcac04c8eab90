"""How a GRPO step hands its completions to the reward functions and their scores to the advantages, against TRL 1.16's
GRPOTrainer._calculate_rewards / _generate_and_score_completions: each completion gets its own row's prompt and
columns (rows repeated num_generations times, grouped by prompt), its own token ids, the step's trainer_state; the
weights apply to their own function; None is left out of the weighted sum (nansum) and a row no function scored is
left out of the statistics. Each test kills mutants of fastgrpo/rewards and fastgrpo/train/step_rewards.py that the
rest of the suite let pass (a mutation audit)."""
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.loss.grpo import reward_advantages
from fastgrpo.rewards.scoring import RewardError, nan_sample_std, zero_spread_fraction
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.step_rewards import per_function_metrics, score_groups

G = 3
DATASET = [{"prompt": f"p{i}", "answer": f"a{i}", "level": i} for i in range(4)]
INDICES = [2, 0]  # this step's rows, not in dataset order
TEXTS = [f"c{k}" for k in range(len(INDICES) * G)]


def _batch() -> dict:
    """[prompt | completion] ids of the 6 completions, a different number of completion tokens each, padded."""
    ids = torch.arange(6 * 5).view(6, 5) + 100
    mask = torch.zeros(6, 5, dtype=torch.long)
    for k in range(6):
        mask[k, 2:2 + 1 + k % 3] = 1  # 1, 2 or 3 completion tokens after a 2-token prompt
    return {"texts": TEXTS, "input_ids": ids, "completion_mask": mask}


def _score(funcs, weights, step=4, **fields):
    config = GRPOConfig(num_generations=G, batch_size=len(INDICES) * G, micro_batch_size=len(INDICES) * G,
                        max_steps=9, output_dir="unused", **fields)
    return score_groups(funcs, torch.tensor(weights, dtype=torch.float64), DATASET, INDICES, _batch(), config,
                        Distributed(), step)


def test_each_completion_gets_its_own_rows_prompt_columns_and_ids():
    """Rows repeated G times each (TRL's RepeatSampler groups a prompt's completions): repeating the list G times
    instead handed completion 1 the second row's answer; the padding of a completion's ids is not its tokens."""
    seen = {}

    def spy(prompts, completions, answer, level, completion_ids, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, level=level, ids=completion_ids,
                    step=(trainer_state.global_step, trainer_state.max_steps))
        return [1.0] * len(completions)

    _score([spy], [1.0])
    assert seen["prompts"] == ["p2"] * G + ["p0"] * G and seen["completions"] == TEXTS
    assert seen["answer"] == ["a2"] * G + ["a0"] * G and seen["level"] == [2] * G + [0] * G
    batch = _batch()
    assert seen["ids"] == [batch["input_ids"][k, 2:3 + k % 3].tolist() for k in range(6)]
    assert seen["step"] == (4, 9)  # optimizer steps done before this one, as TRL's self.state


def test_a_failing_row_is_named_by_its_dataset_row_and_completion():
    def picky(prompts, completions, **kwargs):
        if "c3" in completions:  # the second row's first completion
            raise KeyError("c3")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"on dataset row 0 \(completion 1 of 3\): 'c3'"):
        _score([picky], [1.0])


def test_weights_apply_to_their_own_function_and_none_is_left_out():
    """TRL: rewards = (rewards_per_func * reward_weights).nansum(dim=1), NaN where every function returned None."""
    def first(prompts, completions, **kwargs):
        return [1.0, None, 3.0, None, 5.0, 6.0]

    def second(prompts, completions, **kwargs):
        return [10.0, 20.0, None, None, float("nan"), 60.0]

    per_func, rewards, failures, _ = _score([first, second], [2.0, -0.5])
    assert not failures and per_func.isnan().sum() == 5
    expected = [2 - 5, -10, 6, math.nan, 10, 12 - 30]
    assert rewards.tolist()[:3] + rewards.tolist()[4:] == expected[:3] + expected[4:] and math.isnan(rewards[3])


def test_a_bad_value_is_the_functions_failure_even_when_skipped():
    """reward_errors="skip" trains on, scoring the bad rows 0, but the failure is reported (the step's
    reward_errors metric), not trained through silently."""
    def half_text(prompts, completions, **kwargs):
        return [1.0, "0.5", 1.0, 1.0, 1.0, 1.0]

    def too_many(prompts, completions, **kwargs):
        return [1.0] * (len(completions) + 1)

    per_func, _, failures, _ = _score([half_text, too_many], [1.0, 1.0], reward_errors="skip")
    assert set(failures) == {"half_text", "too_many"} and failures["half_text"].row == 1
    assert failures["too_many"] == "returned 7 rewards for 6 completions"
    assert per_func[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0] and per_func[:, 1].abs().sum() == 0


def test_normalize_then_sum_leaves_an_unscored_row_out_as_trl():
    """TRL (multi_objective_aggregation="normalize_then_sum"): a row no function scored is NaN before the batch's
    mean and std, then advantage 0; as 0 (nansum's) it moved the batch mean and std of every other row."""
    nan = math.nan
    per_func = torch.tensor([[1.0, 2.0], [0.0, nan], [3.0, 1.0], [nan, nan], [2.0, 5.0], [1.0, 0.0]],
                            dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    grouped = per_func.view(-1, 2, 2)  # groups of 2
    mean = grouped.nanmean(1, keepdim=True)
    count = (~grouped.isnan()).sum(1, keepdim=True)
    std = (((grouped - mean) ** 2).nansum(1, keepdim=True) / (count - 1)).sqrt()
    summed = (((grouped - mean) / (std + 1e-4)).view(-1, 2) * weights).nansum(1)
    summed[3] = nan
    kept = summed[~summed.isnan()]
    expected = ((summed - kept.mean()) / (kept.std() + 1e-4)).nan_to_num(0.0)
    got = reward_advantages(per_func, weights, 2, "group", 1e-4, "normalize_then_sum")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert got[3] == 0.0


def test_reward_std_and_zero_spread_metrics():
    """reward_std: Bessel's std of the scored rewards (TRL's nanstd), None (TRL's NaN, logged as null) for fewer than
    two; frac_reward_zero_std: the share of groups with no spread, a group none of whose rows was scored counting as
    one (it carries no signal)."""
    nan = math.nan
    assert nan_sample_std(torch.tensor([1.0, nan, 3.0, 5.0], dtype=torch.float64)) == pytest.approx(2.0, rel=1e-12)
    grouped = torch.tensor([[1.0, 1.0], [nan, nan], [0.0, 2.0], [nan, 4.0]], dtype=torch.float64)
    assert zero_spread_fraction(grouped) == 0.75


def test_each_functions_mean_and_std_are_trls_over_the_rows_it_scored():
    """rewards/<name>/std: TRL 1.16's nanstd of the function's column, Bessel's std of the scored rows (a population
    std would be 1.63 here), None for fewer than two scored (TRL's NaN, logged as null), unweighted."""
    nan = math.nan
    per_func = torch.tensor([[1.0, nan, nan], [3.0, 2.0, nan], [5.0, nan, nan], [nan, nan, nan]], dtype=torch.float64)
    assert per_function_metrics(per_func, ["a", "one", "none"]) == {
        "rewards/a": 3.0, "rewards/a/std": pytest.approx(2.0, rel=1e-12), "rewards/one": 2.0, "rewards/one/std": None,
        "rewards/none": None, "rewards/none/std": None}


# a function's column of scores: up to 16 rows, None (NaN) or a multiple of 1/4 (exact in fp64, as 0/1 rewards are)
COLUMNS = st.lists(st.one_of(st.none(), st.integers(-32, 32).map(lambda n: n / 4)), min_size=1, max_size=16)


@given(COLUMNS)
def test_each_functions_std_is_trls_nanstd(column):
    """Against TRL 1.16's own nanstd (trl.trainer.utils), which its GRPOTrainer logs as rewards/<name>/std: None
    exactly where TRL's is NaN (fewer than two scored), else equal within TRL's rounding. TRL's Bessel factor
    count / (count - 1) divides int64 tensors, so it is fp32 (relative error <= 2^-24, halved by the sqrt); the fp64
    sums of n <= 16 exact scores add n u = 4e-15 (equal scores: exactly 0, their mean exact). The mean: torch's
    nanmean, both fp64."""
    utils = pytest.importorskip("trl.trainer.utils", reason="TRL is not installed (pip install -e '.[dev]')")
    values = torch.tensor([math.nan if v is None else v for v in column], dtype=torch.float64)
    got = per_function_metrics(values[:, None], ["f"])
    std, mean = utils.nanstd(values).item(), torch.nanmean(values).item()
    if math.isnan(std):
        assert got["rewards/f/std"] is None
    else:
        assert got["rewards/f/std"] == pytest.approx(std, rel=2.0**-24, abs=0.0), (got, std)
    assert got["rewards/f"] is None if math.isnan(mean) else got["rewards/f"] == pytest.approx(mean, rel=1e-14)


def test_a_steps_reward_metrics_are_trls():
    """One step with reward_weights [2, 0.5]: rewards/<name> and rewards/<name>/std are the function's own mean and
    std over the rows it scored (TRL's nanmean and nanstd of rewards_per_func, unweighted); reward and reward_std are
    over the weighted sums of the rows some function scored (TRL: the unscorable rows NaN). Weights that did not
    reach the step, a weighted rewards/<name>, or an unscored row counted as 0 passed the suite."""
    from fastgrpo.train import default_task
    from fastgrpo.train.trainer import GRPOTrainer

    calls = []

    def varied(prompts, completions, **kwargs):  # every row but the batch's last, a different score each
        calls.append([len(c) + 1.0 + k for k, c in enumerate(completions)])
        return calls[-1][:-1] + [None]

    def first_only(prompts, completions, **kwargs):
        return [1.0] + [None] * (len(completions) - 1)

    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 4, "num_generations": 2, "micro_batch_size": 4,
                           "max_completion_length": 2, "max_steps": 1, "export": False, "progress_bar": False,
                           "logging_steps": 0, "output_dir": "unused", "reward_weights": [2.0, 0.5]})
    tokenizer = default_task.build_tokenizer()
    trainer = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, [varied, first_only],
                          default_task.build_dataset(4), config)
    metrics = trainer.train_step()
    scored = torch.tensor(calls[0][:-1], dtype=torch.float64)
    weighted = 2.0 * scored
    weighted[0] += 0.5
    assert metrics["rewards/varied"] == pytest.approx(scored.mean().item(), rel=1e-12)
    assert metrics["rewards/varied/std"] == pytest.approx(scored.std().item(), rel=1e-12)
    assert metrics["rewards/first_only"] == 1.0 and metrics["rewards/first_only/std"] is None
    assert metrics["reward"] == pytest.approx(weighted.mean().item(), rel=1e-12)
    assert metrics["reward_std"] == pytest.approx(weighted.std().item(), rel=1e-12, abs=1e-12)


def _first_only(prompts, completions, **kwargs):  # the batch's first completion scored, no other
    return [1.0] + [None] * (len(completions) - 1)


def test_the_reward_std_of_one_scored_reward_is_trls_null(tmp_path):
    """A step (an ei round) where one completion alone was scored: reward_std None, TRL 1.16's nanstd of one value
    (NaN, which its log() writes null), as rewards/<name>/std; it was 0.0, a spread measured as none. metrics.jsonl
    stays JSON (no NaN)."""
    from trl.trainer import utils

    from fastgrpo.train import default_task
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.expert_iteration import ExpertIteration
    from fastgrpo.train.trainer import GRPOTrainer

    assert math.isnan(utils.nanstd(torch.tensor([1.0, math.nan], dtype=torch.float64)).item())
    tokenizer = default_task.build_tokenizer()
    small = {"batch_size": 4, "num_generations": 2, "micro_batch_size": 4, "max_completion_length": 2,
             "export": False, "progress_bar": False, "logging_steps": 0, "output_dir": str(tmp_path)}
    grpo = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, [_first_only], default_task.build_dataset(4),
                       GRPOConfig(**{**default_task.PRESET, **small, "max_steps": 1}))
    ei = ExpertIteration(default_task.build_model(tokenizer), tokenizer, [_first_only], default_task.build_dataset(4),
                         EIConfig(**{**default_task.EI_PRESET, **small, "questions_per_step": 2, "sft_epochs": 1,
                                         "prompt_format": "raw"}))
    for metrics in (grpo.train_step(), ei.run_round()):
        assert (metrics["reward"], metrics["reward_std"], metrics["rewards/_first_only/std"]) == (1.0, None, None)
        assert json.loads(json.dumps(metrics, allow_nan=False))["reward_std"] is None


ROWS = [{"prompt": f"{i} say {x}", "letter": x} for i, x in enumerate("abcd")]  # each row its own letter


def _by_row(prompts, completions, letter, **kwargs):
    """1.0 for a completion whose prompt asks for its row's letter (the column aligned with the prompt), 1 + its
    length otherwise: never equal."""
    return [1.0 if prompt.endswith(f"say {x}") else 1.0 + len(c) for prompt, c, x in zip(prompts, completions, letter)]


def _longer(prompts, completions, **kwargs):
    return [len(c) + 1.0 for c in completions]


def test_eval_weighs_its_rewards_and_aligns_its_columns():
    """`fastgrpo eval --reward-weights`: each sample's reward is the weighted sum of its functions' (as train's);
    each completion gets its own row's columns."""
    from fastgrpo.rollout import BuiltinEngine, SamplingParams
    from fastgrpo.train import default_task
    from fastgrpo.train.evaluate import build_eval_task, evaluate

    tokenizer = default_task.build_tokenizer()
    rows = ROWS[:3]
    task = build_eval_task(rows, tokenizer, prompt_column="prompt", prompt_format="raw",
                           reward_funcs=[_by_row, _longer], reward_weights=[2.0, -0.5])
    records, _ = evaluate(BuiltinEngine(default_task.build_model(tokenizer), tokenizer), tokenizer, task,
                          SamplingParams(max_new_tokens=2), num_generations=2, batch_size=3)
    assert [r["rewards/_by_row"] for r in records] == [1.0] * 6
    assert [r["reward"] for r in records] == [2.0 - 0.5 * (len(r["completion"]) + 1) for r in records]


def test_ei_weighs_its_rewards_and_aligns_its_columns(tmp_path):
    """`fastgrpo ei --reward-weights`: a round's rewards (and so what it keeps) are the weighted sums; each
    completion gets its own row's columns; rewards/<name>/std is each function's own (unweighted) std, as train's."""
    from fastgrpo.train import default_task
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.expert_iteration import ExpertIteration

    scored = []

    def varied(prompts, completions, **kwargs):  # weight 0: its spread is logged, nothing else
        scored.extend(len(c) + 1.0 + k for k, c in enumerate(completions))
        return scored[-len(completions):]

    tokenizer = default_task.build_tokenizer()
    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 2,
                         "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "sft_epochs": 1,
                         "reward_weights": [3.0, 0.0], "correct_threshold": 3.0, "output_dir": str(tmp_path)})
    run = ExpertIteration(default_task.build_model(tokenizer), tokenizer, [_by_row, varied],
                          ROWS, config)
    metrics = run.run_round()
    assert metrics["rewards/_by_row"] == 1.0 and metrics["reward"] == 3.0 and metrics["kept_frac"] == 1.0
    assert metrics["rewards/_by_row/std"] == 0.0 and metrics["rewards/varied/std"] == pytest.approx(
        torch.tensor(scored, dtype=torch.float64).std().item(), rel=1e-12)


def test_a_function_gets_only_the_keywords_it_takes():
    """f(prompts, completions, answer), written before fastgrpo passed TRL's completion_ids, trainer_state and
    logging hooks, gets none of them (a TypeError otherwise); one with **kwargs gets them all."""
    from fastgrpo.rewards import score

    def strict(prompts, completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    def takes_all(prompts, completions, **kwargs):
        return [float(sorted(kwargs) == ["answer", "completion_ids", "log_extra", "log_metric", "trainer_state"])]

    per_func, failures = score([strict, takes_all], ["p"], ["1"], {"answer": ["1"]}, completion_ids=[[5]],
                               trainer_state=object())
    assert not failures and per_func.tolist() == [[1.0, 1.0]]


def test_the_row_a_function_raised_on_is_found_with_that_rows_columns_and_ids():
    """Called row by row to find where it raised, the function gets each row's own column values and ids."""
    from fastgrpo.rewards.scoring import check_failures, score

    def lookup(prompts, completions, allowed, completion_ids, **kwargs):
        return [{a: 1.0}[c] + ids[0] for c, a, ids in zip(completions, allowed, completion_ids)]

    args = (["p"] * 3, ["a", "b", "x"], {"allowed": ["a", "b", "c"]})
    ids = [[0], [1], []]  # the third row's ids are empty: row 2 raises on them too
    _, failures = score([lookup], *args, completion_ids=ids)
    with pytest.raises(RewardError, match=r"lookup raised KeyError: 'x' .* on row 2: 'x'"):
        check_failures(failures, [lookup], *args, on_error="raise", completion_ids=ids)
    ids = [[0], [], [2]]  # now the second row's ids raise, alone
    _, failures = score([lookup], *args[:2], {"allowed": ["a", "b", "x"]}, completion_ids=ids)
    with pytest.raises(RewardError, match=r"lookup raised IndexError: .* on row 1: 'b'"):
        check_failures(failures, [lookup], *args[:2], {"allowed": ["a", "b", "x"]}, on_error="raise",
                       completion_ids=ids)
