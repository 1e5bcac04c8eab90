"""FastGRPOTrainer against trl.GRPOTrainer from a TRL user's side, beyond tests/test_trl.py: whole runs over the
GRPOConfig settings a TRL script sets (scale_rewards, steps_per_generation, gradient accumulation and checkpointing,
temperature, cast_lm_head_to_fp32, sync_ref_model, NEFTune), a PEFT model handed over already wrapped (TRL's "ref"
adapter), conversational prompts, other heads (tied, soft-capped, biased), evaluate / predict, save_model and reload,
bf16 autocast; micro-batches TRL's _compute_loss takes and test_trl.py doesn't build (per-token advantages, NaN
sampler log-probs, empty batches, eval mode); and what TRL accepts that FastGRPOTrainer cannot honour, refused.

Whole runs compare the sampled completions, every numeric value TRL logs (test_trl.py's tolerance) and the trained
weights: each tensor's distance between the runs, relative to how far TRL's training moved it. Adam divides a tiny
gradient by its own size, so single elements whose gradients agree to fp32 rounding can end 1% of a step apart (seen
with the Triton interpreter's layers), a tensor's norm less (2.4e-4 at most over the 298 tensors here): WEIGHT_REL =
1e-2, while a formula difference is a sizeable part of the step (a mis-scaled loss, which Adam would hide, shows in
the logged loss and grad_norm). Most runs are unpatched (the loss path is what differs; test_trl.py runs the patched
layers), patched where the layers meet a setting (HF's checkpointing, LoRA adapters switched or disabled for the
reference, save_model).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastgrpo.integrations.trl import FastGRPOTrainer  # noqa: E402
from tests.test_trl import (  # noqa: E402,F401 (model_dir and trainer_pair are fixtures)
    LOSS_TYPES, RecordedFast, RecordedTRL, assert_same_logs, assert_same_loss_and_metrics, build_tokenizer, close,
    configure, micro_batch, model_dir, trainer_pair, vowel_reward,
)

WEIGHT_REL = 1e-2
PROMPTS = ["2+2=", "hello ", "abc", "the cat ", "10-3=", "why? ", "zzz", "ok, "]
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])


def grpo_config(path, **fields) -> GRPOConfig:
    """test_trl.py's config (fp32, no checkpointing, 2 steps of 2 micro-batches of 4), every field overridable."""
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                max_completion_length=8, max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[],
                save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, bf16=False, fp16=False,
                gradient_checkpointing=False, use_cpu=True, seed=42)
    return GRPOConfig(output_dir=str(path), **{**base, **fields})


def trainer(cls, model, path, patch=True, peft=False, dataset=None, reward=vowel_reward, processing_class=None,
            **fields):
    kwargs = {"patch": patch} if issubclass(cls, FastGRPOTrainer) else {}
    if peft:
        kwargs["peft_config"] = LoraConfig(**LORA)
    return cls(model=model, reward_funcs=reward, args=grpo_config(path / cls.__name__, **fields),
               train_dataset=dataset or Dataset.from_dict({"prompt": PROMPTS}),
               processing_class=processing_class or build_tokenizer(), **kwargs)


def train_both(make) -> tuple:
    """make(cls) -> a trainer; each trained right after it is built (TRL's __init__ seeds the global RNG that
    generation draws from; train() does not)."""
    runs = []
    for cls in (RecordedTRL, RecordedFast):
        runs.append(make(cls))
        runs[-1].initial = {n: p.detach().clone() for n, p in runs[-1].model.named_parameters() if p.requires_grad}
        runs[-1].train()
    return tuple(runs)


def assert_same_run(theirs, ours) -> None:
    assert_same_logs(theirs, ours, theirs.state.max_steps)
    want, got = (dict(t.model.named_parameters()) for t in (theirs, ours))
    assert set(want) == set(got) and set(theirs.initial) == set(ours.initial)
    for name, start in theirs.initial.items():
        assert torch.equal(ours.initial[name], start), f"{name}: the runs started from different weights"
        step = float((want[name] - start).norm())
        err = float((got[name] - want[name]).norm())
        assert err <= WEIGHT_REL * step, f"{name}: trained weights {err:.2e} apart, TRL moved them {step:.2e}"


