"""fastgrpo.rollout.generate: prompts in, grouped completions with their sampling log-probs out.

Every argument is checked before any model work. The model generates with its own modules (in eval mode for
the call, restored after); the returned tensors live on the model's device.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

import torch

from fastgrpo.rollout.attention import registered_name
from fastgrpo.rollout.engine import EngineConfig, left_pad, rollout
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.stops import StopStrings

OPTIONS = (
    "num_generations", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
    "seed",
)


@dataclasses.dataclass
class RolloutResult:
    """N = len(prompts) x num_generations rows; the samples of prompt i are rows [i*G, (i+1)*G)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] int64, 1 on real tokens
    completion_ids: torch.Tensor  # [N, L] right-padded with the pad id; L = the longest completion
    completion_mask: torch.Tensor  # [N, L] int64, 1 up to and including the stop token / stop string's last token
    logprobs: torch.Tensor  # [N, L] fp32 log-prob of each sampled token under the sampling distribution, 0 on pads
    texts: list[str]  # decode of the masked completion ids, special tokens skipped
    finish_reasons: list[str]  # "stop" (stop token or string) or "length"
    num_generations: int


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
    **unknown,
) -> RolloutResult:
    """Sample `num_generations` completions of each prompt with the model's own weights.

    prompts: texts (tokenized without special tokens, as a chat template already holds them) or token id lists.
    temperature=0 is greedy; its log-probs are then those at temperature 1 after the filters. The filters apply
    in HF's order: repetition_penalty, temperature, top_k (0: off), top_p, min_p (0: off). stop: strings and/or
    token ids; the tokenizer's and the model's generation-config EOS ids always stop. seed: a fixed seed gives
    the same samples; None draws from torch's global generator.
    """
    if unknown:
        raise ValueError(_unknown_options_message(unknown))
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    return generate_with_config(model, tokenizer, prompts, num_generations, params, stop=stop, seed=seed)


def generate_with_config(
    model, tokenizer, prompts, num_generations: int, params: SamplingParams, *, stop=None, seed=None,
    config: EngineConfig = EngineConfig(),
) -> RolloutResult:
    """generate() with the sampling parameters as one object and the engine settings exposed."""
    _check_request(num_generations, seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    stop_strings, stop_ids = _split_stop(stop, vocab)
    prompt_ids = _tokenize(tokenizer, prompts, vocab)
    _check_lengths(model.config, prompt_ids, params.max_new_tokens)

    pad_id = _pad_id(tokenizer)
    generation_config = getattr(model, "generation_config", None)
    eos = [tokenizer.eos_token_id, *_as_list(getattr(generation_config, "eos_token_id", None))]
    stop_ids = [*stop_ids, *(i for i in eos if i is not None)]
    stops = StopStrings(tokenizer, stop_strings, config.check_every) if stop_strings else None
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    with _rollout_mode(model):
        out = rollout(
            model, prompt_ids, num_generations, params, stop_ids=stop_ids, pad_id=pad_id, generator=generator,
            stop_check=stops.running_hits if stops else None, config=config,
        )
    return _result(tokenizer, prompt_ids, num_generations, out, stops, pad_id)


def _result(tokenizer, prompt_ids, G, out, stops, pad_id) -> RolloutResult:
    tokens, valid, stopped = out.tokens.cpu(), out.valid.cpu().clone(), out.stopped.cpu().clone()
    rows = [tokens[r, valid[r]].tolist() for r in range(tokens.shape[0])]
    if stops is not None:
        for r, ids in enumerate(rows):
            cut = stops.cut(ids)
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


class _rollout_mode:
    """For the call: eval mode (dropout off; gradient checkpointing would drop the cache) and an attention that
    takes the engine's masks: eager stays (it may softcap, e.g. gemma2), anything else becomes grouped_sdpa.
    The modules' own settings come back afterwards."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        self.attn = self.model.config._attn_implementation
        if self.attn != "eager":
            self.model.config._attn_implementation = registered_name()

    def __exit__(self, *exc):
        self.model.config._attn_implementation = self.attn
        for module, training in self.modes:
            module.training = training


def _check_request(num_generations, seed) -> None:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations: expected an int >= 1, got {num_generations!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed: expected an int or None, got {seed!r}")


def _unknown_options_message(unknown: dict) -> str:
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, OPTIONS, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown sampling option {', '.join(parts)}: expected one of {list(OPTIONS)}"


def _split_stop(stop, vocab: int) -> tuple[list[str], list[int]]:
    """stop -> (strings, token ids); a single str or int is a list of one."""
    if stop is None:
        return [], []
    items = [stop] if isinstance(stop, (str, int)) else stop
    if not isinstance(items, Sequence):
        raise ValueError(f"stop: expected a str, an int or a list of them, got {type(stop).__name__}")
    strings, ids = [], []
    for item in items:
        if isinstance(item, str) and item:
            strings.append(item)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < vocab:
            ids.append(item)
        else:
            raise ValueError(f"stop: expected non-empty strings or token ids in [0, {vocab}), got {item!r}")
    return strings, ids


def _tokenize(tokenizer, prompts, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts: expected a non-empty list of strings or of token id lists")
    if all(isinstance(p, str) for p in prompts):
        ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    else:
        ids = [_id_list(p) for p in prompts]
    for i, p in enumerate(ids):
        if p is None or not p:
            raise ValueError(f"prompts[{i}]: expected a non-empty string or token id list, got {prompts[i]!r}")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in p):
            raise ValueError(f"prompts[{i}]: expected token ids in [0, {vocab})")
    return ids


def _id_list(prompt) -> list | None:
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
        return prompt.tolist()
    return list(prompt) if isinstance(prompt, Sequence) and not isinstance(prompt, str) else None


def _check_lengths(config, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    n = len(prompt_ids[longest])
    if n + max_new_tokens > limit:
        raise ValueError(
            f"prompts[{longest}]: {n} tokens + max_new_tokens {max_new_tokens} = {n + max_new_tokens} exceeds the "
            f"model's max_position_embeddings {limit}; shorten the prompt or lower max_new_tokens"
        )


def _pad_id(tokenizer) -> int:
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return pad
    return 0


def _as_list(ids) -> list:
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]
