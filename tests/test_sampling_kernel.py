"""The sampling kernels (fastgrpo.kernels.sampling) against rollout.sampling's torch path, today's engine sampler:
the noise's bits, tokens and log-probs (noisy and greedy) over odd shapes and splits, fp32 and bf16 logits,
first-index ties, filtered (-inf) tokens, the custom op; on a GPU, 64 x 151936 compiled and graph-captured.

Tolerance, derived from how the two compute a log-prob: both take M = the row's max (exact) and logp = (x - M) -
log S, S = sum of exp(x - M); only S differs (the kernel sums per chunk, rescales each chunk's sum by exp(m_c - M)
and adds the chunks; log_softmax sums in its own order). Each fp32 sum of positive terms is within (depth + 4) u of
the exact one (u = 2^-24; depth: the longest chain of additions any term passes, at most log2(V) + 8 for the
kernel's trees and blocks_per_chunk <= 8 sequential blocks, and for torch's cascaded sums; + 4 for the exps and the
rescale), so |log S_kernel - log S_torch| <= SIGMA = 2 (log2(V) + 12) u, and a log-prob differs by at most SIGMA plus
one ulp of it (the final rounding). A score (logp - log E) adds the draw's log: numpy's and torch's log may differ by
an ulp of E (u in log E) and of log E, and one more ulp of the score. The two best scores can each move by that
much, so the tokens must match wherever the reference's best beats its second by more than twice it.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.kernels import sampling as kernels
from fastgrpo.kernels.sampling import keyed_sample as kernel_sample
from fastgrpo.kernels.sampling import keyed_uniforms
from fastgrpo.rollout import sampling
from tests.sm90_compile import sm90_compile_output
from fastgrpo.rollout.sampling import (
    _keyed_sample_op,
    keyed_exponential,
    keyed_sample,
    keyed_uniform,
    mix32,
    sample,
    step_words,
)

U = 2.0**-24
NEG = float("-inf")


def sigma(V: int) -> float:
    """The bound on |log S_kernel - log S_torch| (module docstring)."""
    return 2 * (math.log2(V) + 12) * U


def ulp(t: torch.Tensor) -> torch.Tensor:
    """fp32's spacing at |t| (relative 2^-23 above the smallest normals; 0 where t is -inf)."""
    return torch.where(torch.isfinite(t), t.abs() * 2.0**-23 + torch.finfo(torch.float32).tiny, 0.0)


def reference(logits: torch.Tensor, keys: torch.Tensor | None, position: torch.Tensor):
    """`sample`'s (tokens, logps) on the fp32 logits, and each element's score [N, V] and its tolerance [N, V]."""
    x = logits.float()
    noise = None if keys is None else keyed_exponential(keys, position, mix32(torch.arange(x.shape[-1],
                                                                                           device=x.device)))
    logp = torch.log_softmax(x, dim=-1)
    tol = sigma(x.shape[-1]) + ulp(logp)
    scores = logp
    if noise is not None:
        log_draw = noise.clamp_min(torch.finfo(torch.float32).tiny).log()
        scores = logp - log_draw
        tol = tol + ulp(log_draw) + 2 * U + ulp(scores)
    return (*sample(x, noise), scores, tol)


def assert_within_tolerance(tokens, logps, want_tokens, want_logps, scores, tol, min_clear: int = 0):
    """Log-probs within sigma + an ulp; tokens equal wherever the best score beats the second by more than the sum
    of their tolerances (module docstring), on at least min_clear rows; never a filtered token."""
    assert tokens.dtype == torch.int64 and logps.dtype == torch.float32
    logp_tol = sigma(scores.shape[-1]) + ulp(want_logps)
    assert torch.all((logps - want_logps).abs() <= logp_tol), (logps - want_logps).abs().max()
    if scores.shape[-1] > 1:
        top2, at = scores.topk(2, dim=-1)
        clear = (top2[:, 0] - top2[:, 1]) > tol.gather(1, at).sum(-1)
    else:
        clear = torch.ones_like(tokens, dtype=torch.bool)
    assert int(clear.sum()) >= min_clear
    assert torch.equal(tokens[clear], want_tokens[clear]), (tokens, want_tokens, clear)
    assert torch.isfinite(scores.gather(1, tokens[:, None])).all()


