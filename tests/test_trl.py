"""FastGRPOTrainer against trl.GRPOTrainer on the CPU in fp32, with a tiny Qwen2 model and a character tokenizer
built here (no download).

- Whole runs: same seed, data, rewards and config -> the same completions and the same logged loss, kl, entropy,
  clip ratios (every numeric key TRL logs) at every step, with and without PEFT, beta 0 and > 0.
- One micro-batch through both `_compute_loss`s, for every loss type x importance-sampling level x beta and each
  option (delta, the off-policy mask, top_entropy_quantile, the entropy bonus, use_bias_correction_kl, the vLLM
  rollout correction of each mode, tool masks): the same loss, parameter gradients and logged metrics.
- What FastGRPOTrainer refuses, it refuses at construction, naming the option.

Tolerance: both compute fp32 log-probs over V = 64 with different summation orders (TRL's tiled online
log-sum-exp, fastgrpo's chunks), a few ulps apart (~5e-7 at |logp| ~ 4); the loss and metrics are means of O(1)
terms of those, so 2e-6 absolute + 1e-4 relative bounds them, far below any formula difference (the loss values are
~1e-2 to 1).
TRL 1.15 cannot train on a CPU-only torch (its Triton import); CI installs 1.16 (the dev extra allows both).
"""
from __future__ import annotations

import functools
import math
import os
import string
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastgrpo.hf.models import unwrap_peft  # noqa: E402
from fastgrpo.integrations.trl import SUPPORTED_TRL, FastGRPOTrainer  # noqa: E402

ABS, REL = 2e-6, 1e-4
SKIP_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch", "step",
             "learning_rate"}


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
        return (a is None or math.isnan(a)) and (b is None or math.isnan(b))
    return abs(a - b) <= ABS + REL * abs(a)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (BPE without merges), 54 ids; left padding as TRL wants for generation."""
    chars = ["<pad>", "</s>", "<unk>"] + list(string.ascii_lowercase + string.digits + " .,!?+-=*/:;()'")
    vocab = {c: i for i, c in enumerate(chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="left")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer Qwen2 saved to disk: TRL builds the reference model from the path when beta > 0, and both
    trainers start from the same weights."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, attn_implementation="eager")
    torch.manual_seed(1234)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def vowel_reward(prompts, completions, completion_ids, **kwargs):
    """Deterministic and varied within a group: the share of vowels, + 0.5 for stopping early."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) + (0.5 if len(ids) < 8 else 0.0)
            for c, ids in zip(completions, completion_ids)]


def grpo_config(tmp_path, **fields) -> GRPOConfig:
    # fp32 (TRL's base config defaults to bf16), no checkpointing (TRL's default is on) unless a test asks
    defaults = dict(bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, seed=42)
    return GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=8, max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, **{**defaults, **fields},
    )


