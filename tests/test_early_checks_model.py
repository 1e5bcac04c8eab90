"""What a run asks of its model setup is refused before the weights load, not minutes after: --rollout-engine vllm
without vLLM installed, and --lora-target-modules the model does not have (its modules built from config.json on the
meta device, wrapped by PEFT as the load wraps them). The model folder here has a config.json and a tokenizer, and no
weights: a check left to after the load would meet the missing weights first."""
from __future__ import annotations

import json
import sys

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.loading import load_model_and_tokenizer

LINEAR = "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"
NOT_FOUND = f"lora_target_modules: no module of the model is named 'qproj'; its linear layers: {LINEAR}"
QUIET = ["--no-progress-bar", "--logging-steps", "0", "--no-export"]


def _qwen2_config(tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)


@pytest.fixture
def no_weights(tmp_path) -> str:
    """A model folder of the built-in tokenizer and a tiny Qwen2 config, without weights."""
    folder = tmp_path / "no_weights"
    tokenizer = default_task.build_tokenizer()
    tokenizer.save_pretrained(folder)
    _qwen2_config(tokenizer).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def with_weights(tmp_path) -> str:
    """The same model with its (random) weights."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "with_weights"
    tokenizer = default_task.build_tokenizer()
    tokenizer.save_pretrained(folder)
    AutoModelForCausalLM.from_config(_qwen2_config(tokenizer)).save_pretrained(folder)
    return str(folder)


def _argv(command: str, model: str, tmp_path, *extra: str) -> list[str]:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} say a", "letter": "a"}) + "\n" for i in range(4)))
    reward = [] if command == "sft" else ["--reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward"]
    dataset = [] if command == "sft" else ["--dataset", str(data)]  # sft: the built-in rows
    return [command, "--model", model, *dataset, *reward, *extra, "--output-dir", str(tmp_path / "run"), *QUIET]


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_lora_targets_the_model_lacks_are_refused_before_its_weights_load(no_weights, tmp_path, capsys, command):
    assert main(_argv(command, no_weights, tmp_path, "--lora-rank", "4", "--lora-target-modules", "qproj")) == 2
    assert capsys.readouterr().err == f"fastgrpo {command}: error: {NOT_FOUND}\n"


def _load_verdict(model: str, targets: list[str]) -> str | None:
    """What the real load says of `targets`: the line it refuses them with, None where it wraps them."""
    config = GRPOConfig(**{**default_task.PRESET, "model": model, "lora_rank": 4, "lora_target_modules": targets})
    try:
        load_model_and_tokenizer(config)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("targets", [
    ["all-linear"], ["q_proj", "v_proj"], ["q_proj", "not_in_this_model"], ["self_attn.q_proj"], ["qproj"],
    ["layers"], ["embed_tokens"], [".*_proj"],
])
def test_the_early_check_and_the_load_agree_on_the_targets(no_weights, with_weights, tmp_path, capsys, targets):
    """PEFT decides both: a target the load wraps passes the early check (which lets the run go on to the load, that
    then meets the missing weights), one it refuses is refused early in the same words."""
    said = _load_verdict(with_weights, targets)
    assert main(_argv("train", no_weights, tmp_path, "--lora-rank", "4", "--lora-target-modules", *targets)) == 2
    err = capsys.readouterr().err
    if said is None:
        assert "lora_target_modules" not in err and f"model: cannot load {no_weights!r}" in err, err
    else:
        assert err == f"fastgrpo train: error: {said}\n"


def test_vllm_not_installed_is_refused_before_the_model_loads(no_weights, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # where vLLM is installed too: importlib finds none
    assert main(_argv("train", no_weights, tmp_path, "--rollout-engine", "vllm")) == 2
    assert capsys.readouterr().err == ('fastgrpo train: error: rollout_engine: vllm is not installed; pip install '
                                       '"fastgrpo[vllm]" (vllm==0.24.0), or pass --rollout-engine builtin\n')
    assert not (tmp_path / "run").exists()


def test_fp8_kv_cache_of_a_soft_capping_model_is_refused_before_it_loads(tmp_path, capsys):
    """gemma2 decodes on eager attention (it soft-caps its scores), which cannot read an e4m3 cache: the engine
    refused it at the first rollout, once the weights had loaded."""
    from transformers import Gemma2Config

    folder = tmp_path / "gemma2"
    tokenizer = default_task.build_tokenizer()
    tokenizer.save_pretrained(folder)
    Gemma2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8).save_pretrained(folder)
    assert main(_argv("train", str(folder), tmp_path, "--rollout-kv-cache", "fp8")) == 2
    assert capsys.readouterr().err == (
        f"fastgrpo train: error: rollout_kv_cache: fp8 is read by the decode kernel, which cannot run {folder}'s "
        "attention (eager: its config sets attn_logit_softcapping 50.0); use --rollout-kv-cache model\n")
    assert not (tmp_path / "run").exists()
