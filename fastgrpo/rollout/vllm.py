"""VLLMEngine: vLLM (0.24) in the trainer's process and on its GPU, behind the RolloutEngine interface.

Weights. vLLM allocates its model without reading a checkpoint (load_format="dummy"); the trainer's values are
copied in once and the trainer's parameters become views of vLLM's tensors (fastgrpo.rollout.vllm_weights), so
the base weights are stored once and an optimizer step is what the next rollout runs. What cannot alias is
copied by `load_weights` each step, in memory: LoRA-adapted weights merged with the adapter (lora_sync="merge",
the default), or every weight with share_weights=False. lora_sync="adapter" sends the adapter tensors through
vLLM's LoRA path instead (fastgrpo.rollout.vllm_lora), so vLLM's base is the trainer's frozen base.

KV cache. It lives in vLLM's CuMem pool (enable_sleep_mode). vLLM's sleep() would also unmap the weights, which
are now the trainer's, so `release_memory` unmaps the KV cache's pages alone and `reacquire_memory` maps them back
at the same addresses (CUDA graphs stay valid) through vLLM's own wake-up, then drops the prefix cache (the pages
come back holding garbage). vLLM's CuMem pool is one per process: a second engine in the same process must pass
release=False.

Log-probs are vLLM's processed_logprobs: under the sampling distribution (after penalties, temperature, top-k/p),
as the built-in engine returns them; greedy (temperature 0) gives those at temperature 1.

Side effects of building vLLM in-process that are undone here: it reseeds Python's, NumPy's and torch's global
RNGs, sets torch's float32 matmul precision to "highest" and gc.freeze()s every live object. Left in place: a
one-process torch.distributed group, and VLLM_ENABLE_V1_MULTIPROCESSING=0 for the rest of the process.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import os
import random
import tempfile

import torch

from fastgrpo._checks import check_choice
from fastgrpo.hf.models import is_peft_model, unwrap_peft
from fastgrpo.rollout.base import RolloutResult
from fastgrpo.rollout.requests import (
    check_request,
    check_tokenizer,
    pad_token_id,
    split_stop,
    stop_token_ids,
    tokenize_prompts,
)
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.vllm_requests import check_prompt_keys, fan_out, request_seeds, sampling_kwargs, to_result
from fastgrpo.rollout.vllm_settings import BUILTIN_ENGINE
from fastgrpo.rollout.vllm_weights import bind

VLLM_VERSION = "0.24.0"
INSTALL_HINT = f'pip install "fastgrpo[vllm]" (vllm=={VLLM_VERSION})'
LORA_SYNCS = ("adapter", "merge")
EXECUTIONS = ("graphs", "compile", "eager")
ADAPTER = ("fastgrpo", 1, "mem://fastgrpo/adapter")  # name, id, path of the one LoRA adapter


def require_vllm():
    """The vllm module, or a one-line ValueError naming the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ValueError(f"rollout_engine 'vllm' needs vLLM: {INSTALL_HINT}; import failed: {err}") from None
    return vllm


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def default_kv_cache_bytes(config, dtype: torch.dtype, max_num_seqs: int, max_model_len: int, block: int = 16) -> int:
    """KV bytes for max_num_seqs sequences of max_model_len tokens in vLLM's blocks, plus one block each (a rollout
    batch never waits for memory) and 64 MiB."""
    blocks = max_num_seqs * (-(-max_model_len // block) + 1)
    return blocks * block * kv_bytes_per_token(config, dtype) + (64 << 20)


def execution_kwargs(execution: str, max_num_seqs: int) -> dict:
    """vLLM constructor arguments of an execution mode.

    graphs: the decode step replayed as one CUDA graph per batch size, no torch.compile (starts in seconds);
    compile: vLLM's default, torch.compile + piecewise graphs (its first start compiles for minutes);
    eager: neither (slowest decode, quickest start; for tests).
    """
    check_choice("execution", execution, EXECUTIONS)
    if execution == "eager":
        return {"enforce_eager": True}
    if execution == "compile":
        return {}
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    return {"compilation_config": CompilationConfig(
        mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY,
        max_cudagraph_capture_size=max(1, max_num_seqs),
    )}


@contextlib.contextmanager
def _process_state_kept():
    """Undo what building an in-process vLLM engine does to the trainer's process (see the module docstring)."""
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.cuda.get_rng_state_all())
    precision = torch.get_float32_matmul_precision()
    device = torch.cuda.current_device()
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    # in-process engine core: the model is an nn.Module of this process, not of a worker process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        torch.cuda.set_rng_state_all(states[3])
        torch.set_float32_matmul_precision(precision)
        torch.cuda.set_device(device)
        gc.unfreeze()
        if previous is not None and previous != "0":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous


def check_model(model: torch.nn.Module) -> None:
    base = unwrap_peft(model)
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False) or any(
        type(p).__name__ in ("Params4bit", "Int8Params") for p in base.parameters()
    ):
        raise ValueError(f"model: vLLM cannot share a bitsandbytes-quantized base; use a bf16 base, or "
                         f"{BUILTIN_ENGINE}, which generates with the 4-bit model")
    weight = base.get_input_embeddings().weight
    if weight.device.type != "cuda":
        raise ValueError(f"model: the vLLM engine shares the model's GPU memory; move it to CUDA first "
                         f"(it is on {weight.device})")


