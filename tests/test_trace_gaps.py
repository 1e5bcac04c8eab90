"""benchmarks.trace_gaps on a hand-made trace: busy time, and each idle gap charged to the host or the device and
to the CPU ranges around the launch that ended it."""
from benchmarks.trace_gaps import Trace


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_gaps_are_charged_to_the_late_launch_or_to_the_device():
    events = [
        _x("user_annotation", "update", 0, 1000),
        _x("cpu_op", "FSDP::pre_forward", 100, 300),
        _x("cpu_op", "aten::mm", 350, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 360, 2, correlation=2),  # launched after the GPU went idle
        _x("cuda_runtime", "cudaLaunchKernel", 380, 2, correlation=3),  # launched early, started late
        _x("kernel", "sm90_xmma_gemm", 10, 90, tid=7, stream=7, correlation=1),     # busy 10..100
        _x("kernel", "sm90_xmma_gemm", 400, 100, tid=7, stream=7, correlation=2),   # host gap 100..400
        _x("kernel", "rms_norm_fwd", 600, 50, tid=7, stream=7, correlation=3),      # device gap 500..600
    ]
    s = Trace(events).summary(Trace(events).window("update"), min_gap_us=20)  # not the 10 us lead-in
    assert abs(s["busy_ms"] - 0.24) < 1e-9
    assert abs(s["idle_host_ms"] - 0.3) < 1e-9 and abs(s["idle_device_ms"] - 0.1) < 1e-9
    gaps = dict(s["top_gaps_ms"])
    assert abs(gaps["host | update > FSDP::pre_forward | aten::mm"] - 0.3) < 1e-9, gaps
    assert abs(gaps["device | update > FSDP::pre_forward | FSDP::pre_forward"] - 0.1) < 1e-9, gaps
    assert s["categories_ms"] == {"gemm": 0.19, "norm_rope_mlp": 0.05}


def test_kernel_categories_name_fastgrpo_and_library_kernels():
    from benchmarks.trace_gaps import category

    assert category("_row_stats_kernel") == category("_row_grad_kernel") == "fused_loss"
    assert category("_glu_fwd_kernel") == category("_rms_norm_fwd_kernel") == "norm_rope_mlp"
    assert category("void at::native::vectorized_elementwise_kernel<4, Foo<false>>") == "elementwise"
    assert category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert category("ncclDevKernel_AllGather_RING_LL") == "nccl"
