"""kernels/quantize_fp8.py under the CPU interpreter, against ops.fp8_linear.quantize_rows (the eager quantizer).

quantize_fp8 runs the kernel only on CUDA (tests/test_fp8_linear.py::test_gpu_quantizer_kernel_gives_the_eager_bytes),
as Triton 3.9's interpreter casts fp32 to e4m3 wrongly where the rounding carries into the exponent. Its scales are
fp32 and need no such cast, and a row whose values are e4m3 codes times a power of two, with amax 448 times that
power, divides back to those codes exactly: no rounding, so the interpreter's cast is right and the bytes must be
the eager ones. Those two checks keep the kernel's amax, NaN rule, tiny floor, column scale and tail masks testable
on the CPU.
"""
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.kernels.quantize_fp8 import BLOCK_K, quantize_rows_fwd
from fastgrpo.ops.fp8_linear import FP8_DTYPE, quantize_rows

_CODES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
CODES = _CODES[_CODES.isfinite()]  # the 254 finite e4m3 values, subnormals included


def _kernel(x, column_scale=None):
    q = torch.empty(x.shape, dtype=FP8_DTYPE)
    scale = torch.empty(x.shape[0])
    quantize_rows_fwd(x, q, scale, column_scale)
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


@given(
    R=st.integers(1, 5),
    K=st.one_of(st.integers(1, 70), st.integers(BLOCK_K - 3, BLOCK_K + 40)),  # past a block: a ragged second one
    zero_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_exact_rows_give_the_eager_bytes_and_scales(R, K, zero_row, seed):
    g = torch.Generator().manual_seed(seed)
    x = _exact_rows(R, K, g)
    if zero_row:
        x[-1] = 0.0  # scale fp32's smallest normal, q 0
    _assert_same(x, *_kernel(x), f"R{R} K{K}")
    gapped = torch.zeros(R, K + 7)  # rows with a gap between them: the kernel's row stride
    gapped[:, :K] = x
    _assert_same(x, *_kernel(gapped[:, :K]), f"R{R} K{K} gapped")


@given(R=st.integers(1, 4), K=st.integers(1, 90), seed=st.integers(0, 2**16))
def test_column_scale_multiplies_each_column(R, K, seed):
    # x / column_scale with power-of-two column scales is exact, and times them gives the exact rows back
    g = torch.Generator().manual_seed(seed)
    x = _exact_rows(R, K, g)
    column_scale = 2.0 ** torch.randint(-4, 5, (K,), generator=g).float()
    _assert_same(x, *_kernel(x / column_scale, column_scale), f"R{R} K{K} column_scale")


@given(
    R=st.integers(1, 4),
    K=st.one_of(st.integers(1, 70), st.integers(BLOCK_K - 3, BLOCK_K + 40)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_scales_of_any_rows_are_the_eager_bits(R, K, dtype, seed):
    # random magnitudes: the bytes may hit the interpreter's cast, the scales (amax / 448, IEEE) may not differ
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, K, generator=g) * torch.exp(4 * torch.randn(R, 1, generator=g))).clamp(-6e4, 6e4).to(dtype)
    x[:, -1] *= 8  # the row's largest value last: in the ragged tail block when K passes BLOCK_K
    scale = _kernel(x)[1]
    scale0 = quantize_rows(x)[1]
    assert torch.equal(scale, scale0), f"R{R} K{K} {dtype}: scales {scale.tolist()} vs {scale0.tolist()}"


def test_a_nan_makes_its_scale_nan_and_leaves_other_rows():
    # The NaN row's bytes are not checked: the interpreter casts NaN to e4m3 as 384 (the GPU test checks them NaN).
    x = _exact_rows(3, 40, torch.Generator().manual_seed(1))
    x[1, 7] = float("nan")
    q, scale = _kernel(x)
    assert scale[1].isnan() and scale[[0, 2]].isfinite().all(), f"scales {scale.tolist()}: row 1 alone NaN"
    _assert_same(x[[0, 2]], q[[0, 2]], scale[[0, 2]], "the rows without a NaN")
