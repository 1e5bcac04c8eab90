"""patch_model as users call it: argument checks, patching around PEFT's wrapping, the labels= loss's HF options and
errors (fp32, CPU interpreter, real transformers / PEFT classes)."""
import pytest

from fastgrpo.patching import patch_model
from tests.test_patching import tiny_model


@pytest.mark.parametrize("name", ["rms_norm", "rope", "swiglu", "fused_loss", "fused_lora", "tiled_mlp"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_switches_take_bools_only(name, value):
    """A truthy stand-in ("no" from a config file) used to patch what it meant to leave alone; None is tiled_mlp's
    'decide for me'."""
    model = tiny_model("llama")
    if name == "tiled_mlp" and value is None:
        assert patch_model(model, tiled_mlp=None).fastgrpo_patch_summary["arguments"]["tiled_mlp"] is None
        return
    expected = "True, False or None" if name == "tiled_mlp" else "True or False"
    with pytest.raises(ValueError, match=f"^{name}: expected {expected}, got {value!r}$"):
        patch_model(model, **{name: value})
    assert "fastgrpo_patch_summary" not in model.__dict__
