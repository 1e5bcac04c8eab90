"""The checks of GRPOConfig's rollout-engine fields, before any model is loaded."""
from __future__ import annotations

import importlib.util

from fastgrpo._checks import check_choice
from fastgrpo.hf.models import loading_attention
from fastgrpo.rollout.decode_weights import WEIGHTS
from fastgrpo.rollout.vllm import EXECUTIONS, INSTALL_HINT, LORA_SYNCS
from fastgrpo.train.naming import setting

ROLLOUT_ENGINES = ("builtin", "vllm")


def check_rollout_options(config) -> None:
    """One line naming the field for a choice the engine does not have or a combination it cannot run."""
    check_choice("rollout_engine", config.rollout_engine, ROLLOUT_ENGINES)
    check_choice("rollout_attention", config.rollout_attention, ("auto", "sdpa", "triton"))
    check_choice("rollout_weights", config.rollout_weights, WEIGHTS)
    check_choice("rollout_kv_cache", config.rollout_kv_cache, ("model", "fp8"))
    check_choice("vllm_lora_sync", config.vllm_lora_sync, LORA_SYNCS)
    check_choice("vllm_execution", config.vllm_execution, EXECUTIONS)
    utilization = config.vllm_gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        raise ValueError(f"vllm_gpu_memory_utilization: expected a number in (0, 1] or none, got {utilization}")
    for name, default in (("rollout_attention", "auto"), ("rollout_weights", "auto"),
                          ("rollout_kv_cache", "model")):
        if config.rollout_engine == "vllm" and getattr(config, name) != default:
            raise ValueError(f"{name}: applies to the builtin engine; with {setting('rollout_engine', 'vllm')} "
                             f"leave it {default} (got {getattr(config, name)!r})")
    if config.rollout_kv_cache == "fp8" and config.rollout_attention == "sdpa":
        raise ValueError("rollout_kv_cache: fp8 is read by the decode kernel; use "
                         f"{setting('rollout_attention', 'triton')} or 'auto', not 'sdpa'")
    if config.rollout_engine == "vllm" and config.load_in_4bit:
        raise ValueError(f"rollout_engine: vllm cannot share a 4-bit base's weights; use "
                         f"{setting('rollout_engine', 'builtin')} with {setting('load_in_4bit', True)}, or a bf16 "
                         "base with vllm")
    if config.rollout_engine == "vllm" and config.device == "cpu":
        raise ValueError(f"rollout_engine: vllm runs on a CUDA GPU; pass {setting('device', 'cuda')} (the built-in "
                         "task's preset is the CPU)")


def check_kv_cache_before_load(config) -> None:
    """rollout_kv_cache fp8 against config.model's attention, from its config.json: a model whose transformers class
    has no SDPA attention (gemma2: it soft-caps its scores) decodes on eager (rollout.attention.rollout_attention),
    which cannot read the e4m3 cache; refused now rather than at the first rollout, once the model has loaded. The
    built-in model and a config.json that cannot be read (the load says why) pass."""
    if config.rollout_kv_cache != "fp8" or config.model is None:
        return
    from transformers import AutoConfig

    try:
        eager = loading_attention(config.model) == "eager"
        cap = getattr(AutoConfig.from_pretrained(config.model), "attn_logit_softcapping", None)
    except Exception:  # noqa: BLE001 - whatever it is, loading the model reports it
        return
    if eager:
        why = f"its config sets attn_logit_softcapping {cap}" if cap is not None else "no SDPA in transformers"
        raise ValueError(f"rollout_kv_cache: fp8 is read by the decode kernel, which cannot run {config.model}'s "
                         f"attention (eager: {why}); use {setting('rollout_kv_cache', 'model')}")


def check_engine_installed(config) -> None:
    """vllm importable where the run asks for it: found (importlib's find_spec, without importing it: seconds) before
    the model loads rather than once it has. A vllm that is there and fails to import is the engine's to report."""
    if config.rollout_engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"rollout_engine: vllm is not installed; {INSTALL_HINT}, or pass "
                         f"{setting('rollout_engine', 'builtin')}")
