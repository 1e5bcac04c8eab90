"""The built-in engine on the configuration variants real checkpoints of the supported families use: its greedy
tokens and log-probs equal the unpatched HF model's forward over each prompt + completion (fp32, CPU), with
completions that run past the sliding windows and the rope-scaling thresholds; a longrope rollout that would
straddle its threshold is refused (fastgrpo/rollout/rope_limits.py)."""
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from fastgrpo.rollout.decode import EngineConfig, rollout
from fastgrpo.rollout.sampling import SamplingParams

PAD = 0
S = 24  # new tokens: past every window below (6) and the longrope threshold of the straddling case
# token ids of three prompts of 11, 3 and 25 tokens (the prompts of tests/test_rollout.py)
PROMPTS = [[5 + (7 * i + j) % 40 for j in range(n)] for i, n in enumerate((11, 3, 25))]


def sizes(**changes):
    base = dict(vocab_size=131, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=None,
                eos_token_id=None)
    return {**base, **changes}


def longrope(original: int) -> dict:
    """Phi-3.5's rope scaling (short and long factors, one per rotary frequency of head_dim 16)."""
    return sizes(original_max_position_embeddings=original, rope_scaling=dict(
        type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)]))


VARIANTS = {
    "llama-biases": lambda: LlamaConfig(**sizes(attention_bias=True, mlp_bias=True)),
    "llama-llama3-rope": lambda: LlamaConfig(**sizes(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama-yarn-rope": lambda: LlamaConfig(**sizes(rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "llama-linear-rope-gelu-tied": lambda: LlamaConfig(**sizes(
        rope_scaling=dict(rope_type="linear", factor=2.0), hidden_act="gelu", tie_word_embeddings=True)),
    # dynamic NTK rescales past max_position_embeddings, which a rollout never reaches (check_lengths)
    "llama-dynamic-rope": lambda: LlamaConfig(**sizes(max_position_embeddings=49, rope_scaling=dict(
        rope_type="dynamic", factor=2.0))),
    "mistral-window-head-dim": lambda: MistralConfig(**sizes(sliding_window=6, head_dim=24)),
    "qwen2-window-off": lambda: Qwen2Config(**sizes(use_sliding_window=False, sliding_window=6)),
    "qwen2-window-layers": lambda: Qwen2Config(**sizes(
        use_sliding_window=True, sliding_window=6, max_window_layers=1, num_hidden_layers=3)),
    "qwen3-head-dim-bias": lambda: Qwen3Config(**sizes(head_dim=32, attention_bias=True)),
    "gemma-head-dim": lambda: GemmaConfig(**sizes(head_dim=32)),
    "gemma2-softcaps": lambda: Gemma2Config(**sizes(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, attn_implementation="eager")),
    "gemma3-local-global": lambda: Gemma3TextConfig(**sizes(
        head_dim=16, sliding_window=6, num_hidden_layers=3, rope_local_base_freq=10.0, rope_theta=1e6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        rope_scaling=dict(rope_type="linear", factor=8.0), final_logit_softcapping=3.0)),
    # rope parameters per layer type, dynamic on the global layers only (one rotary module, one rope type per type)
    "gemma3-dynamic-global": lambda: Gemma3TextConfig(**sizes(
        head_dim=16, sliding_window=6, num_hidden_layers=3, max_position_embeddings=49,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        rope_parameters={"full_attention": dict(rope_type="dynamic", factor=2.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=10.0)})),
    "phi3-window-partial-rotary": lambda: Phi3Config(**sizes(sliding_window=6, partial_rotary_factor=0.75)),
    # the threshold past every row from the prefill on (long factors throughout) and past none (short throughout)
    "phi3-longrope-long": lambda: Phi3Config(**longrope(original=2)),
    "phi3-longrope-short": lambda: Phi3Config(**longrope(original=25 + S)),
}


# engine options spread over the variants they could break (the rest run the CPU's defaults): stacked q/k/v and
# gate/up copies with biases; a cache sized for longer prompts on a model kept on "eager" attention. (The decode
# kernel's options run it under TRITON_INTERPRET here, minutes a variant: tests/test_shared_prefix.py covers them.)
OPTIONS = {
    "llama-biases": EngineConfig(weights="fused"),
    "qwen3-head-dim-bias": EngineConfig(weights="fused"),
    "gemma2-softcaps": EngineConfig(weights="fused", max_prompt_length=40),
    "gemma3-local-global": EngineConfig(weights="fused"),
    "phi3-window-partial-rotary": EngineConfig(weights="fused"),
}


def model_of(variant: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(VARIANTS[variant]()).eval()


def engine_greedy(model, config: EngineConfig = EngineConfig()):
    """The engine's S greedy tokens and log-probs [2B, S], two rows per prompt (no stop token: all run to S)."""
    from fastgrpo.rollout.generate import _rollout_mode

    with _rollout_mode(model):
        return rollout(model, PROMPTS, 2, SamplingParams(max_new_tokens=S, temperature=0), stop_ids=[], pad_id=PAD,
                       keys=None, config=config)


def hf_forward(model, prompt: list[int], completion: torch.Tensor) -> torch.Tensor:
    """log_softmax of the logits that predict each completion token, one forward over prompt + completion: [S, V]."""
    ids = torch.cat([torch.tensor(prompt), completion])[None]
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1: -1].double().log_softmax(-1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_and_logprobs_equal_hf_forward(variant):
    model = model_of(variant)
    out = engine_greedy(model, OPTIONS.get(variant, EngineConfig()))
    assert torch.equal(out.tokens[0::2], out.tokens[1::2]) and torch.equal(out.logprobs[0::2], out.logprobs[1::2])
    for row, prompt in zip(range(0, 2 * len(PROMPTS), 2), PROMPTS):
        want = hf_forward(model, prompt, out.tokens[row])
        assert torch.equal(out.tokens[row], want.argmax(-1)), (variant, row)
        got = out.logprobs[row].double()
        # fp32 forwards of different shapes (one token at a time vs the whole row): the existing bound of the
        # engine-vs-HF tests (tests/test_rollout.py)
        torch.testing.assert_close(got, want.gather(1, out.tokens[row][:, None])[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("original", [20, 30], ids=["prompts-on-both-sides", "completions-cross"])
def test_longrope_rows_that_would_straddle_the_threshold_are_refused_before_any_compute(original):
    """completions-cross: rows start on the short factors and pass the threshold, where HF's forward over the row
    uses the long ones for every position, which K/V cached with the short ones cannot follow (unrefused, the
    engine's log-probs were 3e-3 off and a greedy token differed). prompts-on-both-sides: the 25-token prompt puts
    the prefill of every row on the long factors, where HF's forward over a short row that stops below the
    threshold (an EOS) uses the short ones."""
    model = AutoModelForCausalLM.from_config(Phi3Config(**longrope(original))).eval()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    message = (rf"^rope_parameters\['original_max_position_embeddings'\] {original}: longrope switches .* prompts of 3 "
               rf"to 25 tokens \+ max_new_tokens 24 cross it: keep the longest prompt \+ max_new_tokens <= "
               rf"{original}, or every prompt longer than {original}$")
    with pytest.raises(ValueError, match=message):
        engine_greedy(model)
    assert not calls