def assert_matches_reference(logits, keys, position, **split):
    """The kernels' tokens and log-probs against `sample`'s within the module's tolerance."""
    words = (None, None) if keys is None else step_words(keys, position)
    tokens, logps = kernel_sample(logits, *words, **split)
    assert_within_tolerance(tokens, logps, *reference(logits, keys, position))
    return tokens, logps


def keys_for(N: int, seed: int) -> torch.Tensor:
    return sampling.row_keys(seed, list(range(N)), 1)


SPLITS = st.sampled_from([dict(block=8, blocks_per_chunk=1), dict(block=16, blocks_per_chunk=3),
                          dict(block=32, blocks_per_chunk=2), dict(block=64, blocks_per_chunk=8), {}])


# ---- the noise -----------------------------------------------------------------------------------------------

@given(N=st.integers(1, 5), V=st.integers(1, 300), seed=st.integers(0, 2**62), position=st.integers(0, 2**31))
def test_uniforms_are_keyed_uniforms_bit_for_bit(N, V, seed, position):
    """u = ((bits >> 8) + 0.5) 2^-24 of the uint32 hash equals keyed_uniform's from the int64 hash, every bit."""
    keys, pos = keys_for(N, seed), torch.tensor([position])
    got = keyed_uniforms(*step_words(keys, pos), V)
    assert torch.equal(got, keyed_uniform(keys, pos, mix32(torch.arange(V))))


def test_uniforms_at_the_extreme_words():
    """Step keys and second words of 0, 1, 2^31 and 2^32 - 1 (the uint32 conversion and wrap-around), V past 256."""
    words = torch.tensor([0, 1, 2**31, 2**32 - 1, 2**31 - 1], dtype=torch.int64)
    step_keys, second = words, words.flip(0)
    V = 300
    bits = mix32(mix32(step_keys[:, None] ^ mix32(torch.arange(V))[None, :]) ^ second[:, None])
    assert torch.equal(keyed_uniforms(step_keys, second, V), ((bits >> 8).float() + 0.5) * U)


# ---- tokens and log-probs ------------------------------------------------------------------------------------

@given(N=st.integers(1, 6), V=st.integers(2, 200), seed=st.integers(0, 2**31), scale=st.sampled_from([0.1, 3.0, 30.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), split=SPLITS, greedy=st.booleans())
def test_tokens_and_logps_match_sample(N, V, seed, scale, dtype, split, greedy):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * scale).to(dtype)
    assert_matches_reference(logits, None if greedy else keys_for(N, seed), torch.tensor([seed % 97]), **split)


def test_many_rows_draw_what_sample_draws():
    """64 rows of one small vocabulary over several positions (the noisy race, split in 5 chunks)."""
    logits = torch.randn(64, 77, generator=torch.Generator().manual_seed(0)) * 2
    for position in range(3):
        assert_matches_reference(logits, keys_for(64, 9), torch.tensor([position]), block=8, blocks_per_chunk=2)


def test_ties_go_to_the_first_index_within_and_across_chunks():
    """Greedy rows whose max appears more than once (blocks of 8, chunks of 16): within a block, across blocks of a
    chunk, across chunks; a row of one value throughout."""
    V = 50
    logits = torch.zeros(6, V)
    for row, at in enumerate([(3, 4), (9, 10), (3, 12, 13), (17, 40), (0, 49), (48, 49)]):
        logits[row, list(at)] = 2.0
    logits = torch.cat([logits, torch.full((1, V), -1.5)])
    tokens, logps = kernel_sample(logits, None, None, block=8, blocks_per_chunk=2)
    assert tokens.tolist() == [3, 9, 3, 17, 0, 48, 0]
    torch.testing.assert_close(logps, torch.log_softmax(logits, -1)[range(7), tokens], rtol=0, atol=sigma(V))


def test_filtered_tokens_are_never_chosen():
    """Rows of mostly -inf (top-k / top-p / min-p's filtered tokens), whole chunks of -inf, and one finite token."""
    g = torch.Generator().manual_seed(3)
    V = 90
    logits = torch.randn(8, V, generator=g)
    logits[torch.rand(8, V, generator=g) < 0.8] = NEG
    logits[:, 20:60] = NEG  # whole chunks of -inf at block 8 x 2
    logits[:, 5] = 0.5  # every row keeps a token
    logits[6] = NEG
    logits[6, 77] = -3.0  # alone: picked, log-prob 0
    logits[7] = NEG
    logits[7, 0] = 1.0
    for position in range(4):
        keys = keys_for(8, position)
        for words in (step_words(keys, torch.tensor([position])), (None, None)):
            tokens, logps = kernel_sample(logits, *words, block=8, blocks_per_chunk=2)
            assert torch.isfinite(logits.gather(1, tokens[:, None])).all(), tokens
            assert tokens[6] == 77 and tokens[7] == 0 and logps[6] == 0 and logps[7] == 0
        assert_matches_reference(logits, keys, torch.tensor([position]), block=8, blocks_per_chunk=2)


