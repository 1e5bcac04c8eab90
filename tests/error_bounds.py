"""The elementwise check of a kernel's output against its fp64 reference and a derived per-element bound."""
import torch


def assert_within(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """Every element of `got` finite and within `tol` of the fp64 `ref`; a failure names the worst element (its
    error, bound and reference) and the largest error."""
    err = (got.double() - ref).abs()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    worst = (err - tol).argmax()
    assert (err <= tol).all(), (
        f"{what}: |err| {err.flatten()[worst]:.3e} > bound {tol.flatten()[worst]:.3e} "
        f"(ref {ref.flatten()[worst]:.4f}); max err {err.max():.3e}")
