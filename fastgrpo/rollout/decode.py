"""Prefill and decode with the trainer's own modules over a static KV cache (gpt-fast style).

One call: the B distinct prompts are prefilled once (left-padded to P), their K/V broadcast to the N = B x G rows
of the cache; then every decode step feeds one token per row at the same cache slot. All per-step state lives in
preallocated device tensors and is updated in place, so on CUDA the step (model forward, filters, sampling,
bookkeeping, the sampling noise) is compiled once and replayed as a CUDA graph; the host only replays.
Stop tokens are tracked on the device; the host syncs every `check_every` steps to stop early and to look for
stop strings. The graph, the cache and the buffers are locals: they are freed when the call returns.
With EngineConfig.shared_prefix the prompt's K/V stay once per group instead (rollout/kv_cache.py) and the rows'
cache slots count the generated tokens only; position ids are the same either way.
With EngineConfig.finished_rows the rows that have stopped are hidden from the decode kernel, or gathered away into
a smaller batch, at the host syncs (rollout/compaction.py).
With EngineConfig.kv_cache="fp8" the cache stores e4m3 K/V with per-vector scales (rollout/kv_cache.py), which only
the decode kernel reads.
Rotary modules that HF updates by position (rope types dynamic and longrope; a host sync) skip the update in the
decode steps, whose positions cannot change its outcome (rollout/rope_step.py).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import torch

from fastgrpo._checks import check_int_at_least
from fastgrpo.hf.models import cache_keyword, has_sliding_window
from fastgrpo.rollout.attention import CACHE_KWARG, LENGTH_KWARG, NAME as ATTENTION_NAME
from fastgrpo.rollout.compaction import FinishedRows
from fastgrpo.rollout.decode_weights import WEIGHTS, decode_weights
from fastgrpo.rollout.kv_cache import StaticKVCache, attention_masks
from fastgrpo.rollout.regional import compiled_layers, layer_indices, layer_options
from fastgrpo.rollout.rope_limits import check_rope_switch
from fastgrpo.rollout.rope_step import rotary_without_updates
from fastgrpo.rollout.sampling import SamplingParams, keyed_sample, process_logits


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # torch.compile the decode step (None: on CUDA only); on CUDA a compiled step is also replayed as a CUDA graph
    compile: bool | None = None
    check_every: int = 16  # steps between host syncs for stop conditions
    # cache length rounded up to a multiple of this, so prompts of varying length reuse one compiled step
    length_bucket: int = 128
    warmup_steps: int = 2  # compiled steps run eagerly before the graph capture
    # one-token attention: "sdpa" (one SDPA call over all M cache slots, masked), "triton" (the flash-decoding
    # kernel of fastgrpo.ops.decode_attention, reading only the filled slots; 9% / 16% faster decode steps than sdpa
    # for Qwen2.5-1.5B / Llama-3.1-8B shapes on an H100, benchmarks/NOTES_rollout.md) or "auto": "triton" on CUDA
    # and wherever an option below needs the kernel, else "sdpa". Models kept on "eager" attention ignore it.
    attention: str = "auto"
    # the Triton attention only: store each prompt's K/V once for its G samples (prefix_len = bucket(P) slots per
    # prompt, S = max_new_tokens slots per row instead of bucket(P + S); formula in rollout/kv_cache.py) and let
    # the decode kernel read it once per group. Off: after the combine kernel's rewrite it still cost Qwen2.5-1.5B
    # shapes 4% a step (H100) and Llama-3.1-8B 3% (H200; benchmarks/NOTES_rollout.md). Rows keep their own copy
    # (plain path, silently) where sharing cannot apply: G = 1, models with sliding-window layers (the window would
    # cut into the prefix per step) and models kept on "eager" attention (soft-capping: the kernel is not used there).
    shared_prefix: bool = False
    # the weights the decode steps multiply: "model" (the modules' own), or a copy of every dense linear's current
    # weight, built when decoding starts and freed when it ends: "fp8" (e4m3, half the bytes a step reads), "w8a8"
    # (that copy times activations rounded to e4m3 per row, on the FP8 tensor cores: another 2^-4 relative
    # rounding, never chosen by "auto") or "dense" (the model's dtype: one GEMM for a 4-bit base or a LoRA layer),
    # "fused" ("dense" that also copies plain weights to run q/k/v and gate/up as one GEMM each, as the FP8 kinds
    # and "dense" do where they copy all of a group), or "auto": on CUDA "fused" when its copy fits the free
    # memory, else "dense" for LoRA / 4-bit models when that fits, else "nf4" (16-bit compute, compute capability
    # 8.0 or newer), else "model". "nf4": no copy; each bitsandbytes NF4 base runs fastgrpo.ops.nf4_linear (a
    # Triton W4A16 GEMM) on its own 4-bit weight, the rest their own forward. The prefill keeps the model's own
    # (rollout/decode_weights.py).
    weights: str = "auto"
    # rows that finished (stop token or string) while others decode on (rollout/compaction.py): "keep" (they run
    # every step to the end, as pads), "skip" (attention="triton" only: the decode kernel reads none of their cache),
    # "compact" (skip, and the running rows are gathered into a batch of half the rows, a quarter..., whenever they
    # fit). Same tokens and log-probs in all three. "keep" until the others are measured on a GPU
    # (benchmarks/bench_rollout_lengths.py).
    finished_rows: str = "keep"
    # attention="triton" only: size every call's cache for prompts of up to this many tokens (cache length
    # bucket(max_prompt_length + S), shared prefix bucket(max_prompt_length)) instead of for the call's longest
    # prompt P, so calls whose prompts differ in length keep the decode step's shapes and recompile nothing. The
    # kernel reads only the filled slots: the larger cache costs memory, not attention time (sdpa reads every slot,
    # hence the restriction; models kept on "eager" attention do too, and ignore it). A longer prompt gets a cache of
    # its own size (a new compile). None: per call.
    max_prompt_length: int | None = None
    # what torch.compile compiles: "step" (the whole decode step as one graph, every layer traced and lowered) or
    # "layers" (one decoder layer's code, run by every layer, plus the sampling: rollout/regional.py; less to
    # compile, some fusions across layer boundaries lost). Either way a CUDA step is captured as one CUDA graph.
    # "layers": first call 13 s instead of 46 s for Qwen2.5-1.5B shapes on an H100 (cold compile caches), the same
    # time per token (benchmarks/NOTES_rollout.md, D5). Models outside the patch table (hf/architectures.py) fall
    # back to "step" with a warning.
    compile_scope: str = "layers"
    # what the decode KV cache stores: "model" (K/V in the model's dtype) or "fp8" (e4m3 with one fp32 scale per
    # row, slot and K/V head: 0.52x the bytes at head_dim 128, and half what the decode attention reads; layout and
    # scale choice in rollout/kv_cache.py and ops/decode_attention.py). The prefill's own attention uses its
    # unquantized K/V; decode steps attend over the e4m3 cache, so log-probs move by the quantization
    # (tests/test_fp8_kv_cache.py bounds it). Attention "triton" only (its kernel reads e4m3), with shared_prefix and
    # every finished_rows mode; not for models kept on "eager" attention (an error when the rollout starts) nor GPUs
    # before compute capability 8.9. With weights="w8a8", the fastest rollout (benchmarks/NOTES_rollout.md, D4).
    kv_cache: str = "model"

    def __post_init__(self):
        # step counts: 0 would divide by zero mid-rollout, 2.5 would sync on every 5th step only
        for name, low in (("check_every", 1), ("length_bucket", 1), ("warmup_steps", 0)):
            check_int_at_least(f"EngineConfig.{name}", getattr(self, name), low)
        if self.weights not in WEIGHTS:
            raise ValueError(f"EngineConfig.weights: expected one of {list(WEIGHTS)}, got {self.weights!r}")
        if self.attention not in ("auto", "sdpa", "triton"):
            raise ValueError(f"EngineConfig.attention: expected 'auto', 'sdpa' or 'triton', got {self.attention!r}")
        if self.finished_rows not in ("keep", "skip", "compact"):
            raise ValueError("EngineConfig.finished_rows: expected 'keep', 'skip' or 'compact', got "
                             f"{self.finished_rows!r}")
        if self.finished_rows == "skip" and self.attention == "sdpa":
            raise ValueError("EngineConfig.finished_rows='skip': needs attention='triton' or 'auto' (SDPA reads "
                             f"every slot whatever the mask), got attention={self.attention!r}")
        if self.shared_prefix and self.attention == "sdpa":
            raise ValueError("EngineConfig.shared_prefix: needs attention='triton' or 'auto' (the decode kernel "
                             f"reads the shared prefix), got attention={self.attention!r}")
        if self.compile_scope not in ("step", "layers"):
            raise ValueError(f"EngineConfig.compile_scope: expected 'step' or 'layers', got {self.compile_scope!r}")
        if self.max_prompt_length is not None and self.attention == "sdpa":
            raise ValueError("EngineConfig.max_prompt_length: needs attention='triton' or 'auto' (sdpa would "
                             "attend over every slot of the larger cache at each step), got "
                             f"attention={self.attention!r}")
        if self.kv_cache not in ("model", "fp8"):
            raise ValueError(f"EngineConfig.kv_cache: expected 'model' or 'fp8', got {self.kv_cache!r}")
        if self.kv_cache == "fp8" and self.attention == "sdpa":
            raise ValueError("EngineConfig.kv_cache='fp8': needs attention='triton' or 'auto' (the decode kernel "
                             f"reads the e4m3 cache, SDPA cannot), got attention={self.attention!r}")
        if self.max_prompt_length is not None:
            check_int_at_least("EngineConfig.max_prompt_length", self.max_prompt_length, 1, or_else=" or None")

    def resolved(self, device: torch.device) -> EngineConfig:
        """The config with attention "auto" made concrete for a model on `device`."""
        if self.attention != "auto":
            return self
        needs_kernel = (self.shared_prefix or self.max_prompt_length is not None or self.finished_rows == "skip"
                        or self.kv_cache == "fp8")
        return dataclasses.replace(self, attention="triton" if device.type == "cuda" or needs_kernel else "sdpa")


@dataclasses.dataclass
class Completions:
    tokens: torch.Tensor  # [N, S] int64, pad after the row finished
    logprobs: torch.Tensor  # [N, S] fp32, 0 after the row finished
    valid: torch.Tensor  # [N, S] bool, True up to and including the stop token
    stopped: torch.Tensor  # [N] bool, finished by a stop token or stop string


@dataclasses.dataclass
class _State:
    """Static buffers of one rollout: the decode step reads and updates them in place."""

    tokens: torch.Tensor  # [N, 1] last sampled token, fed to the next step
    positions: torch.Tensor  # [N, 1] its position id
    visible: torch.Tensor  # [N, M] bool, cache slots holding a real (non-pad) token (shared prefix: M = S)
    key_pos: torch.Tensor  # [M] slot ids
    decode_kernel: bool  # pass the filled length to the attention (EngineConfig.attention == "triton")
    seen: torch.Tensor | None  # [N, V] bool, tokens seen so far (repetition penalty only)
    keys: torch.Tensor | None  # [N] int64 per-sample noise keys (sampling only; greedy: None)
    # [V] bool, True at the stop token ids: a lookup, since torch.isin with more ids than ~10 N^0.145 (18 at N = 64)
    # sorts through torch.unique, a host sync that broke the step's CUDA-graph capture
    stops: torch.Tensor | None
    done: torch.Tensor  # [N] bool
    step: torch.Tensor  # [1] next output column
    out_tokens: torch.Tensor  # [N, S] int64
    out_logprobs: torch.Tensor  # [N, S] fp32
    out_valid: torch.Tensor  # [N, S] bool


def rollout(
    model: torch.nn.Module,
    prompts: list[list[int]],
    num_generations: int,
    params: SamplingParams,
    *,
    stop_ids: list[int],
    pad_id: int,
    keys: torch.Tensor | None,
    stop_check: Callable[[torch.Tensor, list[int], list[int]], list[int]] | None = None,
    config: EngineConfig = EngineConfig(),
) -> Completions:
    """Generate params.max_new_tokens (or until every row stops) for each of the G copies of each prompt.

    keys: [N] int64 per-sample keys (sampling.row_keys), or None for greedy decoding.
    stop_check(tokens [n, s] on the host, rows still running, call_rows: [n] the call's row of each row of tokens, as
    compacted) -> rows that hit a stop string; called at each sync.
    """
    device = _device_of(model)
    config = config.resolved(device)
    G, S = num_generations, params.max_new_tokens
    P = max(len(p) for p in prompts)
    check_rope_switch(model.config, [len(p) for p in prompts], S)
    # the prompt slots to allocate: max_prompt_length's, unless a prompt is longer (e.g. an evaluation's: it gets a
    # cache of its own size, one more compile) or the model reads every slot (kept on "eager" attention)
    fixed = config.max_prompt_length is not None and model.config._attn_implementation != "eager"
    P_cache = max(P, config.max_prompt_length) if fixed else P
    dtype = model.get_input_embeddings().weight.dtype
    cache_kw = cache_keyword(model)
    fp8 = config.kv_cache == "fp8"
    if fp8 and model.config._attn_implementation != ATTENTION_NAME:
        raise ValueError(f"EngineConfig.kv_cache='fp8': needs the engine's attention ({ATTENTION_NAME}), whose decode "
                         f"kernel reads e4m3; this model runs {model.config._attn_implementation!r} (models kept on "
                         "'eager' attention, e.g. soft-capping gemma2, cannot); use kv_cache='model'")
    if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"EngineConfig.kv_cache='fp8': e4m3 needs a GPU of compute capability 8.9 or newer (Ada, "
                         f"Hopper); {torch.cuda.get_device_name(device)} is "
                         f"{torch.cuda.get_device_capability(device)}; use kv_cache='model'")

    # prompt: [B, P] left-padded; offset: [B] first real slot
    prompt = left_pad(prompts, pad_id)[0].to(device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    offset = P - lengths
    slots = torch.arange(P, device=device)
    real = slots[None, :] >= offset[:, None]  # [B, P]
    if _shares_prefix(model, G, config):
        # the prompt once per group, in bucket(P) slots so prompts of other lengths reuse the compiled step; the
        # rows cache only their S generated tokens (slot 0 on), all real: positions still continue the prompt's
        cache = StaticKVCache(G, S, device, prefix_len=_bucket(P_cache, config), fp8=fp8)
        prefix_slots = torch.arange(cache.prefix_len, device=device)
        cache.prefix_visible = (prefix_slots[None, :] >= offset[:, None]) & (prefix_slots[None, :] < P)
        key_pos = torch.arange(S, device=device)
        visible = torch.ones(len(prompts) * G, S, dtype=torch.bool, device=device)  # visible: [N, S]
        first_slot = 0
    else:
        M = _bucket(P_cache + S, config)
        cache = StaticKVCache(G, M, device, fp8=fp8)
        key_pos = torch.arange(M, device=device)
        visible = (key_pos[None, :] >= offset[:, None]).repeat_interleave(G, dim=0)  # visible: [N, M]
        first_slot = P

    with torch.no_grad():
        logits = _prefill(model, cache, cache_kw, prompt, real, slots, offset, dtype)
        logits = logits.repeat_interleave(G, dim=0)  # [N, V]
        state = _new_state(prompt, real, visible, key_pos, G, S, logits.shape[-1], params, stop_ids, keys,
                           decode_kernel=config.attention == "triton")
        state.positions.copy_(lengths.repeat_interleave(G)[:, None])
        cache.slot.fill_(first_slot)
        _record(state, *_sample_logits(logits, params, state), pad_id)
        del logits
        rows = FinishedRows(config.finished_rows, state, cache, G)
        steps_done = 1  # the prefill sampled the first token
        with decode_weights(model, config.weights), rotary_without_updates(model):
            while True:  # once, unless finished_rows="compact" stops the loop to go on with fewer rows
                step = functools.partial(_decode_step, model, cache, cache_kw, rows.state, params, pad_id, dtype)
                check = functools.partial(stop_check, call_rows=rows.call_rows) if stop_check else None
                steps_done = _decode(step, model, rows.state, S, check, config, steps_done, pause=rows.at_sync)
                if not rows.pending:
                    break
                rows.compact()
        rows.finish(pad_id)
    return Completions(
        tokens=state.out_tokens[:, :steps_done],
        logprobs=state.out_logprobs[:, :steps_done],
        valid=state.out_valid[:, :steps_done],
        stopped=state.done.clone(),
    )


def _bucket(length: int, config: EngineConfig) -> int:
    """length rounded up to a multiple of config.length_bucket (cache lengths: fewer distinct compiled shapes)."""
    return -(-length // config.length_bucket) * config.length_bucket


def _shares_prefix(model, G: int, config: EngineConfig) -> bool:
    """Whether this rollout stores each prompt's K/V once per group (EngineConfig.shared_prefix)."""
    if not config.shared_prefix or G == 1:
        return False
    if has_sliding_window(model.config):
        return False
    implementation = model.config._attn_implementation
    if implementation == "eager":  # kept on eager by _rollout_mode (soft-capping): a documented model property
        return False
    if implementation != ATTENTION_NAME:
        warnings.warn(f"rollout: shared_prefix needs the engine's attention ({ATTENTION_NAME}), the model runs "
                      f"{implementation!r}; decoding without a shared prefix", stacklevel=3)
        return False
    return True


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [B, P] int64 left-padded with pad_id, mask [B, P] int64: 1 on real tokens), on the CPU."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids, mask


