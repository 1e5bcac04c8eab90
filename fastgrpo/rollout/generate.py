"""fastgrpo.rollout.generate: prompts in, grouped completions with their sampling log-probs out.

Every argument is checked before any model work. The model generates with its own modules (in eval mode for
the call, restored after); the returned tensors live on the model's device.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from fastgrpo._device import on_model_device
from fastgrpo.hf.models import attention_implementation
from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.base import RolloutResult
from fastgrpo.rollout.decode import EngineConfig, left_pad, rollout
from fastgrpo.rollout.requests import (
    check_lengths,
    check_request,
    check_tokenizer,
    pad_token_id,
    split_stop,
    stop_token_ids,
    tokenize_prompts,
    unknown_options_message,
)
from fastgrpo.rollout.sampling import SamplingParams, row_keys
from fastgrpo.rollout.stops import StopStrings


def generate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    num_generations: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    stop: str | int | Sequence[str | int] | None = None,
    seed: int | None = None,
    prompt_keys: Sequence[int] | None = None,
    **unknown,
) -> RolloutResult:
    """Sample `num_generations` completions of each prompt with the model's own weights.

    prompts: texts (tokenized without special tokens, as a chat template already holds them) or token id lists.
    temperature=0 is greedy; its log-probs are then those at temperature 1 after the filters. The filters apply
    in HF's order: repetition_penalty, temperature, top_k (0: off), top_p, min_p (0: off). stop: strings and/or
    token ids (a special token's text, e.g. "<|im_end|>", stops at that token: the texts skip special tokens); a
    string is looked for in the completion's text as it reads after the prompt, as vLLM does (rollout/stops.py: a
    SentencePiece tokenizer's first token keeps its leading space there, not in the returned text); the
    tokenizer's and the model's generation-config EOS ids always stop. seed: a fixed seed gives the same samples;
    None draws one from torch's global generator. prompt_keys: one int per prompt (default: its position in
    `prompts`); sample g of a prompt is a function of (seed, its key, g) alone, so a prompt keeps its completions
    whichever prompts share the call (the trainer passes positions in the whole step's batch).
    """
    if unknown:
        raise ValueError(unknown_options_message(unknown))
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    return generate_with_config(model, tokenizer, prompts, num_generations, params, stop=stop, seed=seed,
                                prompt_keys=prompt_keys)


@on_model_device
def generate_with_config(
    model, tokenizer, prompts, num_generations: int, params: SamplingParams, *, stop=None, seed=None,
    prompt_keys=None, config: EngineConfig = EngineConfig(),
) -> RolloutResult:
    """generate() with the sampling parameters as one object and the engine settings exposed."""
    check_request(num_generations, seed, params)
    check_tokenizer(tokenizer)
    prompt_keys = _check_prompt_keys(prompt_keys, prompts)
    vocab = model.get_input_embeddings().weight.shape[0]
    stop_strings, stop_ids = split_stop(stop, tokenizer, vocab)
    prompt_ids = tokenize_prompts(tokenizer, prompts, vocab)
    check_lengths(model.config, prompt_ids, params.max_new_tokens)

    pad_id = pad_token_id(tokenizer, vocab)
    stop_ids = stop_token_ids(stop_ids, tokenizer, getattr(model, "generation_config", None))
    stops = None
    if stop_strings:
        stops = StopStrings(tokenizer, stop_strings, config.check_every, prompt_ids, num_generations)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    keys = row_keys(seed, prompt_keys, num_generations)

    with _rollout_mode(model):
        out = rollout(
            model, prompt_ids, num_generations, params, stop_ids=stop_ids, pad_id=pad_id, keys=keys,
            stop_check=stops.running_hits if stops else None, config=config,
        )
    return _result(tokenizer, prompt_ids, num_generations, out, stops, pad_id)


def _check_prompt_keys(prompt_keys, prompts) -> list[int]:
    if prompt_keys is None:
        return list(range(len(prompts))) if isinstance(prompts, Sequence) else []
    keys = list(prompt_keys) if isinstance(prompt_keys, Sequence) else None
    if keys is None or not all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        raise ValueError(f"prompt_keys: expected a list of ints (one per prompt), got {prompt_keys!r}")
    if isinstance(prompts, Sequence) and len(keys) != len(prompts):
        raise ValueError(f"prompt_keys: expected one key per prompt ({len(prompts)}), got {len(keys)}")
    return keys


def _result(tokenizer, prompt_ids, G, out, stops, pad_id) -> RolloutResult:
    tokens, valid, stopped = out.tokens.cpu(), out.valid.cpu().clone(), out.stopped.cpu().clone()
    rows = [tokens[r, valid[r]].tolist() for r in range(tokens.shape[0])]
    if stops is not None:
        for r, ids in enumerate(rows):
            cut = stops.cut(ids, r)
            if cut is not None:
                rows[r] = ids[:cut]
                valid[r, cut:] = False
                stopped[r] = True
    L = max(len(ids) for ids in rows)
    device = out.tokens.device
    mask = valid[:, :L].to(device)
    prompt, prompt_mask = left_pad(prompt_ids, pad_id)
    return RolloutResult(
        prompt_ids=prompt.repeat_interleave(G, dim=0).to(device),
        prompt_mask=prompt_mask.repeat_interleave(G, dim=0).to(device),
        completion_ids=torch.where(mask, out.tokens[:, :L], pad_id),
        completion_mask=mask.long(),
        logprobs=torch.where(mask, out.logprobs[:, :L], 0.0),
        texts=[tokenizer.decode(ids, skip_special_tokens=True) for ids in rows],
        finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
        num_generations=G,
    )


@contextlib.contextmanager
def _rollout_mode(model):
    """For the call: eval mode (dropout off; gradient checkpointing would drop the cache) and an attention that
    takes the engine's masks (attention.rollout_attention: eager for a soft-capping model such as gemma2, else
    grouped_sdpa). The modules' own settings come back afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with attention_implementation(model, rollout_attention(model)):
            yield
    finally:
        for module, training in modes:
            module.training = training
