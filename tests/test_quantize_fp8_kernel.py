"""kernels/quantize_fp8.py under the CPU interpreter, against ops.fp8_linear.quantize_rows (the eager quantizer).

quantize_fp8 runs the kernel only on CUDA (tests/test_fp8_linear.py::test_gpu_quantizer_kernel_gives_the_eager_bytes),
as Triton 3.9's interpreter casts fp32 to e4m3 wrongly where the rounding carries into the exponent. Its scales are
fp32 and need no such cast, and a row whose values are e4m3 codes times a power of two, with amax 448 times that
power, divides back to those codes exactly: no rounding, so the interpreter's cast is right and the bytes must be
the eager ones. Those two checks keep the kernel's amax, NaN rule, tiny floor, column scale and tail masks testable
on the CPU, for the kernel's own tiles and drawn ones (rows a program, one or two passes, blocks a row spans).
"""
import pytest
import torch
import triton
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.kernels.quantize_fp8 import ONE_PASS_UP_TO, QuantizeTiles, quantize_rows_fwd, quantize_tiles
from fastgrpo.ops.fp8_linear import FP8_DTYPE, quantize_rows

_CODES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
CODES = _CODES[_CODES.isfinite()]  # the 254 finite e4m3 values, subnormals included


# K around the kernel's switch from one pass to two (its second block ragged), or small
WIDTHS = st.one_of(st.integers(1, 70), st.integers(ONE_PASS_UP_TO - 3, ONE_PASS_UP_TO + 40))


@st.composite
def tiles_for(draw, K):
    """The kernel's own tiles for K (None), or drawn ones: 1-4 rows a program, the row in one block or in two
    passes over blocks of 16 / 32 (small K spans several, ragged)."""
    kind = draw(st.sampled_from(["own", "one pass", "two passes"]))
    if kind == "own":
        return None
    block_r = draw(st.sampled_from([1, 2, 4]))
    if kind == "one pass":
        return QuantizeTiles(block_r, triton.next_power_of_2(K), True, 4)
    return QuantizeTiles(block_r, draw(st.sampled_from([16, 32])), False, 4)