def _decode(step, model, state: _State, S: int, stop_check, config: EngineConfig, steps_done: int = 1,
            pause: Callable[[], bool] | None = None) -> int:
    """Run decode steps until S tokens, every row stopped or pause() (called at the host syncs) says so; returns the
    number of tokens per row generated. steps_done: the tokens per row so far.

    The CUDA graph and its memory pool live in this frame: they are freed when it returns.
    """
    device = state.done.device
    run = step
    if config.compile or (config.compile is None and device.type == "cuda"):
        compiled = functools.partial(step, forward=_compiled_forward(model, config))
        run = _GraphedStep(compiled, step, config.warmup_steps) if device.type == "cuda" else compiled
    while steps_done < S:
        run()
        steps_done += 1
        if steps_done % config.check_every == 0:  # the only host syncs of the loop
            if stop_check is not None:
                _check_stop_strings(state, steps_done, stop_check)
            if bool(state.done.all()):
                break
            if pause is not None and steps_done < S and pause():
                break
    return steps_done


def _prefill(model, cache, cache_kw, prompt, visible, slots, offset, dtype) -> torch.Tensor:
    """Run the prompts once, filling the cache for every row of their groups; last-position logits [B, V]."""
    cache.prefilling = True
    positions = (slots[None, :] - offset[:, None]).clamp(min=0)  # [B, P]
    masks = attention_masks(model.config, visible, slots, slots, dtype)
    out = model(
        input_ids=prompt, position_ids=positions, attention_mask=masks, use_cache=True, logits_to_keep=1,
        **{cache_kw: cache},
    )
    cache.prefilling = False
    return out.logits[:, -1]


