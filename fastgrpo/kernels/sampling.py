"""The decode step's sampling in three small kernels: tokens [N] and their fp32 log-probs [N] from logits [N, V],
by the exponential race on rollout.sampling's keyed noise (or greedy), with the bits of `sample(logits.float(),
keyed_exponential(keys, position, mix32(arange(V))))`.

Why: Inductor cannot split log_softmax + argmax over a row, so the compiled torch path runs one program per row (64
programs for 132 SMs at 64 rows), and its noise hash runs in int64 with every multiply split in two (_mul32): 123 us
a decode step at 64 x 151936 (Qwen2.5-1.5B) on an H200, ~4.7% of the step. Here each row's vocabulary is split into
chunks of `block * blocks_per_chunk` elements, one program each, and the hash runs in uint32 (wrap-around is defined
in Triton/LLVM and in numpy, which the interpreter uses).

  1. _chunk_sums_kernel, grid (N, chunks): each chunk's max m_c and sum of exp(x - m_c) (online over its blocks).
  2. _chunk_best_kernel, grid (N, chunks): the row's max M = max m_c and log S, S = sum_c s_c exp(m_c - M), from the
     partials (every program of a row computes the same bits), then each element's score as `sample` computes it:
     logp = (x - M) - log S (log_softmax's order), noisy: E = -log(u), u = ((bits >> 8) + 0.5) 2^-24, bits =
     mix32(mix32(step_key ^ mix32(v)) ^ second), score = logp - log(max(E, fp32 tiny)); the chunk's best score and
     its first index.
  3. _pick_kernel, grid (N,): the first chunk holding the row's best score -> token; logp = (x[token] - M) - log S.
Ties go to the first index, as torch's argmax. S is summed in another order than log_softmax's, so log-probs can
differ from torch's in the last bits, and a near-tie between the two best scores may resolve the other way
(tests/test_sampling_kernel.py bounds both).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.cards import sm_count

BLOCK = 2048  # elements per load on a GPU (fp32: 16 per thread at 4 warps)
NUM_WARPS = 4
PROGRAMS_PER_SM = 8  # blocks_per_chunk is chosen so that N x chunks fills the SMs about this many times over
MAX_BLOCKS_PER_CHUNK = 8
INTERPRET_BLOCK, INTERPRET_BLOCKS_PER_CHUNK = 16, 2  # small tests cross blocks, chunks and ragged tails
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny: `sample` clamps draws at it
U24 = tl.constexpr(5.9604644775390625e-08)  # 2^-24


@triton.jit
def _mix32(x):
    """Wellons' lowbias32 on uint32: rollout.sampling.mix32's bits (multiplies wrap, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform(offs, step_key, second):
    """keyed_uniform's u of vocabulary ids offs for one row (step_key, second: uint32), its exact bits."""
    bits = _mix32(_mix32(step_key ^ _mix32(offs.to(tl.uint32))) ^ second)
    return ((bits >> 8).to(tl.float32) + 0.5) * U24  # in (0, 1]: 1 - 2^-25 rounds to 1


@triton.jit
def _row_max_and_log_sum(MAXES, SUMS, row, chunks, CHUNKS_P2: tl.constexpr):
    """The row's max M and log S, S = sum of exp(x - M), from its chunks' partials."""
    cs = tl.arange(0, CHUNKS_P2)
    maxes = tl.load(MAXES + row * chunks + cs, mask=cs < chunks, other=float("-inf"))
    sums = tl.load(SUMS + row * chunks + cs, mask=cs < chunks, other=0.0)
    top = tl.max(maxes, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)  # a row of -inf: no inf - inf
    return top, tl.log(tl.sum(sums * tl.exp(maxes - safe), axis=0))


@triton.jit
def _chunk_sums_kernel(LOGITS, MAXES, SUMS, stride_row, V, chunks,
                       BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    x_row = LOGITS + row.to(tl.int64) * stride_row
    start = chunk * BLOCK * BLOCKS_PER_CHUNK
    top = float("-inf")
    total = 0.0
    for b in range(BLOCKS_PER_CHUNK):
        offs = start + b * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - safe) + tl.sum(tl.exp(x - safe), axis=0)
        top = new_top
    tl.store(MAXES + row * chunks + chunk, top)
    tl.store(SUMS + row * chunks + chunk, total)


@triton.jit
def _chunk_best_kernel(LOGITS, STEP_KEYS, SECOND, MAXES, SUMS, BEST, BEST_INDEX, stride_row, V, chunks,
                       NOISY: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCKS_PER_CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    top, log_sum = _row_max_and_log_sum(MAXES, SUMS, row, chunks, CHUNKS_P2)
    x_row = LOGITS + row.to(tl.int64) * stride_row
    start = chunk * BLOCK * BLOCKS_PER_CHUNK
    if NOISY:
        step_key = tl.load(STEP_KEYS + row).to(tl.uint32)
        second = tl.load(SECOND + row).to(tl.uint32)
    best = float("-inf")
    best_index = start  # a chunk of -inf scores picks its first token, as argmax does
    for b in range(BLOCKS_PER_CHUNK):
        offs = start + b * BLOCK + tl.arange(0, BLOCK)
        # past V: -inf, a score of -inf (never better than a real token's, which comes first on a tie)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        score = (x - top) - log_sum
        if NOISY:
            draw = -tl.log(_uniform(offs, step_key, second))  # E ~ Exp(1)
            score = score - tl.log(tl.maximum(draw, FP32_TINY))
        block_best = tl.max(score, axis=0)
        block_index = start + b * BLOCK + tl.argmax(score, axis=0, tie_break_left=True)
        better = block_best > best  # strictly: an earlier block keeps a tie
        best_index = tl.where(better, block_index, best_index)
        best = tl.maximum(best, block_best)
    tl.store(BEST + row * chunks + chunk, best)
    tl.store(BEST_INDEX + row * chunks + chunk, best_index)


@triton.jit
def _pick_kernel(LOGITS, MAXES, SUMS, BEST, BEST_INDEX, TOKENS, LOGPS, stride_row, chunks,
                 CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0)
    cs = tl.arange(0, CHUNKS_P2)
    best = tl.load(BEST + row * chunks + cs, mask=cs < chunks, other=float("-inf"))
    first = tl.argmax(best, axis=0, tie_break_left=True)  # padding comes last: it never wins a tie
    token = tl.load(BEST_INDEX + row * chunks + first)
    top, log_sum = _row_max_and_log_sum(MAXES, SUMS, row, chunks, CHUNKS_P2)
    x = tl.load(LOGITS + row.to(tl.int64) * stride_row + token).to(tl.float32)
    tl.store(TOKENS + row, token.to(tl.int64))
    tl.store(LOGPS + row, (x - top) - log_sum)


def blocks_per_chunk_for(N: int, V: int, block: int, sms: int) -> int:
    """Blocks of `block` elements per program: as many as keep N x chunks >= PROGRAMS_PER_SM x sms (each program's
    partials and the row's combine stay few), at most MAX_BLOCKS_PER_CHUNK. 64 x 151936 on 132 SMs: 4 (chunks of
    8192, 19 a row, 1216 programs)."""
    per_program = N * triton.cdiv(V, block) // (PROGRAMS_PER_SM * sms)
    return max(1, min(MAX_BLOCKS_PER_CHUNK, per_program))


def keyed_sample(logits: torch.Tensor, step_keys: torch.Tensor | None, second: torch.Tensor | None,
                 block: int | None = None, blocks_per_chunk: int | None = None,
                 num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (fp32 / bf16 / fp16, unit stride along V), step_keys and second [N] int64 in [0, 2**32) (the
    noise's per-row words, rollout.sampling.step_words) or both None (greedy) -> tokens [N] int64, logps [N] fp32.
    block, blocks_per_chunk: the split (default: BLOCK and blocks_per_chunk_for's on a GPU, tiny under the
    interpreter)."""
    N, V = logits.shape
    interpret = not logits.is_cuda
    if block is None:
        block = INTERPRET_BLOCK if interpret else BLOCK
    if blocks_per_chunk is None:
        blocks_per_chunk = (INTERPRET_BLOCKS_PER_CHUNK if interpret
                            else blocks_per_chunk_for(N, V, block, sm_count(logits.device)))
    chunks = triton.cdiv(V, block * blocks_per_chunk)
    chunks_p2 = triton.next_power_of_2(chunks)
    f32 = dict(dtype=torch.float32, device=logits.device)
    maxes, sums, best = (torch.empty(N, chunks, **f32) for _ in range(3))
    best_index = torch.empty(N, chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(N, dtype=torch.int64, device=logits.device)
    logps = torch.empty(N, **f32)
    launch = {} if interpret else dict(num_warps=num_warps)
    stride = logits.stride(0)
    _chunk_sums_kernel[(N, chunks)](logits, maxes, sums, stride, V, chunks, BLOCK=block,
                                    BLOCKS_PER_CHUNK=blocks_per_chunk, **launch)
    noisy = step_keys is not None
    _chunk_best_kernel[(N, chunks)](
        logits, step_keys if noisy else tokens, second if noisy else tokens, maxes, sums, best, best_index, stride,
        V, chunks, NOISY=noisy, CHUNKS_P2=chunks_p2, BLOCK=block, BLOCKS_PER_CHUNK=blocks_per_chunk, **launch)
    _pick_kernel[(N,)](logits, maxes, sums, best, best_index, tokens, logps, stride, chunks, CHUNKS_P2=chunks_p2)
    return tokens, logps


def keyed_uniforms(step_keys: torch.Tensor, second: torch.Tensor, V: int) -> torch.Tensor:
    """The uniforms u [N, V] fp32 behind the draws the kernel races with (E = -log u): a debug entry for tests."""
    out = torch.empty(step_keys.shape[0], V, dtype=torch.float32, device=step_keys.device)
    _uniform_kernel[(step_keys.shape[0],)](step_keys, second, out, V, BLOCK=triton.next_power_of_2(V))
    return out


@triton.jit
def _uniform_kernel(STEP_KEYS, SECOND, OUT, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    u = _uniform(offs, tl.load(STEP_KEYS + row).to(tl.uint32), tl.load(SECOND + row).to(tl.uint32))
    tl.store(OUT + row * V + offs, u, mask=offs < V)