RUNS = {
    # one micro-batch per step, advantages over the whole batch
    "bnpo-scale_rewards=batch-accumulation=1": dict(patch=False, loss_type="bnpo", scale_rewards="batch",
                                                    gradient_accumulation_steps=1, max_steps=3),
    # 3 micro-batches per step, unscaled advantages; HF's gradient checkpointing over fastgrpo's patched layers
    "dr_grpo-scale_rewards=none-accumulation=3-checkpointing": dict(
        loss_type="dr_grpo", scale_rewards="none", gradient_accumulation_steps=3, gradient_checkpointing=True,
        max_steps=1),
    # generation every 4 micro-batches over 2 steps: TRL computes the old log-probs (our contract's first caller)
    "cispo-steps_per_generation=4-iterations=2": dict(patch=False, loss_type="cispo", steps_per_generation=4,
                                                      num_iterations=2, epsilon_high=1.1, max_steps=3),
    "sapo-temperature-fp32_head-pad_to_multiple_of": dict(patch=False, loss_type="sapo", temperature=0.7,
                                                          cast_lm_head_to_fp32=True, pad_to_multiple_of=4),
    # NEFTune's noise hook on the input embeddings, which fastgrpo's backbone call must still run through
    "luspo-sequence-beta-neftune": dict(patch=False, loss_type="luspo", importance_sampling_level="sequence",
                                        beta=0.04, neftune_noise_alpha=5.0),
    # the reference is the adapter-disabled base; PEFT's input-grad hook with reentrant checkpointing
    "peft-beta-reentrant_checkpointing": dict(peft=True, beta=0.04, gradient_checkpointing=True,
                                              gradient_checkpointing_kwargs={"use_reentrant": True}),
    # TRL's callback mixes the policy into the (patched) reference model every step
    "sync_ref_model": dict(beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_trl_script_trains_the_same(model_dir, tmp_path, name):
    fields = dict(RUNS[name])
    assert_same_run(*train_both(lambda cls: trainer(cls, model_dir, tmp_path, **fields)))


def test_a_wrapped_peft_model_trains_against_its_ref_adapter(model_dir, tmp_path):
    """Handed a PeftModel with beta > 0, TRL copies its adapter to one named "ref" and scores the reference through
    it (use_adapter): non-zero LoRA weights, so the base model would give another KL."""
    def make(cls):
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               LoraConfig(**LORA, init_lora_weights=False))
        return trainer(cls, model, tmp_path, beta=0.1)

    theirs, ours = train_both(make)
    assert set(ours.model.peft_config) == {"default", "ref"}
    assert_same_run(theirs, ours)


def test_conversational_prompts_train_the_same(model_dir, tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}a:{% endif %}")
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})

    def reward(completions, **kwargs):
        return [sum(ch in "aeiou" for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]

    assert_same_run(*train_both(lambda cls: trainer(cls, model_dir, tmp_path, patch=False, dataset=dataset,
                                                    reward=reward, processing_class=tokenizer, beta=0.04,
                                                    loss_type="vespo", num_iterations=2)))


SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=None)
HEADS = {
    "qwen2-tied": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=True)),
    "gemma2-softcap": lambda: Gemma2ForCausalLM(Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=2.0)),
    "llama-biases": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, mlp_bias=True, attention_bias=True)),
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_other_heads_train_the_same(tmp_path, head):
    torch.manual_seed(5)
    path = tmp_path / head
    HEADS[head]().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    assert_same_run(*train_both(lambda cls: trainer(cls, str(path), tmp_path, patch=False, beta=0.04)))


def test_evaluate_and_predict_report_what_trl_reports(model_dir, tmp_path):
    """GRPO evaluation generates, scores and computes the loss in eval mode (no accumulation in its normalizers)."""
    dataset = Dataset.from_dict({"prompt": PROMPTS[:4]})
    results = []
    for cls in (GRPOTrainer, FastGRPOTrainer):
        run = trainer(cls, model_dir, tmp_path, patch=False, dataset=dataset, beta=0.04, per_device_eval_batch_size=4)
        prediction = run.predict(dataset)
        results.append((run.evaluate(dataset), prediction.metrics, prediction.predictions, prediction.label_ids))
    (want_eval, want_test, *_), (got_eval, got_test, predictions, labels) = results
    assert predictions is None and labels is None  # TRL's prediction_step returns the loss alone
    for want, got in ((want_eval, got_eval), (want_test, got_test)):
        assert set(got) == set(want), set(got) ^ set(want)
        for key, value in want.items():
            if key.endswith(("_runtime", "_per_second", "_preparation_time")):
                continue
            assert close(value, got[key]), f"{key}: trl {value!r}, fastgrpo {got[key]!r}"
    assert {"eval_loss", "eval_kl", "eval_entropy", "eval_clip_ratio/region_mean"} <= set(got_eval)


@pytest.mark.parametrize("peft", [False, True])
def test_save_model_reloads_what_was_trained(model_dir, tmp_path, peft):
    """save_model() of a patched, trained model: the files a TRL run writes, holding no fastgrpo keys; reloaded with
    plain transformers / PEFT, it holds the trained weights under TRL's names."""
    runs = [trainer(cls, model_dir, tmp_path, peft=peft, max_steps=1) for cls in (GRPOTrainer, FastGRPOTrainer)]
    for run in runs:
        run.train()
        run.save_model(str(tmp_path / f"saved-{type(run).__name__}"))
    want, got = (sorted(os.listdir(tmp_path / f"saved-{type(run).__name__}")) for run in runs)
    assert got == want
    saved = tmp_path / "saved-FastGRPOTrainer"
    if peft:
        from peft import AutoPeftModelForCausalLM

        reloaded = AutoPeftModelForCausalLM.from_pretrained(saved)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(saved)
    want, got = runs[1].model.state_dict(), reloaded.state_dict()
    assert set(got) == set(want) == set(runs[0].model.state_dict())
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def micro_batch_grads(run, inputs, case) -> tuple:
    configure(run, case)
    loss = run._compute_loss(run.model, inputs)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", [dict(loss_type="dapo", beta=0.04), dict(loss_type="grpo")], ids=str)