def _forward_sample(model, cache, cache_kw, state, params, dtype):
    """One decode forward at cache.slot for all rows, then filters and sampling: (tokens [N], logprobs [N])."""
    return _sample_logits(_logits(model, cache, cache_kw, state, dtype), params, state)


def _logits(model, cache, cache_kw, state, dtype) -> torch.Tensor:
    """One decode forward at cache.slot for all rows: next-token logits [N, V]."""
    masks = attention_masks(model.config, state.visible, cache.slot, state.key_pos, dtype)
    # the slots written so far, this step's included: [1] on the device, read by the decode kernel
    kernel = {LENGTH_KWARG: cache.slot + 1} if state.decode_kernel else {}
    if cache.shares_prefix or cache.fp8:  # the attention reads each layer's prompt K/V or scales from the cache
        kernel[CACHE_KWARG] = cache
    out = model(
        input_ids=state.tokens, position_ids=state.positions, attention_mask=masks, use_cache=True,
        logits_to_keep=1, **{cache_kw: cache}, **kernel,
    )
    return out.logits[:, -1]


def _sample_logits(logits, params, state):
    """Filters and sampling of one step's logits [N, V]: (tokens [N], logprobs [N])."""
    # the noise of column state.step (greedy: no keys) is a function of the keys alone
    return keyed_sample(process_logits(logits, params, state.seen), state.keys, state.step)


