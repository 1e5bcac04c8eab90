"""GRPOTrainer: bad input rejected before compute, advantages and LR schedule against hand math, gradient
accumulation equal to one big batch, failing rewards survived, and the logged metrics."""
import json
import logging
import math

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.grpo_data import step_rows
from fastgrpo.loss.grpo import group_advantages
from fastgrpo.train.optim import lr_factor
from fastgrpo.train.prompts import R1_ZERO_STOP, prompt_ids, stop_strings
from fastgrpo.train.trainer import ADVANTAGE_EPS, GRPOTrainer

FP32_EPS = torch.finfo(torch.float32).eps
SMALL = dict(batch_size=8, num_generations=4, micro_batch_size=8, max_completion_length=5, max_steps=2,
             export=False, progress_bar=False)


def _config(tmp_path, **fields):
    return GRPOConfig(**{**default_task.PRESET, **SMALL, "output_dir": str(tmp_path), **fields})


def _trainer(tmp_path, rewards=default_task.repeat_letter_reward, dataset=None, **fields):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    dataset = default_task.build_dataset(32) if dataset is None else dataset
    return GRPOTrainer(model, tokenizer, rewards, dataset, _config(tmp_path, **fields))


def test_group_advantages_match_fp64_hand_math():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    got = group_advantages(rewards, 4, "group", ADVANTAGE_EPS)
    g = rewards.view(2, 4)
    centered = g - g.mean(-1, keepdim=True)
    expected = (centered / (g.std(-1, keepdim=True) + 1e-4)).flatten()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert got[4:].abs().max() == 0  # a group of equal rewards carries no signal
    torch.testing.assert_close(group_advantages(rewards, 4, "none", ADVANTAGE_EPS), centered.flatten())
    torch.testing.assert_close(group_advantages(rewards, 4, "batch", ADVANTAGE_EPS), centered.flatten() / (rewards.std() + 1e-4))


def test_lr_schedule():
    f = [lr_factor(u, total=10, warmup=2, kind="linear") for u in range(10)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[-1] == pytest.approx(1 / 8)
    assert lr_factor(2, total=10, warmup=2, kind="cosine") == 1.0
    assert lr_factor(6, total=10, warmup=2, kind="cosine") == pytest.approx(0.5)
    assert lr_factor(9, total=10, warmup=0, kind="constant") == 1.0


def test_logged_lr_is_the_one_the_step_updated_with(tmp_path):
    """A step's "lr" was the scheduler's after the step, the next update's (warm-up's first step logged 3/4 of the
    peak, having updated with 1/4), where sft's is its update's: now the step's first update's, as sft's."""
    trainer = _trainer(tmp_path, max_steps=3, num_minibatches=2, micro_batch_size=4, warmup_steps=4, learning_rate=1e-2)
    assert trainer.updates_per_step == 2
    first_updates = [2 * s for s in range(3)]
    expected = [1e-2 * lr_factor(u, total=6, warmup=4, kind=trainer.config.lr_scheduler) for u in first_updates]
    assert [m["lr"] for m in trainer.train()] == pytest.approx(expected, rel=1e-12)
    assert expected[0] == pytest.approx(0.25e-2)


def test_step_entropy_is_the_token_mean_whatever_the_micro_batches(tmp_path):
    """A step's entropy was the plain mean of its micro-batches' token means, so micro-batches of few tokens (short
    completions grouped together) weighed as much as full ones, and micro_batch_size changed the logged entropy: now
    each micro-batch weighs by its tokens, as the adaptive entropy bonus weighs them. Stop strings make the
    completions' lengths differ."""
    runs = [_trainer(tmp_path / str(micro), batch_size=16, micro_batch_size=micro, max_completion_length=8,
                     stop=["a", "e"], max_steps=1).train_step() for micro in (16, 2)]
    whole, split = runs
    assert whole["completion_length"] == split["completion_length"] < 8
    assert split["entropy"] == pytest.approx(whole["entropy"], rel=2e-6)


@pytest.mark.parametrize("dataset, rewards, fields, match", [
    ([], None, {}, "^dataset: expected at least one row"),
    ([{"text": "x"}], None, {}, "^dataset: no prompt column 'prompt'"),
    ([{"prompt": "1 say a"}], None, {}, r"needs columns \['letter'\]"),
    ([{"prompt": "1 say a" * 9, "letter": "a"}], None, {}, "over max_prompt_length"),
    ([{"prompt": "1 say a", "letter": "a"}, {"prompt": "2 say b"}], None, {}, "row 1 has no column 'letter'"),
    ([{"prompt": "1 say a", "letter": "a"}, {"prompt": "2 say b", "letter": "b", "x": 1}], None, {},
     "row 1 has columns"),
    ({"prompt": ["1 say a"], "letter": ["a"]}, None, {}, r"^dataset: expected a list of dict rows .* got dict$"),
    (["1 say a"], None, {}, r"^dataset: expected a list of dict rows .* got rows such as '1 say a'$"),
    (None, [], {}, "reward_funcs"),
    (None, "length", {}, r"^reward_funcs: expected a callable or a list of callables, got the name 'length'"),
    (None, None, {"reward_weights": [1.0, 2.0]}, "reward_weights: expected 1 weights"),
    (None, None, {"max_completion_length": 60}, "exceeds the model's max_position_embeddings"),
    (None, None, {"max_prompt_length": 70, "max_completion_length": 4},
     r"^max_prompt_length \+ max_completion_length \(70 \+ 4\) exceeds the model's max_position_embeddings \(64\): "
     r"lower max_prompt_length to 60 or less$"),
    (None, None, {"report_to": ["mlflow"]}, "report_to: expected one of"),
])
def test_bad_input_raises_before_compute(tmp_path, dataset, rewards, fields, match):
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, rewards if rewards is not None else default_task.repeat_letter_reward, dataset, **fields)


