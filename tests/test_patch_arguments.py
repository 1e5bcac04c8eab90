"""patch_model's keywords as users get them wrong: one line naming the keyword, and the model left unpatched."""
import pytest

from fastgrpo.patching import patch_model
from tests.test_patching import tiny_model


@pytest.mark.parametrize("options", [{}, {"tiled_mlp": False}, {"offload_activations": True, "recompute_layers": 0}])
def test_mlp_chunk_tokens_without_a_tiled_mlp_is_refused(options):
    """mlp_chunk_tokens sizes the tiled MLP's chunks: where no MLP runs tiled (tiled_mlp False, or None without a
    layer that offload_activations checkpoints) it was accepted and did nothing, as recompute_layers without
    offload_activations is refused."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"^mlp_chunk_tokens: sizes the tiled MLP's chunks, and no MLP runs tiled "
                                         r"\(tiled_mlp=.*\); pass tiled_mlp=True, or leave mlp_chunk_tokens None$"):
        patch_model(model, mlp_chunk_tokens=64, **options)
    assert "fastgrpo_patch_summary" not in model.__dict__
    tiled = patch_model(model, mlp_chunk_tokens=64, **{**options, "tiled_mlp": True}).fastgrpo_patch_summary
    assert tiled["patched"]["tiled_mlp"] == 2 and tiled["options"]["mlp_chunk_tokens"] == 64
