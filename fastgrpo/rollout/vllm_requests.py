"""One rollout request of ours as vLLM's sampling arguments, and vLLM's outputs as a RolloutResult. No vllm import:
the functions take and return plain values (vLLM's RequestOutput objects are read by attribute)."""
from __future__ import annotations

import torch

from fastgrpo.rollout.base import RolloutResult
from fastgrpo.rollout.decode import left_pad
from fastgrpo.rollout.sampling import SamplingParams


def sampling_kwargs(
    num_generations: int, params: SamplingParams, stop_strings: list[str], stop_ids: list[int], seed: int | None
) -> dict:
    """Keyword arguments of vllm.SamplingParams for one request of ours.

    logprobs=0 returns the sampled token's log-prob alone, flat (one list per completion, no dict per token).
    vLLM detokenizes every step only to find stop strings; without any, the texts are decoded once at the end.
    temperature 0 is greedy in both engines.
    Stops as the built-in engine's: stop_ids are every id a row stops at (requests.stop_token_ids: with the EOS ids
    of the tokenizer and generation config as they are at this call); ignore_eos turns off vLLM's own EOS ids, those
    of the tokenizer and generation_config.json it read when it was built, which stopped rows at an EOS id the model
    no longer has. Stop strings are looked for in text with special tokens skipped.
    """
    return dict(
        n=num_generations, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        stop=stop_strings or None, stop_token_ids=stop_ids or None, seed=seed, logprobs=0, flat_logprobs=True,
        include_stop_str_in_output=True, detokenize=bool(stop_strings), ignore_eos=True, skip_special_tokens=True,
    )


def fan_out(prompt_ids: list[list[int]], num_generations: int, params: SamplingParams) -> tuple[list[list[int]], int]:
    """(the prompts to send, n per request): vLLM refuses n > 1 with greedy sampling, so a greedy request sends
    each prompt num_generations times with n=1, rows still grouped by prompt."""
    if params.greedy and num_generations > 1:
        return [ids for ids in prompt_ids for _ in range(num_generations)], 1
    return prompt_ids, num_generations


def request_seeds(seed: int | None, prompt_keys: list[int], num_generations: int) -> list[int | None]:
    """vLLM's seed of each prompt's request: a hash of (seed, the prompt's key), so a prompt's samples do not depend
    on which prompts share the call (vLLM seeds sample g of a request with seed + g; one seed for every prompt
    would also give sample g of every prompt the same noise). None: vLLM draws from the global generators."""
    if seed is None:
        return [None] * len(prompt_keys)
    out = []
    for key in prompt_keys:
        h = (seed * 0x9E3779B97F4A7C15 + (key & 0xFFFFFFFFFFFFFFFF) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        # below 2**62 - num_generations: vLLM's seed + g stays a positive int64
        out.append(h % (2**62 - num_generations))
    return out


def check_prompt_keys(prompt_keys, count: int) -> list[int]:
    if prompt_keys is None:
        return list(range(count))
    keys = list(prompt_keys) if isinstance(prompt_keys, (list, tuple)) else None
    if keys is None or not all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        raise ValueError(f"prompt_keys: expected a list of ints (one per prompt), got {prompt_keys!r}")
    if len(keys) != count:
        raise ValueError(f"prompt_keys: expected one key per prompt ({count}), got {len(keys)}")
    return keys


def sampled_logprobs(completion) -> list[float]:
    """Log-prob of each sampled token of a vLLM CompletionOutput (flat or per-position dict form)."""
    lps, ids = completion.logprobs, completion.token_ids
    if hasattr(lps, "start_indices"):  # FlatLogprobs: the sampled token is the first entry of each position
        starts = lps.start_indices
        if [lps.token_ids[s] for s in starts] != list(ids):
            raise ValueError("outputs: vLLM's log-probs are not those of the sampled tokens")
        return [lps.logprobs[s] for s in starts]
    return [step[t].logprob for step, t in zip(lps, ids)]


def to_result(outputs, tokenizer, pad_id: int, num_generations: int, device=None, per_request: int | None = None
              ) -> RolloutResult:
    """vLLM RequestOutputs (`per_request` completions each, default num_generations; the rows of one prompt
    consecutive) -> RolloutResult on `device`.

    The texts are decoded from the kept ids (special tokens skipped), as the built-in engine does: a completion
    stopped by a string ends with the token that completed it.
    """
    rows = [(out.prompt_token_ids, c) for out in outputs for c in out.outputs]
    N, G = len(rows), num_generations
    per_request = per_request or G
    if N != len(outputs) * per_request or N % G:
        raise ValueError(f"outputs: expected {per_request} completions per request, got {N} for {len(outputs)} "
                         "requests")
    ids = [list(c.token_ids) for _, c in rows]
    L = max(1, max(len(t) for t in ids))
    prompt_ids, prompt_mask = left_pad([list(p) for p, _ in rows], pad_id)
    completion_ids = torch.full((N, L), pad_id, dtype=torch.long)
    completion_mask = torch.zeros(N, L, dtype=torch.long)
    logprobs = torch.zeros(N, L, dtype=torch.float32)
    for r, (_, c) in enumerate(rows):
        n = len(ids[r])
        if n:
            completion_ids[r, :n] = torch.tensor(ids[r])
            completion_mask[r, :n] = 1
            logprobs[r, :n] = torch.tensor(sampled_logprobs(c))
    return RolloutResult(
        prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
        completion_ids=completion_ids.to(device), completion_mask=completion_mask.to(device),
        logprobs=logprobs.to(device), texts=tokenizer.batch_decode(ids, skip_special_tokens=True),
        finish_reasons=["stop" if c.finish_reason == "stop" else "length" for _, c in rows], num_generations=G,
    )