def test_model_loading_fields_the_given_model_lacks_are_named(tmp_path, caplog):
    """From Python the trainer trains the model it is given: lora_rank / patch / dtype of the config, which the
    commands apply as they load the model, are named in a warning when that model does not show them."""
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.input_checks"):
        _trainer(tmp_path, lora_rank=4, patch=True, dtype="bfloat16")
    assert ("config: lora_rank=4 (the model has no PEFT adapters); patch=True (the model is not patch_model'd); "
            "dtype='bfloat16' (the model's weights are torch.float32): these fields act where fastgrpo loads the "
            "model") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.input_checks"):
        _trainer(tmp_path, dtype="float32")
    assert "act where fastgrpo loads the model" not in caplog.text


def test_long_prompts_left_truncated_with_warning(tmp_path, caplog):
    rows = [{"prompt": "0123456789 say a", "letter": "a"}]
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.grpo_data"):
        trainer = _trainer(tmp_path, dataset=rows, max_prompt_length=5, truncate_prompts=True)
    assert trainer.tokenizer.decode(trainer.prompts[0]) == "say a"
    assert "left-truncated" in caplog.text


def test_a_long_prompt_is_refused_naming_the_settings_as_the_user_writes_them(tmp_path, capsys):
    """From Python the fields (max_prompt_length, truncate_prompts=True); on the command line the flags: the
    message had mixed a field with a flag."""
    from fastgrpo.train.cli import main

    rows = [{"prompt": "0123456789 say a", "letter": "a"}]
    with pytest.raises(ValueError, match=r"; raise max_prompt_length or pass truncate_prompts=True to left-truncate$"):
        _trainer(tmp_path, dataset=rows, max_prompt_length=5)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    assert main(["train", "--dataset", str(data), "--max-prompt-length", "5", "--output-dir", str(tmp_path / "run"),
                 "--batch-size", "4", "--num-generations", "4"]) != 0
    assert "; raise --max-prompt-length or pass --truncate-prompts to left-truncate" in capsys.readouterr().err


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_equals_one_batch(tmp_path, loss_type):
    grads = []
    for micro in (8, 2):
        trainer = _trainer(tmp_path / str(micro), micro_batch_size=micro, loss_type=loss_type, max_grad_norm=1e9)
        trainer.train_step()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).double())
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_raising_reward_is_reported_not_fatal_when_skipped(tmp_path):
    def broken(prompts, completions, **kwargs):
        raise KeyError("oops")

    trainer = _trainer(tmp_path, rewards=[default_task.repeat_letter_reward, broken], reward_weights=[1.0, 1.0],
                       reward_errors="skip")  # the default, "raise", stops the run: tests/test_rewards.py
    metrics = trainer.train_step()
    assert metrics["rewards/broken"] == 0.0 and metrics["reward_errors"] == 1
    assert "oops" in metrics["reward_error/broken"]
    assert metrics["reward"] == pytest.approx(metrics["rewards/repeat_letter_reward"])