def write_model_dir(path: str, model: torch.nn.Module, tokenizer) -> None:
    """config.json (the architecture vLLM builds), generation_config.json and the tokenizer: all vLLM reads."""
    base = unwrap_peft(model)
    config = copy.deepcopy(base.config)
    config.__dict__.pop("quantization_config", None)
    config.architectures = [type(base).__name__]
    config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)


class VLLMEngine:
    """fastgrpo's RolloutEngine on vLLM, colocated: one process and one GPU with the trainer's model.

    max_model_len: longest prompt + completion (the trainer's max_prompt_length + max_completion_length).
    max_num_seqs: rows generated at once (the trainer's batch_size). KV cache: kv_cache_bytes, else vLLM's
    gpu_memory_utilization (vLLM's share of the card for its activations and KV cache, on top of what the
    process already holds), else one rollout batch's worth (default_kv_cache_bytes).
    lora_sync: how a PEFT LoRA adapter reaches vLLM each step: "merge" (W + BA written into vLLM's own copy of
    each adapted weight; vLLM decodes the plain model; the faster on an H200, benchmarks/NOTES_vllm.md) or "adapter"
    (vLLM's LoRA path: the whole base stored once, a copy of the adapted weights less GPU memory).
    share_weights=False keeps a full copy in vLLM, refreshed by every load_weights (TRL's colocate mode).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, max_model_len: int, max_num_seqs: int = 256,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float | None = None,
                 lora_sync: str = "merge", share_weights: bool = True, execution: str = "graphs",
                 release: bool = True, seed: int = 0, max_num_batched_tokens: int = 8192) -> None:
        vllm = require_vllm()
        check_choice("lora_sync", lora_sync, LORA_SYNCS)
        check_choice("execution", execution, EXECUTIONS)
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a number in (0, 1], got {gpu_memory_utilization}")
        check_model(model)
        from fastgrpo.rollout import vllm_lora

        vllm_lora.check_lora_only(model)

        self.model, self.tokenizer, self.max_model_len = model, tokenizer, max_model_len
        base = unwrap_peft(model)
        self.vocab = base.get_input_embeddings().weight.shape[0]
        self.device = base.get_input_embeddings().weight.device
        dtype = base.get_input_embeddings().weight.dtype
        self.lora_sync = lora_sync if is_peft_model(model) and vllm_lora.lora_layers(model) else None
        # each sync's refusal, before vLLM builds its engine (minutes); without LoRA layers (a PEFT model training
        # token rows alone) what is trained still reaches vLLM merged
        merged = vllm_lora.merged_sources(model) if self.lora_sync != "adapter" else {}
        self._adapter_config = vllm_lora.adapter_config(model) if self.lora_sync == "adapter" else None
        self.release = release
        self._dir = tempfile.TemporaryDirectory(prefix="fastgrpo-vllm-")
        write_model_dir(self._dir.name, model, tokenizer)

        kwargs = dict(
            model=self._dir.name, load_format="dummy", dtype=str(dtype).removeprefix("torch."), seed=seed,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, max_model_len), enable_sleep_mode=release,
            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
            **execution_kwargs(execution, max_num_seqs),
        )
        if gpu_memory_utilization is not None and kv_cache_bytes is None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kv = kv_cache_bytes or default_kv_cache_bytes(base.config, dtype, max_num_seqs, max_model_len)
            # vLLM still checks that total x gpu_memory_utilization is free at start: ask for a sliver
            kwargs.update(kv_cache_memory_bytes=int(kv), gpu_memory_utilization=0.01)
        if self.lora_sync == "adapter":
            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=vllm_lora.vllm_rank(self._adapter_config["r"]))
        with _process_state_kept():
            self.llm = vllm.LLM(**kwargs)
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:
            raise RuntimeError("vLLM built its engine in another process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                               "before vLLM is first used in this process")
        self.worker = executor.driver_worker.worker
        self.vllm_model = self.worker.model_runner.get_model()

        self.copies = bind(model, self.vllm_model, share=share_weights, merged=merged)
        self._adapters = None
        if self.lora_sync == "adapter":
            self._adapters = vllm_lora.InMemoryAdapters(self.worker.model_runner.lora_manager)
            from vllm.lora.request import LoRARequest

            self._lora_request = LoRARequest(*ADAPTER)
            self._lora_reload = LoRARequest(*ADAPTER, load_inplace=True)
        torch.cuda.empty_cache()  # the trainer's own copies of the now-shared weights
        self._released = False
        self.load_weights(model)

    # ---- RolloutEngine ----
    def generate(self, prompts, *, num_generations: int, sampling: SamplingParams, stop=None,
                 seed: int | None = None, prompt_keys=None) -> RolloutResult:
        """`num_generations` samples of each prompt, rows grouped by prompt, with per-token log-probs.

        seed: each prompt's samples are seeded from (seed, its key in prompt_keys, default its position), so they
        do not depend on the other prompts of the call; None samples from vLLM's global generators."""
        import vllm

        check_request(num_generations, seed, sampling)
        check_tokenizer(self.tokenizer)
        stop_strings, stop_ids = split_stop(stop, self.tokenizer, self.vocab)
        prompt_ids = tokenize_prompts(self.tokenizer, prompts, self.vocab)
        pad_id = pad_token_id(self.tokenizer, self.vocab)
        seeds = request_seeds(seed, check_prompt_keys(prompt_keys, len(prompt_ids)), num_generations)
        longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        if len(prompt_ids[longest]) + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompts[{longest}]: {len(prompt_ids[longest])} tokens + max_new_tokens "
                             f"{sampling.max_new_tokens} exceeds the engine's max_model_len {self.max_model_len}")
        stop_ids = stop_token_ids(stop_ids, self.tokenizer, getattr(unwrap_peft(self.model), "generation_config", None))
        requests, n = fan_out(prompt_ids, num_generations, sampling)
        seeds = [s for s in seeds for _ in range(len(requests) // len(prompt_ids))]
        params = [vllm.SamplingParams(**sampling_kwargs(n, sampling, stop_strings, stop_ids, s)) for s in seeds]
        self.reacquire_memory()
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in requests], params, use_tqdm=False,
            lora_request=self._lora_request if self._adapters is not None else None,
        )
        return to_result(outputs, self.tokenizer, pad_id, num_generations, self.device, per_request=n)

    def release_memory(self) -> None:
        """Unmap the KV cache's pages (the weights stay: they are the trainer's)."""
        if not self.release or self._released:
            return
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        torch.cuda.synchronize()
        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            if data.tag == "kv_cache":
                unmap_and_release(data.handle)
        self._released = True

    def reacquire_memory(self) -> None:
        """Map the KV cache back (vLLM's wake-up of the kv_cache tag) and forget the prefix cache."""
        if not self._released:
            return
        torch.cuda.empty_cache()  # physical pages the trainer's allocator holds but does not use
        self.worker.wake_up(["kv_cache"])
        self._released = False
        self._reset_prefix_cache()

    def load_weights(self, model: torch.nn.Module) -> None:
        """Bring vLLM to the model's current weights: refresh the copies (shared weights need none), send the
        adapter, drop the prefix cache (its K/V came from the old weights)."""
        if model is not self.model:
            raise ValueError("model: the vLLM engine shares the weights of the model it was built on; build "
                             "another VLLMEngine for a different model")
        with torch.no_grad():
            for rows in self.copies:
                rows.refresh()
            if self._adapters is not None:
                from fastgrpo.rollout.vllm_lora import adapter_tensors

                self._adapters.put(ADAPTER[2], adapter_tensors(model), self._adapter_config)
                self.llm.llm_engine.add_lora(self._lora_reload)
        if not self._released:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
