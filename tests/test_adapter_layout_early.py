"""An adapter layout the export cannot merge is refused before a run that exports trains, not at its end: the export
refused it once the run had trained (its checkpoints kept, the hours spent). The refusal is export_model's own
(check_mergeable, structural: no weight copied or merged), said by GRPOTrainer, SFTTrainer and ExpertIteration before
their first step; a run that does not export trains. PEFT's trainable_token_indices, which the export refused
(merged weights lack the embedding: its wrapper was saved as PEFT's inner modules), is merged as merge_and_unload
merges it. A tuner the export does not merge (HRA) is refused by name. vLLM's merged weight sync, which writes W + B A * scale alone, refuses DoRA and LoRA biases (it synced
another model than the trained one, silently) before vLLM builds its engine."""
import copy

import pytest
import torch
from peft import HRAConfig, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fastgrpo.hf import peft as hf_peft
from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.expert_iteration import ExpertIteration
from fastgrpo.train.final_export import export_model
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.trainer import GRPOTrainer

TINY_RUN = dict(batch_size=4, num_generations=2, micro_batch_size=4, max_completion_length=4, max_steps=1,
                progress_bar=False, logging_steps=0)
NO_BIAS = r"model: model\.layers\.0\.self_attn\.q_proj: Impossible to merge LoRA with `lora_bias=True` because the " \
          r"base layer has no bias; unsupported adapter layout"
HRA = r"model: model\.layers\.0\.self_attn\.q_proj: the export merges LoRA, LoHa, LoKr, IA3, VeRA, OFT adapters, " \
      r"not HRALayer ones; unsupported adapter layout"
QUANTIZED = r"model: model\.layers\.0\.self_attn\.q_proj: a LoRA variant or bias over a quantized base cannot be " \
            r"merged without quantizing the merged weight again; unsupported adapter layout"


@pytest.fixture(scope="module")
def tokenizer():
    return default_task.build_tokenizer()


def _base(tokenizer, arch: str = "llama", **changes):
    """A 1-layer model of the tokenizer's vocabulary: Llama's attention projections have no bias, Qwen2's q/k/v do."""
    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config((LlamaConfig if arch == "llama" else Qwen2Config)(**sizes, **changes))


def _trained_away(model):
    """Adapters away from their initial values (a zero lora_B makes any merge the base)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(0.3 * torch.randn_like(param))
    return model


def assert_exported_as_merged(model, folder):
    """The HF model in `folder` holds merge_and_unload's weights of the trained PEFT model, bit for bit."""
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, (got[name] - tensor).abs().max().item())


def _grpo(model, tokenizer, tmp_path, **fields):
    config = GRPOConfig(**{**default_task.PRESET, **TINY_RUN, "output_dir": str(tmp_path), **fields})
    return GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(8), config)


def _sft(model, tokenizer, tmp_path, **fields):
    rows = [{"prompt": "1 say a", "response": "aaa"}] * 4
    config = SFTConfig(prompt_format="raw", max_seq_length=12, batch_size=4, micro_batch_size=4, max_steps=1,
                       progress_bar=False, logging_steps=0, output_dir=str(tmp_path), **fields)
    return SFTTrainer(model, tokenizer, rows, config)


def _ei(model, tokenizer, tmp_path, **fields):
    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                         "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "sft_epochs": 1, "ei_steps": 1,
                         "progress_bar": False, "logging_steps": 0, "output_dir": str(tmp_path), **fields})
    return ExpertIteration(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(8), config)


RUNS = {"grpo": _grpo, "sft": _sft, "ei": _ei}


def _lora_bias_without_base_bias(tokenizer):
    return get_peft_model(_base(tokenizer), LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))


def _hra(tokenizer):
    return get_peft_model(_base(tokenizer), HRAConfig(r=2, target_modules=["q_proj", "v_proj"]))


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
@pytest.mark.parametrize("run", RUNS, ids=list(RUNS))
@pytest.mark.parametrize(("layout", "refusal"), [(_lora_bias_without_base_bias, NO_BIAS), (_hra, HRA)],
                         ids=["lora-bias-without-base-bias", "hra"])
def test_a_layout_the_export_cannot_merge_is_refused_before_the_first_step(tmp_path, tokenizer, run, layout, refusal):
    """The run's end refused it (the step trained, checkpoint-1 written); now no step runs and the line is the
    export's own, word for word."""
    model = layout(tokenizer)
    trainer = RUNS[run](model, tokenizer, tmp_path / "run", export=True)
    steps = []
    for name in ("train_step", "run_round", "_run_steps"):  # the first step (round) of each trainer
        if hasattr(trainer, name):
            real = getattr(trainer, name)
            setattr(trainer, name, lambda *a, real=real, **k: steps.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=f"^{refusal}$") as refused:
        trainer.train()
    assert steps == []
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "final").exists()
    with pytest.raises(ValueError) as exported:
        export_model(model, tokenizer, tmp_path / "final")
    assert str(exported.value) == str(refused.value)
    assert not (tmp_path / "final").exists()


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
def test_a_run_that_does_not_export_is_not_refused(tmp_path, tokenizer):
    history = _grpo(_lora_bias_without_base_bias(tokenizer), tokenizer, tmp_path, export=False).train()
    assert [m["step"] for m in history] == [1]
    assert (tmp_path / "checkpoint-1").is_dir() and not (tmp_path / "final").exists()