def test_metrics_jsonl_and_export(tmp_path):
    history = _trainer(tmp_path, export=True, beta=0.1).train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == history and [m["step"] for m in lines] == [1, 2]
    required = {"step", "reward", "reward_std", "rewards/repeat_letter_reward", "frac_reward_zero_std", "kl",
                "kl_p95", "entropy", "clip_ratio", "completion_length", "completion_length_max", "truncated_frac",
                "loss", "grad_norm", "rollout_tokens_per_s", "train_tokens_per_s", "peak_gpu_mem_gib"}
    assert required <= set(lines[0])
    assert 0 < lines[0]["entropy"] < torch.log(torch.tensor(41.0)).item() + 1e-3
    assert (tmp_path / "final" / "config.json").exists() and (tmp_path / "checkpoint-2").exists()


def test_each_epoch_visits_every_row_once(tmp_path):
    trainer = _trainer(tmp_path)  # 32 rows, 2 prompts per step
    config, n = trainer.config, len(trainer.dataset)
    epoch = [i for step in range(16) for i in step_rows(config, n, step)]
    assert sorted(epoch) == list(range(32))
    assert [i for step in range(16, 32) for i in step_rows(config, n, step)] != epoch  # reshuffled


@pytest.mark.parametrize("fields", [
    dict(importance_sampling_level="sequence", num_iterations=2, scale_rewards="none", loss_type="grpo"),
    dict(num_minibatches=2, micro_batch_size=2, loss_type="bnpo", delta=1.5, scale_rewards="batch"),
    dict(beta=0.2, kl_target=10.0, lr_scheduler="linear", warmup_steps=1, top_k=5, top_p=0.9, min_p=0.05),
], ids=["sequence-iters", "minibatches-delta", "adaptive-beta-filters"])
def test_loop_variants_run(tmp_path, fields):
    history = _trainer(tmp_path, max_steps=3, **fields).train()
    for m in history:
        assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "kl", "entropy", "clip_ratio"))
    if "kl_target" in fields:
        assert history[0]["kl"] == 0.0 and history[-1]["beta"] < 0.2  # KL below target: beta shrinks


def test_r1_zero_prompts_and_stop(tmp_path):
    """prompt_format r1_zero: train wraps its prompts as ei and eval do, and stops at </answer> unless --stop."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    model.config.max_position_embeddings = 1024  # RoPE: room for the template, which the built-in model lacks
    dataset = default_task.build_dataset(8)
    config = _config(tmp_path, prompt_format="r1_zero", max_prompt_length=512, max_steps=1)
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, dataset, config)
    assert trainer.prompts[0] == prompt_ids(tokenizer, dataset[0]["prompt"], "r1_zero")
    assert len(trainer.prompts[0]) > len(prompt_ids(tokenizer, dataset[0]["prompt"], "raw")) + 100
    assert all(math.isfinite(m["loss"]) for m in trainer.train())
    assert stop_strings(None, "r1_zero") == R1_ZERO_STOP and stop_strings(["x"], "r1_zero") == ["x"]
    assert stop_strings(None, "raw") is None
    with pytest.raises(ValueError, match="prompt_format: expected one of"):
        _config(tmp_path, prompt_format="r1")


def test_fp8_kv_cache_reaches_the_engine(tmp_path, monkeypatch):
    """--rollout-kv-cache fp8: the built-in engine decodes over an e4m3 cache (which needs the decode kernel, so the
    cache is sized for max_prompt_length as with rollout_attention triton) and the loop trains on its rollouts."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the op's torch path: the interpreter would take minutes
    trainer = _trainer(tmp_path, max_steps=1, rollout_kv_cache="fp8")
    config = trainer.engine.config
    assert config.kv_cache == "fp8" and config.max_prompt_length == trainer.config.max_prompt_length
    assert all(math.isfinite(m["loss"]) for m in trainer.train())