@functools.cache
def _compiled(fn, options: tuple = ()):
    # dynamic=False: N, M fixed per call (M bucketed or max_prompt_length's), as CUDA graphs need; options: Inductor's
    return torch.compile(fn, dynamic=False, options=dict(options) or None)


def _compiled_forward(model, config: EngineConfig):
    """The step's forward and sampling as config.compile_scope compiles it."""
    if config.compile_scope == "step":
        return _compiled(_forward_sample)
    layers, options = layer_indices(model), layer_options(config.weights)
    if layers is None:
        warnings.warn(f"rollout: compile_scope='layers' does not know the decoder layers of "
                      f"{type(model).__name__}; compiling the whole step", stacklevel=4)
        return _compiled(_forward_sample)

    def forward(model, cache, cache_kw, state, params, dtype):
        with compiled_layers(layers, cache, cache_kw, lambda fn: _compiled(fn, options)):
            logits = _logits(model, cache, cache_kw, state, dtype)
        return _compiled(_sample_logits)(logits, params, state)

    return forward


def _decode_step(model, cache, cache_kw, state, params, pad_id, dtype, forward=_forward_sample) -> None:
    tokens, logprobs = forward(model, cache, cache_kw, state, params, dtype)
    _record(state, tokens, logprobs, pad_id)
    state.positions += 1
    cache.slot += 1