def test_a_lora_variant_over_a_4bit_base_is_refused_before_the_first_step(tmp_path, tokenizer):
    """DoRA (or a LoRA bias) merged into a 4-bit base would have to be quantized again: refused at the start."""
    pytest.importorskip("bitsandbytes", reason="a 4-bit base needs bitsandbytes (the dev extra installs it)")
    from transformers import BitsAndBytesConfig

    _base(tokenizer, arch="qwen2").save_pretrained(tmp_path / "base")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, device_map="cpu")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    trainer = _grpo(model, tokenizer, tmp_path / "run", export=True)
    trainer.train_step = lambda: pytest.fail("the first step ran")
    with pytest.raises(ValueError, match=f"^{QUANTIZED}$"):
        trainer.train()
    assert not list((tmp_path / "run").glob("checkpoint-*"))


MERGEABLE = {
    "lora": ("llama", dict(target_modules=["q_proj", "v_proj"])),
    "dora": ("llama", dict(target_modules=["q_proj", "v_proj"], use_dora=True)),
    "lora-bias-over-a-base-bias": ("qwen2", dict(target_modules=["q_proj", "v_proj"], lora_bias=True)),
    "modules-to-save-head": ("llama", dict(target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "trainable-tokens": ("llama", dict(target_modules=["q_proj"], trainable_token_indices=[3, 5])),
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("layout", MERGEABLE)
def test_a_mergeable_layout_trains_and_exports_as_peft_merges_it(tmp_path, tokenizer, layout, tied):
    """Each still trains, and final/ holds merge_and_unload's weights of the trained model (bitwise, fp32); for a
    trainable_token_indices run, which the export refused at the end (merged weights lack
    ['model.embed_tokens.weight']), too."""
    arch, options = MERGEABLE[layout]
    model = _trained_away(get_peft_model(_base(tokenizer, arch, tie_word_embeddings=tied),
                                         LoraConfig(r=4, init_lora_weights=False, **options)))
    history = _grpo(model, tokenizer, tmp_path, export=True, learning_rate=1e-2).train()
    assert [m["step"] for m in history] == [1]
    assert_exported_as_merged(model, tmp_path / "final")


def test_the_check_merges_nothing(tokenizer, monkeypatch):
    """check_mergeable reads the structure only: cheap on an 8B model (no fp32 copy of a layer, no delta formed, no
    weight dequantized)."""
    model = _trained_away(get_peft_model(_base(tokenizer, "qwen2"), LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "embed_tokens"], use_dora=True, modules_to_save=["lm_head"])))
    for name in ("_merged_by_peft", "_merged_by_deltas", "_dequantized"):
        monkeypatch.setattr(hf_peft, name, lambda *a, name=name: pytest.fail(f"{name} ran"))
    hf_peft.check_mergeable(model)


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
@pytest.mark.parametrize("option", [{"use_dora": True}, {"lora_bias": True}], ids=["dora", "lora-bias"])
def test_vllms_merged_weight_sync_refuses_what_w_plus_ba_leaves_out(tokenizer, option, no_vllm):
    """merged_sources wrote W + B A * scale into vLLM's weights: DoRA's magnitude and a LoRA bias were left out, so
    vLLM sampled from another model than the one trained. Refused, and by VLLMEngine before vLLM builds."""
    from fastgrpo.rollout import vllm as vllm_engine
    from fastgrpo.rollout.vllm_lora import merged_sources

    model = get_peft_model(_base(tokenizer, "qwen2"), LoraConfig(r=4, target_modules=["q_proj"], **option))
    refusal = (r"^model: model\.layers\.0\.self_attn\.q_proj: vLLM's merged weight sync writes W \+ B A \* scale, "
               r"which leaves out a LoRA variant \(DoRA\) or a LoRA bias; use the built-in engine "
               r"\(GRPOConfig\(rollout_engine='builtin'\), --rollout-engine builtin, or fastgrpo\.rollout\.BuiltinEngine "
               r"in place of VLLMEngine\)$")
    with pytest.raises(ValueError, match=refusal):
        merged_sources(model)
    with pytest.raises(ValueError, match=refusal):
        vllm_engine.VLLMEngine(model, tokenizer, max_model_len=32)
    plain = get_peft_model(_base(tokenizer, "qwen2"), LoraConfig(r=4, target_modules=["q_proj"]))
    assert list(merged_sources(plain)) == ["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
