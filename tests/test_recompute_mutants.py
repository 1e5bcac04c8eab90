"""Offload's recompute in the backward that skips the tiled MLP (fastgrpo.ops.tiled_mlp.outputs_unread, the
Architecture.mlp_output_added_as_is data), where the suite's other cases could not tell a mutant apart (found by the
recompute mutation audit). CPU offloader, tiny real transformers models."""
import threading

import pytest
import torch
import transformers

from fastgrpo.hf.architectures import ARCHITECTURES
from fastgrpo.offload import ActivationOffloader, enable_offload_checkpointing
from fastgrpo.ops.tiled_mlp import outputs_unread, tiled_mlp
from fastgrpo.patching import patch_model
from tests.test_patching import CONFIGS, TINY
from tests.test_tiled_mlp import decoder_step, tiny_model, with_lora

CHUNK = 4  # tokens per tiled MLP chunk: the batch below has 20


def _probe_step(model_type: str, skip_mlp: bool) -> dict[str, torch.Tensor]:
    """Gradients of one step of a tiny model of `model_type` whose offloaded layers run tiled MLPs above their chunk
    and are told whether their recompute may skip the MLP. LoRA dropout on the MLP linears and a residual dropout
    (Phi-3's) draw random numbers, so a recompute whose draws shift shows in the gradients."""
    config = CONFIGS[model_type]()
    config._attn_implementation = "eager"
    if hasattr(config, "resid_pdrop"):
        config.resid_pdrop = 0.3
    torch.manual_seed(0)
    model = with_lora(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train(), dropout=0.3)
    offloader = ActivationOffloader("cpu")
    patch_model(model, rms_norm=False, rope=False, swiglu=False, fused_loss=False, offload_activations=offloader,
                mlp_chunk_tokens=CHUNK)
    enable_offload_checkpointing(model.get_base_model().model.layers, offloader=offloader,
                                 tiled_mlp_chunk_tokens=CHUNK, mlp_output_only_added=skip_mlp)
    ids = torch.randint(3, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    return decoder_step(model, ids)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_mlp_output_data_says_what_hfs_layers_do(model_type):
    """Each table entry against its HF decoder layer: the recompute may skip the tiled MLP (the entry is True) exactly
    where skipping it gives the gradients, bitwise, of the recompute that runs it. A norm reading the output (Gemma2/3)
    gives NaN, a dropout after the MLP (Phi-3) other masks. The suite checked four entries by a list written in the
    test: gemma3 set to True (NaN gradients) or qwen2 set to False (a third MLP forward per step) passed it."""
    skipped, run = _probe_step(model_type, True), _probe_step(model_type, False)
    assert skipped.keys() == run.keys() and any("lora_A" in name for name in run)
    differ = [name for name in run if not torch.equal(skipped[name], run[name])]
    assert ARCHITECTURES[model_type].mlp_output_added_as_is == (not differ), (model_type, differ[:3])
    if model_type == "gemma3_text":  # the multimodal gemma3 runs the same decoder layer class
        assert ARCHITECTURES["gemma3"] == ARCHITECTURES["gemma3_text"]


def _tiled_output(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tiled_mlp(mlp, x, chunk_tokens=CHUNK)


def test_outputs_unread_puts_back_what_it_found():
    """After an exception in the recompute (an out-of-memory error a trainer catches and retries) the next forward of
    a tiled MLP outside a recompute must compute its output, not a NaN placeholder; nested, the outer block holds on.
    A flag reset without try/finally, or reset to off instead of to what it was, passed the suite."""
    mlp = tiny_model("llama").model.layers[0].mlp
    x = torch.randn(21, mlp.down_proj.out_features, dtype=torch.float64, requires_grad=True)
    want = mlp(x)
    with pytest.raises(RuntimeError, match="out of memory"):
        with outputs_unread():
            raise RuntimeError("out of memory")
    torch.testing.assert_close(_tiled_output(mlp, x), want, rtol=1e-12, atol=1e-12)
    with outputs_unread():
        with outputs_unread():
            pass
        assert _tiled_output(mlp, x).isnan().all()
    torch.testing.assert_close(_tiled_output(mlp, x), want, rtol=1e-12, atol=1e-12)


def test_outputs_unread_holds_in_its_own_thread_only():
    """A recompute in one thread (autograd's device thread on CUDA) must not turn another thread's tiled MLP into a
    placeholder (a second model trained or scored in a thread): a flag shared by all threads passed the suite."""
    mlp = tiny_model("llama").model.layers[0].mlp
    x = torch.randn(21, mlp.down_proj.out_features, dtype=torch.float64, requires_grad=True)
    want = mlp(x)
    got = []
    with outputs_unread():
        worker = threading.Thread(target=lambda: got.append(_tiled_output(mlp, x)))
        worker.start()
        worker.join()
        assert _tiled_output(mlp, x).isnan().all()
    torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)
