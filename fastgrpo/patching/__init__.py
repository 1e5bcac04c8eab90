"""patch_model: fused kernels bound on the module instances of a Hugging Face causal LM; unpatch_model undoes it."""
from fastgrpo.patching.patch import patch_model, unpatch_model

__all__ = ["patch_model", "unpatch_model"]