def _record(state: _State, tokens: torch.Tensor, logprobs: torch.Tensor, pad_id: int) -> None:
    """Write the sampled tokens [N] at column state.step; rows already done get pad and mask 0."""
    alive = ~state.done
    state.out_tokens.index_copy_(1, state.step, torch.where(alive, tokens, pad_id)[:, None])
    state.out_logprobs.index_copy_(1, state.step, torch.where(alive, logprobs, 0.0)[:, None])
    state.out_valid.index_copy_(1, state.step, alive[:, None])
    if state.stops is not None:
        state.done |= state.stops[tokens]
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)
    state.tokens.copy_(tokens[:, None])
    state.step += 1


class _GraphedStep:
    """The decode step, compiled; after `warmup` plain calls it is captured once and replayed as a CUDA graph.

    If compiling or capturing fails (an op the compiler or the graph cannot take), warn and keep going on the
    slower path, so a rollout never fails for speed's sake.
    """

    def __init__(self, compiled: Callable[[], None], eager: Callable[[], None], warmup: int):
        self.step = compiled
        self.eager = eager
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capturable = True
        self.stream = torch.cuda.Stream()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if self.warmup > 0 or not self.capturable:
            self._warm()
            return
        try:
            graph = torch.cuda.CUDAGraph()
            # on this step's own stream: torch.cuda.graph's default capture stream is one per process, made on the
            # device current at its first capture (a rollout on another GPU later would capture on it)
            with torch.cuda.graph(graph, stream=self.stream):
                self.step()
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to the compiled step
            warnings.warn(f"rollout: CUDA graph capture failed ({err!r}); decoding without graphs", stacklevel=2)
            self.capturable = False
            self._warm()
            return
        self.graph = graph
        self.graph.replay()

    def _warm(self) -> None:
        # side stream, as CUDA graph warm-up must be (cuBLAS/cuDNN workspaces, lazy init)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            try:
                self.step()
            except Exception as err:  # noqa: BLE001 - compile failure: finish the rollout eagerly
                if self.step is self.eager:
                    raise
                warnings.warn(f"rollout: torch.compile of the decode step failed ({err!r}); decoding eagerly",
                              stacklevel=3)
                self.step = self.eager
                self.step()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.warmup -= 1


