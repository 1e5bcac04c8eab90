"""A thin adapter that runs the same request on a vLLM engine and returns the same RolloutResult.

vLLM keeps its own copy of the weights: after each optimizer step call `sync_weights(llm, model)`. Construct the
LLM with `logprobs_mode="processed_logprobs"` so its log-probs are, like ours, under the sampling distribution
(after temperature and filters); vLLM's default returns the raw model's. Stop strings stay in the text
(include_stop_str_in_output), as in fastgrpo.rollout.generate. Nothing here imports vllm until it is called.
"""
from __future__ import annotations

import torch

from fastgrpo.rollout.base import RolloutResult
from fastgrpo.rollout.decode import left_pad
from fastgrpo.rollout.requests import check_request, pad_token_id, split_stop, tokenize_prompts, unknown_options_message
from fastgrpo.rollout.sampling import SamplingParams


def sampling_kwargs(
    num_generations: int, params: SamplingParams, stop_strings: list[str], stop_ids: list[int], seed: int | None
) -> dict:
    """Keyword arguments of vllm.SamplingParams for one request of ours."""
    check_request(num_generations, seed)
    return dict(
        n=num_generations, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        stop=stop_strings or None, stop_token_ids=stop_ids or None, seed=seed, logprobs=0,
        include_stop_str_in_output=True, skip_special_tokens=True,
    )


def generate_vllm(
    llm, tokenizer, prompts, *, num_generations=1, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0,
    min_p=0.0, repetition_penalty=1.0, stop=None, seed=None, **unknown,
) -> RolloutResult:
    """fastgrpo.rollout.generate's signature and result, on a vllm.LLM."""
    if unknown:
        raise ValueError(unknown_options_message(unknown))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, repetition_penalty=repetition_penalty)
    vocab = len(tokenizer)
    stop_strings, stop_ids = split_stop(stop, vocab)
    prompt_ids = tokenize_prompts(tokenizer, prompts, vocab)
    kwargs = sampling_kwargs(num_generations, params, stop_strings, stop_ids, seed)

    import vllm

    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], vllm.SamplingParams(**kwargs), use_tqdm=False
    )
    return to_result(outputs, pad_token_id(tokenizer), num_generations)


def to_result(outputs, pad_id: int, num_generations: int) -> RolloutResult:
    """vLLM RequestOutputs (one per prompt, `num_generations` completions each) -> RolloutResult on the CPU."""
    rows = [(out.prompt_token_ids, c) for out in outputs for c in out.outputs]
    N, G = len(rows), num_generations
    if N != len(outputs) * G:
        raise ValueError(f"outputs: expected {G} completions per prompt, got {N} for {len(outputs)} prompts")
    L = max(len(c.token_ids) for _, c in rows)
    prompt_ids, prompt_mask = left_pad([list(p) for p, _ in rows], pad_id)
    completion_ids = torch.full((N, L), pad_id, dtype=torch.long)
    completion_mask = torch.zeros(N, L, dtype=torch.long)
    logprobs = torch.zeros(N, L, dtype=torch.float32)
    for r, (_, c) in enumerate(rows):
        n = len(c.token_ids)
        completion_ids[r, :n] = torch.tensor(c.token_ids)
        completion_mask[r, :n] = 1
        # c.logprobs[t]: {token id: Logprob} holding the sampled token (logprobs=0 asks for it alone)
        logprobs[r, :n] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
    return RolloutResult(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, logprobs=logprobs, texts=[c.text for _, c in rows],
        finish_reasons=["stop" if c.finish_reason == "stop" else "length" for _, c in rows], num_generations=G,
    )


def sync_weights(llm, model: torch.nn.Module) -> None:
    """Copy the trainer's current weights into the vLLM engine through each worker's model.load_weights.

    The weights travel to the workers by pickling: meant for an in-process engine
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), where nothing is copied but into vLLM's own parameters.
    """
    if hasattr(model, "merge_and_unload"):
        raise ValueError("model: merge the LoRA adapter into a copy first; vLLM loads plain weights")
    llm.collective_rpc(_load_weights, args=(list(model.state_dict().items()),))


def _load_weights(worker, weights) -> None:
    """Runs inside each vLLM worker."""
    worker.model_runner.model.load_weights(weights)