def test_a_filtered_token_whose_draw_is_zero_is_never_chosen():
    """Step key 0 and second word 6042635 give vocabulary id 5 the uniform u = 1 (its hash's top 24 bits all set,
    (2^24 - 0.5) 2^-24 rounds to 1 in fp32; found by search), so its draw E = -log u is 0, which `sample` clamps to
    fp32's tiny: the score of a filtered (-inf) token stays -inf. Unclamped, -inf - log 0 is NaN, which must neither
    win the race nor hide the tokens of its block: the token is `sample`'s (scores from the same uniforms)."""
    step_keys, second = torch.tensor([0, 0]), torch.tensor([6042635, 6042635])
    u = keyed_uniforms(step_keys, second, 40)
    assert (u[:, 5] == 1.0).all()
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4))
    logits[:, 5] = NEG
    logits[1, 6:] = NEG  # the second row: tokens 0-4 alone allowed, in token 5's block
    logits[1, 3] = 8.0
    scores = torch.log_softmax(logits, -1) - (-u.log()).clamp_min(torch.finfo(torch.float32).tiny).log()
    want = scores.argmax(-1)
    top2 = scores.topk(2, -1).values
    assert ((top2[:, 0] - top2[:, 1]) > 1e-3).all(), top2  # no near-tie: the token is unambiguous
    for split in (dict(block=8, blocks_per_chunk=2), dict(block=64, blocks_per_chunk=1)):
        tokens, logps = kernel_sample(logits, step_keys, second, **split)
        assert torch.equal(tokens, want) and torch.isfinite(logps).all(), (split, tokens, want, logps)