def _stop_table(stop_ids: list[int], V: int, device) -> torch.Tensor | None:
    """[V] bool, True at each stop id below V (an id past the logits can never be sampled); None without any."""
    ids = [i for i in set(stop_ids) if 0 <= i < V]
    if not ids:
        return None
    table = torch.zeros(V, dtype=torch.bool, device=device)
    table[torch.tensor(ids, device=device)] = True
    return table


def _new_state(
    prompt, real, visible, key_pos, G, S, V, params, stop_ids, keys, decode_kernel: bool = False
) -> _State:
    """prompt, real: [B, P] ids and real-token mask; visible: [N, M] the decode cache's real slots, key_pos: [M]."""
    device = prompt.device
    N = prompt.shape[0] * G
    seen = None
    if params.uses_seen_tokens:
        # seen: [B, V] from the prompt's real tokens (scatter_add: pads and repeats must not race)
        counts = torch.zeros(prompt.shape[0], V, dtype=torch.int32, device=device)
        counts.scatter_add_(1, prompt, real.int())
        seen = (counts > 0).repeat_interleave(G, dim=0)
    sampled = not params.greedy
    return _State(
        tokens=torch.zeros(N, 1, dtype=torch.long, device=device),
        positions=torch.zeros(N, 1, dtype=torch.long, device=device),
        visible=visible,
        key_pos=key_pos,
        decode_kernel=decode_kernel,
        seen=seen,
        keys=keys.to(device) if sampled else None,
        stops=_stop_table(stop_ids, V, device),
        done=torch.zeros(N, dtype=torch.bool, device=device),
        step=torch.zeros(1, dtype=torch.long, device=device),
        out_tokens=torch.zeros(N, S, dtype=torch.long, device=device),
        out_logprobs=torch.zeros(N, S, dtype=torch.float32, device=device),
        out_valid=torch.zeros(N, S, dtype=torch.bool, device=device),
    )


def _check_stop_strings(state: _State, steps_done: int, stop_check) -> None:
    running = (~state.done).nonzero()[:, 0].tolist()
    if not running:
        return
    hit = stop_check(state.out_tokens[:, :steps_done].cpu(), running)
    if hit:
        state.done[torch.tensor(hit, device=state.done.device)] = True


def _device_of(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device