def build(cls, model_dir, tmp_path, peft=False, patch=True, **fields):
    kwargs = {"patch": patch} if issubclass(cls, FastGRPOTrainer) else {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    dataset = Dataset.from_dict({"prompt": ["2+2=", "hello ", "abc", "the cat ", "10-3=", "why? ", "zzz", "ok, "]})
    return cls(model=model_dir, reward_funcs=vowel_reward, args=grpo_config(tmp_path, **fields),
               train_dataset=dataset, processing_class=build_tokenizer(), **kwargs)


class Recorded:
    """Records each generation's completion ids (the runs must sample the same tokens to be compared)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.recorded = getattr(self, "recorded", []) + [out["completion_ids"].tolist()]
        return out


class RecordedTRL(Recorded, GRPOTrainer):
    pass


class RecordedFast(Recorded, FastGRPOTrainer):
    pass


RUNS = {
    # token-level clipping active in the second epoch (num_iterations=2), KL with bias correction (TRL's default),
    # LoRA (the reference is the adapter-free base), fastgrpo's patched layers (Triton's interpreter on the CPU)
    "dapo-token-beta-peft": dict(peft=True, loss_type="dapo", beta=0.04, num_iterations=2, epsilon_high=0.28),
    # sequence-level ratios, no KL, the entropy mask and the adaptive entropy bonus, truncated completions masked;
    # unpatched layers (the loss path alone)
    "grpo-sequence-entropy": dict(patch=False, loss_type="grpo", importance_sampling_level="sequence", num_iterations=2,
                                  top_entropy_quantile=0.5, entropy_coef=0.01, use_adaptive_entropy=True,
                                  entropy_target=10.0, mask_truncated_completions=True),
}


def assert_same_logs(theirs, ours, steps: int) -> list[list[dict]]:
    """Two runs that sampled the same completions logged the same keys and values (SKIP_KEYS aside) at each of
    their `steps` steps; returns their logs."""
    assert ours.recorded == theirs.recorded, "the runs sampled different completions: no step-by-step comparison"
    logs = [[entry for entry in t.state.log_history if "train_runtime" not in entry] for t in (theirs, ours)]
    assert len(logs[0]) == len(logs[1]) == steps
    for step, (want, got) in enumerate(zip(*logs), start=1):
        assert set(got) == set(want), (step, set(got) ^ set(want))
        for key, value in want.items():
            if key in SKIP_KEYS or not isinstance(value, (int, float, type(None))):
                continue
            assert close(value, got[key]), f"step {step} {key}: trl {value!r}, fastgrpo {got[key]!r}"
    return logs


@pytest.mark.parametrize("name", sorted(RUNS))
def test_training_logs_what_trl_logs(model_dir, tmp_path, name):
    fields = dict(RUNS[name])
    peft, patch = fields.pop("peft", False), fields.pop("patch", True)
    runs = []
    for cls in (RecordedTRL, RecordedFast):
        trainer = build(cls, model_dir, tmp_path / cls.__name__, peft=peft, patch=patch, **fields)
        trainer.train()
        runs.append(trainer)
    theirs, ours = runs
    assert bool(getattr(unwrap_peft(ours.model), "fastgrpo_patch_summary", None)) == patch
    logs = assert_same_logs(theirs, ours, 2)
    loss_side = {"loss", "entropy", "clip_ratio/region_mean", "clip_ratio/low_min"}
    loss_side |= {"kl"} if fields.get("beta") else set()
    assert loss_side <= set(logs[0][0]), loss_side - set(logs[0][0])


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
# Every loss type at both levels; beta alternates (the KL path is the same code for every type).
CASES = [dict(loss_type=t, importance_sampling_level=level, beta=0.04 if (i + j) % 2 else 0.0)
         for i, t in enumerate(LOSS_TYPES) for j, level in enumerate(("token", "sequence"))]
CASES += [
    dict(loss_type="grpo", delta=1.1, epsilon_high=0.05),
    dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="bnpo", off_policy_mask_threshold=0.0, sampled=True),
    dict(loss_type="dapo", top_entropy_quantile=0.3, entropy_coef=0.02),
    dict(loss_type="grpo", entropy_coef=-0.05, use_adaptive_entropy=True, entropy_target=5.0),
    dict(loss_type="cispo", epsilon_high=1.05),
    dict(loss_type="sapo", sapo_temperature_neg=2.0, sapo_temperature_pos=0.5),
    dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_neg=0.5),
    dict(loss_type="dapo", vllm="token_truncate", sampled=True),
    dict(loss_type="grpo", vllm="sequence_mask", sampled=True),
    dict(loss_type="vespo", vllm="token_mask", sampled=True),
    dict(loss_type="dapo", beta=0.04, tool_mask=True),
]
ATTRS = ("loss_type", "importance_sampling_level", "beta", "top_entropy_quantile", "off_policy_mask_threshold",
         "entropy_coef", "use_adaptive_entropy")
ARGS = ("delta", "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_target")


@functools.cache
def micro_batch(trainer, vllm: str | None, sampled: bool, tool_mask: bool) -> dict:
    """One micro-batch of TRL's `inputs`: left-padded prompts, completions with a padded tail and an empty row, old /
    ref / sampler log-probs near the policy's (the ratios cross both clip bounds), a rollout correction."""
    g = torch.Generator().manual_seed(7)
    B, P, T = 4, 5, 6
    prompt_ids = torch.randint(3, 54, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completion_ids = torch.randint(3, 54, (B, T), generator=g)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3] = 0
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), T)
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -0.7, 0.4, -1.2]),
        "num_items_in_batch": torch.tensor(37.0),
        "old_per_token_logps": logps + torch.randn(B, T, generator=g) * 0.3,
        "ref_per_token_logps": logps + torch.randn(B, T, generator=g) * 0.3,
    }
    if sampled:
        inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + torch.randn(B, T, generator=g) * 0.2
    if vllm is not None:
        diff = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * completion_mask
        ratio = torch.exp(diff.sum(-1, keepdim=True) if vllm.startswith("sequence") else diff)
        inputs["importance_sampling_ratio"] = (ratio.clamp(max=1.2) if vllm.endswith("truncate")
                                               else ratio.masked_fill(ratio > 1.2, 0.0))
    if tool_mask:
        inputs["tool_mask"] = torch.ones(B, T, dtype=torch.long)
        inputs["tool_mask"][0, 2:4] = 0
    return inputs