def test_bf16_reads_the_same_as_its_fp32_copy():
    logits = (torch.randn(3, 150, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    words = step_words(keys_for(3, 1), torch.tensor([2]))
    got, want = kernel_sample(logits, *words), kernel_sample(logits.float(), *words)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- the op and the engine's entry -----------------------------------------------------------------------------

def test_custom_op_runs_the_kernels_on_a_strided_view():
    """fastgrpo::keyed_sample (what torch.compile sees) gives the kernels' result, also from a view whose rows are
    not contiguous with each other nor unit-stride along V."""
    base = torch.randn(4, 2 * 61, generator=torch.Generator().manual_seed(2))
    logits = base[:, ::2]  # stride 2 along V
    words = step_words(keys_for(4, 2), torch.tensor([1]))
    got = _keyed_sample_op(logits, *words)
    want = kernel_sample(logits.contiguous(), *words)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_off_cuda_the_engine_samples_with_torch():
    """keyed_sample on CPU tensors is `sample` on keyed_exponential's noise, bit for bit (the engine's CPU path)."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4)).bfloat16()
    keys, pos = keys_for(6, 4), torch.tensor([3])
    got = keyed_sample(logits, keys, pos)
    want = sample(logits.float(), keyed_exponential(keys, pos, mix32(torch.arange(40))))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(keyed_sample(logits, None, pos), sample(logits.float(), None)))


HOPPER_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastgrpo.kernels import sampling as s
split = dict(CHUNKS_P2=32, BLOCK=s.BLOCK, BLOCKS_PER_CHUNK=4)
for name, fn, consts in [("sums", s._chunk_sums_kernel, dict(BLOCK=s.BLOCK, BLOCKS_PER_CHUNK=4)),
                         ("noisy", s._chunk_best_kernel, dict(NOISY=True, **split)),
                         ("greedy", s._chunk_best_kernel, dict(NOISY=False, **split)),
                         ("pick", s._pick_kernel, dict(CHUNKS_P2=32))]:
    for dtype in ("bf16", "fp32"):
        pointers = {"LOGITS": "*" + dtype, "STEP_KEYS": "*i64", "SECOND": "*i64", "BEST_INDEX": "*i32",
                    "TOKENS": "*i64"}
        sig = {a: "constexpr" if a in consts else "i32" if a in ("stride_row", "V", "chunks")
               else pointers.get(a, "*fp32") for a in fn.arg_names}
        ptx = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": s.NUM_WARPS}).asm["ptx"]
        print(name, dtype, ptx.count("mul.lo.s32") + ptx.count("mul.lo.u32"),
              ptx.count("mul.lo.s64") + ptx.count("mul.wide"))
"""


def test_compiles_for_hopper_with_a_32_bit_hash():
    """The three kernels compile for sm_90 on the CPU (Triton's own ptxas, no GPU; the interpreter accepts globals a
    real compile refuses), fp32 and bf16 logits; the noisy kernel's hash is 32-bit multiplies, six per element a
    thread holds, and no 64-bit ones beyond the greedy kernel's addressing (plus the row's two words)."""
    lines = [line.split() for line in sm90_compile_output(HOPPER_CHECK).strip().split("\n")]
    muls = {(name, dtype): (int(m32), int(m64)) for name, dtype, m32, m64 in lines}
    assert len(muls) == 8, lines
    per_thread = kernels.BLOCK // (32 * kernels.NUM_WARPS)
    for dtype in ("bf16", "fp32"):
        assert muls["noisy", dtype][0] >= 6 * per_thread, muls
        assert muls["noisy", dtype][1] <= muls["greedy", dtype][1] + 2, muls


# ---- the benchmark's dry run ------------------------------------------------------------------------------------

def test_bench_dry_run_times_both_paths_and_the_sweep(capsys, tmp_path, monkeypatch):
    """benchmarks/bench_sampling.py --dry-run --sweep on the CPU (the kernels under the interpreter): today's path and
    the kernels, noisy and greedy, then the sweep's splits; every token equal to today's; no results file in
    RESULTS_DIR."""
    from benchmarks import bench_sampling as bench
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    bench.main(["--dry-run", "--sweep"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny")]
    swept, table = lines[:-4], lines[-4:]
    assert [(line[2], line[3]) for line in table] == [("noisy", "today"), ("noisy", "kernel"), ("greedy", "today"),
                                                      ("greedy", "kernel")], lines
    assert len(swept) == 2 * len(bench.DRY_SWEEP) and all(line[3] == "sweep" for line in swept), swept
    assert all(line[8] == "3/3" and float(line[9]) <= sigma(bench.DRY_VOCAB) + 1e-6 for line in table + swept)
    assert not list(tmp_path.iterdir())


# ---- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("greedy", [False, True])
def test_gpu_qwen_vocab_matches_the_compiled_torch_path(greedy):
    """64 x 151936 bf16 logits (Qwen2.5-1.5B), several positions: the kernels against today's compiled sampler, on
    at least 48 rows with a clear best (greedy: bf16 logits tie at the top of ~10% of rows; ties are left out)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 151936, device="cuda", generator=g) * 3).bfloat16()
    keys = keys_for(64, 5).cuda()
    vocab = mix32(torch.arange(151936, device="cuda"))
    today = torch.compile(lambda x, k, p: sample(x.float(), None if k is None else keyed_exponential(k, p, vocab)),
                          dynamic=False)
    for position in range(4):
        pos = torch.tensor([position], device="cuda")
        row_keys = None if greedy else keys
        want_tokens, want_logps = today(logits, row_keys, pos)
        tokens, logps = kernel_sample(logits, *((None, None) if greedy else step_words(keys, pos)))
        _, _, scores, tol = reference(logits, row_keys, pos)
        assert_within_tolerance(tokens, logps, want_tokens, want_logps, scores, tol, min_clear=48)


@pytest.mark.gpu
def test_gpu_compiled_op_replays_in_a_cuda_graph():
    """keyed_sample under torch.compile (the op as an extern kernel), captured in one CUDA graph: every replay gives
    the eager call's tokens and log-probs bit for bit."""
    from tests.graph_replay import assert_replays_exactly

    logits = torch.randn(64, 151936, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    keys, pos = keys_for(64, 1).cuda(), torch.tensor([7], device="cuda")
    want = torch.cat([t.float() for t in keyed_sample(logits, keys, pos)])
    assert_replays_exactly(lambda x: torch.cat([t.float() for t in keyed_sample(x, keys, pos)]), logits, want)