def test_bf16_autocast_is_no_less_precise_than_trls(trainer_pair, model_dir, tmp_path, case):
    """bf16=True on the CPU: the backbone under autocast in both; TRL's lm_head GEMM in bf16, fastgrpo's with the
    fp32 weight. Measured against TRL's fp32 step, fastgrpo's loss and gradients are no further off than TRL's
    (the backbone's bf16 error dominates the gradients: ~1e-2 relative for both)."""
    inputs = micro_batch(trainer_pair[0], None, False, False)
    want_loss, want_grads = micro_batch_grads(trainer_pair[0], inputs, case)
    errors = []
    for cls in (GRPOTrainer, FastGRPOTrainer):
        loss, grads = micro_batch_grads(trainer(cls, model_dir, tmp_path, patch=False, bf16=True), inputs, case)
        grad_error = max(float((grads[n] - g).norm() / g.norm()) for n, g in want_grads.items())
        errors.append((abs(loss - want_loss), grad_error))
    (trl_loss, trl_grad), (fast_loss, fast_grad) = errors
    assert trl_grad > 1e-3, "bf16 autocast did not apply: nothing is compared"
    assert fast_loss <= trl_loss + 1e-6 and fast_grad <= 1.25 * trl_grad, errors


def per_token_advantages(inputs):  # TRL's _compute_loss takes [B, T] advantages from subclasses
    return {**inputs, "advantages": torch.randn(4, 6, generator=torch.Generator().manual_seed(1))}


def unscorable_sampler_tokens(inputs):  # vLLM gives NaN where it could not score; TRL's off-policy mask zeroes them
    sampled = inputs["sampling_per_token_logps"].clone()
    sampled[0, 1] = sampled[1, 0] = math.nan
    return {**inputs, "sampling_per_token_logps": sampled}


def nothing_to_learn(inputs):  # every completion masked (truncated ones with mask_truncated_completions)
    return {**inputs, "completion_mask": torch.zeros_like(inputs["completion_mask"])}


def aligned_generation(inputs):  # num_iterations=1 and steps aligned: TRL leaves the old log-probs out
    return {key: value for key, value in inputs.items() if key != "old_per_token_logps"}


MICRO_CASES = [(per_token_advantages, dict(loss_type=t, beta=0.04)) for t in LOSS_TYPES]
MICRO_CASES += [(per_token_advantages, dict(loss_type="grpo", importance_sampling_level="sequence"))]
MICRO_CASES += [(unscorable_sampler_tokens, dict(loss_type=t, off_policy_mask_threshold=0.05))
                for t in ("bnpo", "grpo")]
MICRO_CASES += [(nothing_to_learn, dict(loss_type=t, beta=0.04)) for t in LOSS_TYPES]
MICRO_CASES += [(nothing_to_learn, dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.1))]
MICRO_CASES += [(aligned_generation, dict(loss_type=t, beta=0.04, off_policy_mask_threshold=0.0))
                for t in ("grpo", "dapo")]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("shape, case", MICRO_CASES, ids=lambda x: getattr(x, "__name__", None) or str(x))
def test_compute_loss_matches_trl_on_more_batches(trainer_pair, shape, case, mode):
    inputs = shape(micro_batch(trainer_pair[0], None, True, False))
    results = []
    for run in trainer_pair:
        configure(run, case)
        run.model.train(mode == "train")
        run._metrics[mode].clear()
        loss = run._compute_loss(run.model, inputs)
        if mode == "train":
            loss.backward()
        grads = {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads, {k: list(v) for k, v in run._metrics[mode].items()}))
    for run in trainer_pair:
        run.model.train()
    want_grads, got_grads = assert_same_loss_and_metrics(results)
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=1e-4, atol=2e-6), name


def test_torch_compile_is_refused(model_dir, tmp_path):
    """HF compiles the model's forward; FastGRPOTrainer's loss runs the backbone and its own lm_head outside it, so
    a run with torch_compile=True compiled nothing (TRL's compiled 3 graphs), silently."""
    with pytest.raises(ValueError, match="^FastGRPOTrainer cannot honour: torch_compile: .*set torch_compile=False$"):
        trainer(FastGRPOTrainer, model_dir, tmp_path, torch_compile=True)


def test_compute_metrics_is_refused_where_it_is_set(model_dir, tmp_path):
    """GRPO's prediction_step returns no logits or labels, so HF's Trainer skips compute_metrics without a word, in
    evaluate(), predict() and the evaluations during training: the user learns it where the function is set."""
    run = trainer(FastGRPOTrainer, model_dir, tmp_path)
    assert run.compute_metrics is None
    match = r"^FastGRPOTrainer cannot honour: compute_metrics: .*\(GRPOConfig.reward_weights\)"
    with pytest.raises(ValueError, match=match):
        run.compute_metrics = lambda prediction: {"accuracy": 1.0}
    run.compute_metrics = None  # what HF's Trainer itself sets