DEFAULTS = dict(loss_type="dapo", importance_sampling_level="token", beta=0.0, top_entropy_quantile=1.0,
                off_policy_mask_threshold=None, entropy_coef=0.0, use_adaptive_entropy=False, delta=None,
                use_bias_correction_kl=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, entropy_target=0.2, epsilon_high=0.28)


def configure(trainer, case: dict, vllm: str | None = None) -> None:
    """Set what TRL's _compute_loss reads (trainer attributes and args fields) to `case` over TRL's defaults, as
    inside the second micro-batch of an accumulation window of 2; clear the logged metrics and gradients."""
    settings = {**DEFAULTS, **case}
    for name in ATTRS:
        setattr(trainer, name, settings[name])
    for name in ARGS:
        setattr(trainer.args, name, settings[name])
    trainer.epsilon_high = settings["epsilon_high"]
    trainer._entropy_bonus_enabled = settings["entropy_coef"] != 0.0 or settings["use_adaptive_entropy"]
    trainer._last_world_entropy = 1.0  # as after a first step: the adaptive bonus applies (entropy <= target)
    trainer._entropy_window_stats = None
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = vllm is not None
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)


def test_left_padded_rows_run_without_their_mask(trainer_pair):
    """The micro-batch's rows (left-padded prompts, padded completions, an empty completion) are each one run of 1s:
    the backbone runs them rolled left, on the causal mask alone (fastgrpo.loss.row_layout), up to the longest row;
    test_compute_loss_matches_trl checks the values against TRL's masked forward."""
    trainer = trainer_pair[1]
    inputs = micro_batch(trainer_pair[0], None, False, False)
    configure(trainer, {})
    seen = []
    backbone = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    hook = backbone.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["attention_mask"], kwargs["input_ids"].shape[1])),
        with_kwargs=True)
    try:
        trainer._compute_loss(trainer.model, inputs)
    finally:
        hook.remove()
    longest = int((inputs["prompt_mask"].sum(1) + inputs["completion_mask"].sum(1)).max())
    assert seen == [(None, longest)]


@pytest.fixture(scope="module")
def trainer_pair(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("pair")
    # Unpatched: the loss path is what is compared here (the patched layers run in the first whole run).
    return [build(cls, model_dir, path / cls.__name__, patch=False) for cls in (GRPOTrainer, FastGRPOTrainer)]


def assert_same_loss_and_metrics(results) -> tuple[dict, dict]:
    """results: TRL's and FastGRPOTrainer's (loss, grads, logged metrics) of one micro-batch; the grads of each,
    over the same parameters, for the caller's tolerance."""
    (want, want_grads, want_metrics), (got, got_grads, got_metrics) = results
    assert close(want, got), f"loss: trl {want!r}, fastgrpo {got!r}"
    assert set(got_metrics) == set(want_metrics), set(got_metrics) ^ set(want_metrics)
    for key, values in want_metrics.items():
        assert all(close(a, b) for a, b in zip(values, got_metrics[key])), f"{key}: {values} vs {got_metrics[key]}"
    assert set(got_grads) == set(want_grads)
    return want_grads, got_grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_compute_loss_matches_trl(trainer_pair, case):
    case = dict(case)
    vllm, sampled, tool = case.pop("vllm", None), case.pop("sampled", False), case.pop("tool_mask", False)
    inputs = micro_batch(trainer_pair[0], vllm, sampled, tool)
    results = []
    for trainer in trainer_pair:
        configure(trainer, case, vllm)
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}))
    want_grads, got_grads = assert_same_loss_and_metrics(results)
    for name, want_grad in want_grads.items():
        err = float((got_grads[name] - want_grad).norm() / want_grad.norm().clamp(min=1e-12))
        assert err <= REL or float((got_grads[name] - want_grad).abs().max()) <= ABS, f"{name}: relative {err:.2e}"