def _counting_logprobs(trainer) -> list:
    """The model each of trainer._logprobs' calls runs (a spy on the instance)."""
    calls, logprobs = [], trainer._logprobs
    trainer._logprobs = lambda model, *args, **kwargs: calls.append(model) or logprobs(model, *args, **kwargs)
    return calls


def _moved_policy_trainer(tmp_path, **fields):
    """A trainer whose policy differs from its reference (seeded noise on the weights after the reference copy), so
    that the first step's KL is not 0."""
    trainer = _trainer(tmp_path, **fields)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return trainer


def test_one_update_takes_the_old_logprobs_from_the_loss(tmp_path):
    """beta > 0, one optimizer step, no rollout correction: only the reference pass runs, and the step equals one
    with the old pass forced. micro_batch_size=2 splits the batch of 8 into 4 micro-batches visited in a shuffled
    order, so log-probs put back in the wrong rows would change kl / kl_p95 (every row has its own completion)."""
    fields = dict(beta=0.1, micro_batch_size=2)
    fast, forced = _moved_policy_trainer(tmp_path / "fast", **fields), _moved_policy_trainer(tmp_path / "old", **fields)
    forced._needs_old_pass = lambda: True  # the pass as train_step ran it before: old log-probs from _logprobs
    fast_calls, forced_calls = _counting_logprobs(fast), _counting_logprobs(forced)
    got, want = fast.train_step(), forced.train_step()
    assert fast_calls == [fast.ref_model] and forced_calls == [forced.model, forced.ref_model]
    assert want["kl"] > 1e-3 and want["kl_p95"] > want["kl"]
    # Both sides take the same fp32 CPU ops for the log-probs (the loss forward in train mode, no dropout in this
    # model, vs the no-grad pass), and old == logp gives the ratio exp(0) = 1 exactly. The two forwards may still round
    # differently (bit for bit on one CI CPU, kl 2e-9 apart on an AMD EPYC's BLAS): 1e-6 relative leaves room for that
    # (fp32 eps 1.2e-7 times a few operations), and is far below what a wrong row order changes (kl by 20% here).
    for key in ("kl", "kl_p95", "loss", "grad_norm", "clip_ratio", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert_one_adamw_step_apart(fast, forced)


def assert_one_adamw_step_apart(fast, forced) -> None:
    """Two trainers after their first optimizer step on gradients that should differ only by rounding: the gradients
    within fp32 rounding, and the weights within what AdamW makes of that. The first AdamW step moves a weight by
    lr * g / (|g| + eps) (the same decay on both sides), whose derivative in g is eps / (|g| + eps)^2: gradients that
    differ by d (their rounding, on a CPU whose BLAS rounds the two forwards differently) move the weights apart by at
    most lr * eps * d / (m + eps)^2, m the smaller |g| (0 where the signs differ), plus the fp32 rounding of the step
    and the weight. Tiny gradients make that large: lr for |g| ~ d."""
    lr, adam_eps = fast.config.learning_rate, fast.config.adam_epsilon
    for (name, p), q in zip(fast.model.named_parameters(), forced.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=name)
        g1, g2 = p.grad.double(), q.grad.double()
        m = torch.where(g1 * g2 > 0, torch.minimum(g1.abs(), g2.abs()), 0.0)
        bound = lr * adam_eps * (g1 - g2).abs() / (m + adam_eps) ** 2 + 4 * FP32_EPS * (p.double().abs() + lr)
        excess = ((p - q).double().abs() - bound).max().item()
        assert excess <= 0, f"{name}: weights differ by {excess:.3g} more than the bound"


@pytest.mark.parametrize("fields, passes", [
    (dict(beta=0.1), ["ref"]),
    (dict(beta=0.1, num_iterations=2), ["old", "ref"]),
    (dict(num_minibatches=2, micro_batch_size=4), ["old"]),
    (dict(beta=0.1, rollout_correction="truncate"), ["ref"]),  # the loss weights itself from its own forward
    (dict(beta=0.1, rollout_correction="truncate", num_iterations=2), ["old", "ref"]),
    (dict(beta=0.1, mask_truncated_completions=True), ["old", "ref"]),  # step 6's KL covers the truncated rows too
    (dict(), []),
], ids=["beta", "iterations", "minibatches", "rollout-correction", "rollout-correction-iterations", "mask-truncated",
      "beta0"])
def test_old_pass_runs_when_the_update_needs_it(tmp_path, fields, passes):
    trainer = _trainer(tmp_path, max_steps=1, **fields)
    calls = _counting_logprobs(trainer)
    metrics = trainer.train_step()
    assert [("ref" if model is trainer.ref_model else "old") for model in calls] == passes
    assert math.isfinite(metrics["kl"]) and math.isfinite(metrics["loss"])


def test_reference_pass_switches_the_adapter_off_once(tmp_path, monkeypatch):
    """A LoRA model's reference log-probs come from the model with its adapter off: switched once for the pass
    (PEFT's switch walks every LoRA layer), not once per micro-batch; the values equal a per-micro-batch switch's."""
    from peft import LoraConfig, PeftModel, get_peft_model

    trainer = _trainer(tmp_path, max_steps=1, beta=0.1, micro_batch_size=2)
    trainer.model = get_peft_model(trainer.model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    switches = []
    switch = PeftModel.disable_adapter
    monkeypatch.setattr(PeftModel, "disable_adapter", lambda self: switches.append(1) or switch(self))
    ids = torch.randint(3, 20, (8, 12))
    completion = torch.zeros_like(ids)
    completion[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}
    got = trainer._logprobs(trainer.model, batch, disable_adapter=True)
    assert len(switches) == 1  # 4 micro-batches
    with switch(trainer.model):
        want = trainer._logprobs(trainer.model, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_patched_bf16_loop_on_gpu(tmp_path):
    import fastgrpo

    tokenizer = default_task.build_tokenizer()
    model = fastgrpo.patch_model(default_task.build_model(tokenizer).to("cuda", torch.bfloat16))
    config = _config(tmp_path, max_steps=4, beta=0.1, num_iterations=2, device="cuda", dtype="bfloat16",
                     micro_batch_size=4)
    history = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(32),
                          config).train()
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["kl"]) for m in history)
    assert history[-1]["peak_gpu_mem_gib"] > 0


