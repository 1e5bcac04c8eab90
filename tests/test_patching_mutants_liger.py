"""The Liger-over-fastgrpo check's scope, where the suite's other cases could not tell a mutant apart (found by the
patching mutation audit). Real liger-kernel on a tiny model; Liger's kernels do not run under Triton's CPU
interpreter, so the model's registered check is called as its forward's pre-hook would be."""
import pytest
import torch

pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed (pip install liger-kernel)")

from fastgrpo.patching import patch_model  # noqa: E402
from tests import test_liger  # noqa: E402
from tests.test_patching import tiny_model  # noqa: E402

# test_liger's autouse fixture: Liger rebinds names in transformers' modeling modules process-wide; put them back
liger_undone = test_liger.liger_undone


def test_liger_over_a_patched_model_is_refused_in_training_steps_only():
    """Liger put in later is refused at a training forward (train mode, grad on); eval and no_grad forwards (generate
    calls the model once per token; HF's evaluate under use_liger_kernel) pass. Checking every forward passed the
    suite, which called the model in training only."""
    model = test_liger.liger_instance(patch_model(tiny_model("llama")))
    (check,) = model._forward_pre_hooks.values()
    assert check(model.eval(), ()) is None
    with torch.no_grad():
        assert check(model.train(), ()) is None
    with pytest.raises(ValueError, match="^use_liger_kernel: Liger-Kernel's forwards now run"):
        check(model.train(), ())