@pytest.mark.parametrize("recompute_layers", [None, 1])
def test_patched_offloaded_checkpointed_step_matches_trl(trainer_pair, model_dir, tmp_path, recompute_layers):
    """patch_model's layers (Triton's interpreter here) and activation offload in place of TRL's default gradient
    checkpointing, on every layer or the first only: the same micro-batch loss and gradients as TRL's plain
    trainer."""
    offloaded = FastGRPOTrainer(model=model_dir, reward_funcs=vowel_reward,
                                args=grpo_config(tmp_path / "offload", gradient_checkpointing=True),
                                train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
                                processing_class=build_tokenizer(), offload_activations=True,
                                recompute_layers=recompute_layers)
    assert unwrap_peft(offloaded.model).fastgrpo_patch_summary["options"]["offload_activations"] is True
    layers = unwrap_peft(offloaded.model).model.layers
    checkpointed = len(layers) if recompute_layers is None else recompute_layers
    assert ["_fastgrpo_offload" in layer.__dict__ for layer in layers] == \
        [True] * checkpointed + [False] * (len(layers) - checkpointed)
    inputs = micro_batch(trainer_pair[0], None, False, False)
    results = []
    for trainer in (trainer_pair[0], offloaded):
        configure(trainer, dict(loss_type="dapo", beta=0.04))
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in trainer.model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert close(want, got), (want, got)
    for name, grad in want_grads.items():
        err = float((got_grads[name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert err <= REL, f"{name}: relative {err:.2e}"


@pytest.mark.parametrize("peft", [False, True])
def test_offload_stays_on_through_trls_training_loop(model_dir, tmp_path, peft):
    """TRL's gradient checkpointing is handed over to the offload: HF's Trainer turns HF's checkpointing on at
    train() and TRL toggles it around each generation; before, that put HF's flag back on every layer and the
    offload stepped aside (its warning) for the whole run. After two real steps the layers are still ours."""
    from peft import LoraConfig

    trainer = FastGRPOTrainer(model=model_dir, reward_funcs=vowel_reward,
                              args=grpo_config(tmp_path, gradient_checkpointing=True),
                              train_dataset=Dataset.from_dict({"prompt": ["2+2=", "abc"] * 4}),
                              processing_class=build_tokenizer(), offload_activations=True,
                              peft_config=LoraConfig(r=4, target_modules=["q_proj", "up_proj"]) if peft else None)
    assert trainer.args.gradient_checkpointing is False
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*HF gradient checkpointing was turned on after")
        trainer.train()
    layers = unwrap_peft(trainer.model).model.layers
    assert [("_fastgrpo_offload" in layer.__dict__, bool(layer.gradient_checkpointing)) for layer in layers] == \
        [(True, False)] * len(layers)


def test_vespo_weights_and_off_policy_mask_equal_trls_own():
    """fastgrpo's vespo_weights / off_policy_mask against TRL's static helpers on the same tensors (fp64)."""
    from fastgrpo.loss.config import GRPOLossConfig
    from fastgrpo.loss.grpo import off_policy_mask, vespo_weights

    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    mask = torch.rand(B, T, generator=g) < 0.8
    log_ratio = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64)
    is_ratio = torch.where(mask, torch.rand(B, T, generator=g, dtype=torch.float64) * 2, 1.0)
    cfg = GRPOLossConfig(loss_type="vespo")
    want = GRPOTrainer.get_gamma_weights(adv, log_ratio, mask.double(), is_ratio)
    assert torch.allclose(vespo_weights(log_ratio, mask, adv, is_ratio, cfg), want, rtol=1e-12)
    logps, sampling = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g,
                                                                                         dtype=torch.float64)
    want = GRPOTrainer.get_off_policy_mask(adv, logps, sampling, mask.double(), 0.1)
    assert torch.equal(off_policy_mask(logps, sampling, mask, adv, 0.1).double(), want)


@pytest.mark.parametrize("fields, kwargs, match", [
    (dict(use_liger_kernel=True), {}, "use_liger_kernel"),
    ({}, dict(patch=False, offload_activations=True), "offload_activations"),
    (dict(gradient_checkpointing=True), dict(recompute_layers=1), "recompute_layers"),  # without offload
    ({}, dict(patch="no"), "patch: expected True or False, got 'no'"),
    ({}, dict(backend="cuda"), "backend: expected one of auto, triton, torch, got 'cuda'"),
])
def test_what_it_cannot_honour_is_refused_at_construction(model_dir, tmp_path, fields, kwargs, match):
    with pytest.raises(ValueError, match=f"FastGRPOTrainer cannot honour: {match}"):
        FastGRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=grpo_config(tmp_path, **fields),
                        train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), processing_class=build_tokenizer(),
                        **kwargs)


def test_the_supported_versions_are_the_extras():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    extra = [Requirement(r) for r in requires("fastgrpo") or [] if "extra == \"trl\"" in r.replace("'", '"')]
    assert extra and all(r.specifier == SUPPORTED_TRL for r in extra if r.name == "trl"), extra
    assert SUPPORTED_TRL.contains(trl.__version__)