def test_report_to_wandb_logs_every_step_from_a_run_started_at_the_first(tmp_path, monkeypatch):
    """wandb.init ran when GRPOTrainer was built: a run that then failed at step 1, or a resume with nothing left to
    train, still made a wandb run. It starts at the first metrics line now, as metrics.jsonl and tensorboard do.
    (wandb is not installed here: a stand-in module records the calls.)"""
    import importlib.machinery
    import sys
    import types

    logged, started = [], []
    run = types.SimpleNamespace(log=lambda scalars, step: logged.append((step, scalars)))
    wandb = types.ModuleType("wandb")
    # a spec: transformers' find_spec("wandb"), when building the model imports its class first, needs one
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.init = lambda **kwargs: started.append(1) or run
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    trainer = _trainer(tmp_path, report_to=["wandb"])
    assert not started
    trainer.train()
    assert [step for step, _ in logged] == [1, 2] and "reward" in logged[0][1] and len(started) == 1
    _trainer(tmp_path, report_to=["wandb"], resume=True).train()  # at max_steps already: nothing to train
    assert len(started) == 1
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ValueError, match="pip install wandb"):
        _trainer(tmp_path, report_to=["wandb"])


def test_chat_prompts_go_through_the_chat_template(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "12 say b"}], "letter": "b"}] * 4
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %} {% endif %}")
    trainer = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, default_task.repeat_letter_reward, rows,
                          _config(tmp_path))
    assert tokenizer.decode(trainer.prompts[0]) == "12 say b "
    seen = []
    trainer.reward_funcs = [lambda prompts, completions, **kw: seen.extend(prompts) or [0.0] * len(completions)]
    trainer.train_step()
    assert seen[0] == rows[0]["prompt"]  # reward functions get the messages, as in TRL
