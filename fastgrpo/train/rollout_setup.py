"""The trainer's side of the rollout: the engine its completions come from, and a step's rollout laid out as the
rows the loss takes.

Kept out of trainer.py so that the loop reads top to bottom.
"""
from __future__ import annotations

import dataclasses

import torch

from fastgrpo.rollout import BuiltinEngine, RolloutEngine
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.train.config import GRPOConfig


def rollout_engine(model: torch.nn.Module, tokenizer, config: GRPOConfig, device: torch.device,
                   engine: RolloutEngine | None = None) -> RolloutEngine:
    """`engine` when one is given; else config.rollout_engine's: a VLLMEngine sharing the model's weights (it
    re-points the model's parameters at vLLM's), or BuiltinEngine(model, tokenizer) with the model's own modules."""
    if engine is None and config.rollout_engine == "vllm":
        from fastgrpo.rollout.vllm import VLLMEngine

        engine = VLLMEngine(
            model, tokenizer, max_model_len=config.max_prompt_length + config.max_completion_length,
            max_num_seqs=config.batch_size, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            lora_sync=config.vllm_lora_sync, execution=config.vllm_execution, seed=config.seed,
        )
    if engine is None:
        # with the decode kernel (a GPU, or asked for) the cache is sized for max_prompt_length, so steps whose
        # longest prompts differ compile nothing new
        engine_config = EngineConfig(attention=config.rollout_attention, weights=config.rollout_weights,
                                     kv_cache=config.rollout_kv_cache)
        if engine_config.resolved(device).attention == "triton":
            engine_config = dataclasses.replace(engine_config, max_prompt_length=config.max_prompt_length)
        engine = BuiltinEngine(model, tokenizer, engine_config)
    if not isinstance(engine, RolloutEngine):
        raise ValueError(f"engine: expected a fastgrpo.rollout.RolloutEngine, got {type(engine).__name__}")
    return engine



def rollout_batch(trainer, prompt_ids: list[list[int]], keys: list[int]) -> dict:
    """Generate with `trainer`'s engine (a GRPOTrainer: its engine, model, dist, config, sampling, step, device) and
    lay out [prompt | completion] rows: input_ids, attention_mask, completion_mask [N, P + L]."""
    config, engine, device = trainer.config, trainer.engine, trainer.device
    # The weights of the last optimizer step (or of a resumed checkpoint) reach the engine before it samples.
    engine.load_weights(trainer.model)
    # A seed per step (not the global RNG) makes a resumed run sample exactly what the straight run did.
    engine.reacquire_memory()
    out = trainer.dist.generate(
        engine, prompt_ids, keys, num_generations=config.num_generations, sampling=trainer.sampling,
        stop=config.stop_strings, seed=config.seed * 1_000_003 + trainer.step,
    )
    engine.release_memory()
    prompt_mask, completion_mask = out.prompt_mask.long(), out.completion_mask.long()  # [N, P], [N, L]
    return {
        "input_ids": torch.cat([out.prompt_ids, out.completion_ids], 1).to(device),  # [N, P + L]
        "attention_mask": torch.cat([prompt_mask, completion_mask], 1).to(device),
        "completion_mask": torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1).to(device),
        "texts": list(out.texts),
        "finish_reasons": list(out.finish_reasons),
        "rollout_logps": torch.cat([prompt_mask * 0.0, out.logprobs.float()], 1).to(device),  # the engine's
    }