def _kernel(x, column_scale=None, tiles=None):
    # outputs filled with values the kernel never writes for finite rows (e4m3 NaN, a negative scale): a row or
    # column it skips shows, where torch.empty could hand back the bytes of an earlier call's correct output
    q = torch.full(x.shape, 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    scale = torch.full(x.shape[:1], -1.0)
    quantize_rows_fwd(x, q, scale, column_scale, tiles)
    return q, scale


def _assert_same(x, q, scale, what):
    q0, scale0 = quantize_rows(x)
    bytes_differ = (q.view(torch.uint8) != q0.view(torch.uint8)).sum().item()
    scales_differ = (~((scale == scale0) | (scale.isnan() & scale0.isnan()))).sum().item()
    assert bytes_differ == 0 and scales_differ == 0, (
        f"{what}: {bytes_differ} bytes and {scales_differ} scales differ from quantize_rows; "
        f"scales {scale.tolist()} vs {scale0.tolist()}")


def _exact_rows(R, K, g):
    """[R, K] fp32 rows of e4m3 codes times 2^e (e per row), each with one +-448 2^e: scale 2^e, x / scale the codes."""
    exponents = torch.randint(-30, 30, (R, 1), generator=g).double()
    x = CODES[torch.randint(0, len(CODES), (R, K), generator=g)].double() * 2.0**exponents
    peak = torch.randint(0, K, (R,), generator=g)
    x[torch.arange(R), peak] = 448.0 * 2.0 ** exponents[:, 0] * torch.where(torch.rand(R, generator=g) < 0.5, -1, 1)
    return x.float()


@given(R=st.integers(1, 5), K=WIDTHS, zero_row=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_exact_rows_give_the_eager_bytes_and_scales(R, K, zero_row, seed, data):
    g = torch.Generator().manual_seed(seed)
    tiles = data.draw(tiles_for(K))
    x = _exact_rows(R, K, g)
    if zero_row:
        x[-1] = 0.0  # scale fp32's smallest normal, q 0
    _assert_same(x, *_kernel(x, tiles=tiles), f"R{R} K{K} {tiles}")
    gapped = torch.zeros(R, K + 7)  # rows with a gap between them: the kernel's row stride
    gapped[:, :K] = x
    _assert_same(x, *_kernel(gapped[:, :K], tiles=tiles), f"R{R} K{K} {tiles} gapped")


@given(R=st.integers(1, 4), K=st.integers(1, 90), seed=st.integers(0, 2**16), data=st.data())
def test_column_scale_multiplies_each_column(R, K, seed, data):
    # x / column_scale with power-of-two column scales is exact, and times them gives the exact rows back
    g = torch.Generator().manual_seed(seed)
    tiles = data.draw(tiles_for(K))
    x = _exact_rows(R, K, g)
    column_scale = 2.0 ** torch.randint(-4, 5, (K,), generator=g).float()
    _assert_same(x, *_kernel(x / column_scale, column_scale, tiles), f"R{R} K{K} {tiles} column_scale")


@given(R=st.integers(1, 4), K=WIDTHS, dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16), data=st.data())
def test_scales_of_any_rows_are_the_eager_bits(R, K, dtype, seed, data):
    # random magnitudes: the bytes may hit the interpreter's cast, the scales (amax / 448, IEEE) may not differ
    g = torch.Generator().manual_seed(seed)
    tiles = data.draw(tiles_for(K))
    x = (torch.randn(R, K, generator=g) * torch.exp(4 * torch.randn(R, 1, generator=g))).clamp(-6e4, 6e4).to(dtype)
    x[:, -1] *= 8  # the row's largest value last: in the ragged tail block when the row spans blocks
    scale = _kernel(x, tiles=tiles)[1]
    scale0 = quantize_rows(x)[1]
    assert torch.equal(scale, scale0), f"R{R} K{K} {tiles} {dtype}: scales {scale.tolist()} vs {scale0.tolist()}"


@given(K=st.integers(1, 3 * ONE_PASS_UP_TO))
def test_own_tiles_read_a_row_once_up_to_the_switch_and_cover_it(K):
    tiles = quantize_tiles(K)
    assert tiles.one_pass == (K <= ONE_PASS_UP_TO), f"K {K}: {tiles}"
    assert not tiles.one_pass or tiles.block_k >= K, f"K {K}: one pass over a block shorter than the row: {tiles}"


@pytest.mark.parametrize("tiles", [None, QuantizeTiles(1, 16, False, 4), QuantizeTiles(2, 16, False, 4)],
                         ids=["own", "two-passes", "two-rows-two-passes"])
def test_a_nan_makes_its_scale_nan_and_leaves_other_rows(tiles):
    # The NaN row's bytes are not checked for NaN: the interpreter casts NaN to e4m3 as 384 (the GPU test checks them
    # NaN); a clamp that drops the NaN makes them -448 or 448, which no cast of NaN gives.
    x = _exact_rows(3, 40, torch.Generator().manual_seed(1))
    x[1, 7] = float("nan")  # in the first of a two-pass row's blocks: its running maxima carry it
    q, scale = _kernel(x, tiles=tiles)
    assert scale[1].isnan() and scale[[0, 2]].isfinite().all(), f"scales {scale.tolist()}: row 1 alone NaN"
    clamped = q[1].float().abs() == 448
    assert not clamped.any(), f"{tiles}: the NaN row clamped to +-448 at columns {clamped.nonzero().flatten().tolist()}"
    _assert_same(x[[0, 2]], q[[0, 2]], scale[[0, 2]], "the rows without a NaN")


@pytest.mark.parametrize("block_r", [2, 4])
@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("R", [1, 3, 5, 6])
def test_every_row_of_a_ragged_last_program(block_r, one_pass, R):
    # the drawn tiles above meet few (rows, block_r) pairs in CI's 12 examples; here each row count against 2 and 4
    # rows a program, with a ragged last block along K in two passes
    K = 45
    tiles = QuantizeTiles(block_r, 64 if one_pass else 16, one_pass, 4)
    x = _exact_rows(R, K, torch.Generator().manual_seed(R))
    _assert_same(x, *_kernel(x, tiles=tiles), f"R{R} K{K} {tiles}")


@pytest.mark.parametrize("tiles", [None, QuantizeTiles(4, 64, True, 4), QuantizeTiles(4, 16, False, 4)],
                         ids=["own", "four-rows-one-pass", "four-rows-two-passes"])
def test_writes_stay_in_the_callers_slots(tiles):
    # q and scale are slots of larger buffers (as in a fused group's stacked buffer), q's rows longer than K: the
    # bytes before and after the slot, past each row's K, and the scales around it keep their sentinels. A ragged
    # last program (5 rows, 4 a program) and a ragged last block (45 of 64, or of 3 x 16) write nothing past R and K.
    R, K, pad = 5, 45, 19
    x_rows = torch.zeros(R + 4, K)  # x a slot too: rows past R are memory a stray load may read (only writes show)
    x = x_rows[:R]
    x.copy_(_exact_rows(R, K, torch.Generator().manual_seed(3)))
    q_rows = torch.full((R + 5, K + pad), 0x7F, dtype=torch.uint8)
    scale_rows = torch.full((R + 5,), -1.0)
    q, scale = q_rows[1:R + 1, :K].view(FP8_DTYPE), scale_rows[1:R + 1]
    quantize_rows_fwd(x, q, scale, None, tiles)
    _assert_same(x, q, scale, f"R{R} K{K} {tiles} in a slot")
    outside = torch.ones_like(q_rows, dtype=torch.bool)
    outside[1:R + 1, :K] = False
    written = (q_rows[outside] != 0x7F).sum().item()
    scales_written = (scale_rows[[0, *range(R + 1, R + 5)]] != -1.0).sum().item()
    assert written == 0 and scales_written == 0, f"{tiles}: {written} bytes and {scales_written} scales written " \
                                                 "outside the slot"


def test_the_tiles_given_are_the_tiles_run():
    # the drawn tiles above and bench_quantize's sweep rely on it: a one-pass block of 16 over rows of 40 reads and
    # writes those 16 columns alone (the kernel's own tiles would write all 40)
    x = _exact_rows(2, 40, torch.Generator().manual_seed(2))
    q, _ = _kernel(x, tiles=QuantizeTiles(1, 16, True, 4))
    assert (q.view(torch.uint8)[:, 16:] == 0x7F).all() and (q.view(torch.uint8)[:, :16] != 0x7F).all(), q
