"""EngineConfig(weights="nf4"): the decode steps run fastgrpo.ops.nf4_linear on each bitsandbytes NF4 base's own
4-bit weight (no copy); LoRA branches, lm_head and other linears keep their forward.

Checked here, on tiny Llama / Qwen2 models (Qwen2: biases on q/k/v) quantized by bitsandbytes (NF4, double
quantization on and off), with and without PEFT LoRA: every 4-bit base runs nf4_linear once per decode step and
nothing else changes; the engine's tokens and log-probs against weights="model" (bitsandbytes' own forward);
the model comes back as it was (classes, forwards, packed weights); "auto" falls back to "nf4" when no copy fits;
one compiled frame for the layers across calls.

Bounds: on the op's plain-torch path nf4_linear is bitsandbytes' forward bit for bit (tests/test_nf4_linear.py:
test_torch_path_is_bitsandbytes_forward), so the two engines agree exactly: same tokens, same log-probs. Through the
Triton kernel (interpreter, fp32 model: W is bitsandbytes' fp32 W exactly, test_kernel_reads_the_format_exactly)
only the fp32 summation order differs, (K + splits + 3) 2^-24 relative to sum |x w| per linear (K <= 128 here:
8e-6); log-probs of O(1) logits move by about that, twice (the chosen logit and the logsumexp): KERNEL_GAP
(seen: 2.4e-7), and greedy tokens stay.
"""
import sys
import warnings

import pytest
import torch

import fastgrpo
from fastgrpo.rollout import decode_weights
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_rollout import CONFIGS, PROMPTS, char_tokenizer, completions
from tests.test_warmup import DEEP, FIXED, PROMPT_SETS

bnb = pytest.importorskip("bitsandbytes")
NF4 = EngineConfig(weights="nf4", compile=False)
MODEL = EngineConfig(weights="model", compile=False)
LINEARS = 7  # 4-bit linears per decoder layer: q, k, v, o, gate, up, down
KERNEL_GAP = 2 * (128 + 3 + 3) * 2.0**-24  # the module docstring's log-prob bound through the kernel


@pytest.fixture
def torch_path(monkeypatch):
    """Every op on its plain-torch path but nf4_linear, which runs the kernel when `kernel` is set (the Triton
    interpreter: slow, so only a few steps). Not by unsetting TRITON_INTERPRET (tests/test_decode_weights.py)."""
    def choose(kernel: bool):
        for name, module in list(sys.modules.items()):
            if name.startswith("fastgrpo.ops.") and hasattr(module, "use_triton"):
                if not (kernel and name == "fastgrpo.ops.nf4_linear"):
                    monkeypatch.setattr(module, "use_triton", lambda *tensors: False)
    return choose


def nf4_model(config, nested=False, lora=False, seed=0, compute_dtype=torch.float32):
    """A tiny model whose decoder linears (not lm_head) are bitsandbytes NF4 Linear4bit with `compute_dtype`,
    quantized from its random fp32 weights; PEFT LoRA on q, v and gate (non-zero adapters) if `lora`."""
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module is head:
            continue
        layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=nested, quant_type="nf4",
                                  device="meta")
        layer.support_avx512bf16_for_cpu = False  # bitsandbytes' CPU repacking: a layout nf4_linear refuses
        layer.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=nested).to("cpu")
        layer.bias = module.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                                                 init_lora_weights=False))
    return model.eval()


def run(model, config, params=SamplingParams(max_new_tokens=12, temperature=0), G=2, seed=3):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' own warnings about CPU inputs
        return generate_with_config(model, char_tokenizer(), PROMPTS, G, params, seed=seed, config=config)


def packed_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}


@pytest.mark.parametrize("arch, nested, lora, patched", [("llama", False, False, False), ("llama", True, True, False),
                                                         ("qwen2", True, False, False), ("qwen2", False, True, True)])
def test_nf4_engine_is_bitsandbytes_forward(monkeypatch, torch_path, arch, nested, lora, patched):
    """Greedy and sampled: the same tokens and log-probs as weights="model", bit for bit (module docstring); every
    4-bit base ran nf4_linear once per decode step, patch_model's LoRA forwards too (they call base_layer(x) for a
    bitsandbytes base); classes, forwards and packed weights come back."""
    torch_path(kernel=False)
    model = nf4_model(CONFIGS[arch](), nested, lora)
    if patched:
        fastgrpo.patch_model(model)
    bases = decode_weights.nf4_linears(model)
    layers = model.config.num_hidden_layers
    assert len(bases) == LINEARS * layers and all(type(b).__name__ == "Linear4bit" for b in bases)
    before = {name: (type(m), m.__dict__.get("forward")) for name, m in model.named_modules()}
    packed = packed_weights(model)
    calls = []
    unpacked = decode_weights.nf4_linear_unpacked
    monkeypatch.setattr(decode_weights, "nf4_linear_unpacked", lambda *a, **k: calls.append(1) or unpacked(*a, **k))
    for params in (SamplingParams(max_new_tokens=12, temperature=0),
                   SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20)):
        calls.clear()
        got, want = run(model, NF4, params), run(model, MODEL, params)
        assert len(calls) == len(bases) * (got.completion_ids.shape[1] - 1)  # the prefill sampled the first token
        assert completions(got) == completions(want)
        assert torch.equal(got.logprobs, want.logprobs)
    assert {name: (type(m), m.__dict__.get("forward")) for name, m in model.named_modules()} == before
    assert all(torch.equal(p, packed[n]) for n, p in packed_weights(model).items())
    assert not any(hasattr(b, "fastgrpo_nf4") for b in bases)


def test_nf4_engine_through_the_kernel(monkeypatch, torch_path):
    """The Triton kernel (interpreter) in the decode steps of a LoRA model with nested absmax: the model engine's
    greedy tokens, log-probs within KERNEL_GAP (module docstring)."""
    from fastgrpo.kernels import nf4_linear as kernel

    torch_path(kernel=True)
    launches = []
    fwd = kernel.nf4_linear_fwd
    monkeypatch.setattr(kernel, "nf4_linear_fwd", lambda *a, **k: launches.append(1) or fwd(*a, **k))
    model = nf4_model(CONFIGS["llama"](), nested=True, lora=True)
    params = SamplingParams(max_new_tokens=4, temperature=0)
    got, want = run(model, NF4, params), run(model, MODEL, params)
    assert len(launches) == LINEARS * model.config.num_hidden_layers * 3  # 3 decode steps
    assert completions(got) == completions(want)
    gap = (got.logprobs - want.logprobs).abs().max().item()
    assert gap <= KERNEL_GAP, f"log-prob gap {gap:.3e} > {KERNEL_GAP:.3e}"


def test_layers_the_kernel_cannot_read_keep_their_forward(torch_path):
    """A layer nf4_refusal names (here: bitsandbytes' CPU repacking, FP4; K not a multiple of the blocksize too)
    stays on bitsandbytes' forward; the others still run nf4_linear; no copy is counted."""
    torch_path(kernel=False)
    model = nf4_model(CONFIGS["llama"]())
    down = model.model.layers[0].mlp.down_proj
    up = model.model.layers[0].mlp.up_proj
    all_bases = decode_weights.nf4_linears(model)
    down.weight.quant_state.packing_format_for_cpu = True
    up.weight.quant_state.quant_type = "fp4"  # never decoded: only the selection is checked
    bases = decode_weights.nf4_linears(model)
    assert down not in bases and up not in bases and len(bases) == len(all_bases) - 2
    with decode_weights.decode_weights(model, "nf4") as swapped:
        assert swapped == bases and not hasattr(down, "fastgrpo_nf4") and type(down) is bnb.nn.Linear4bit
    assert decode_weights.copy_bytes(model, "nf4") == 0


def test_a_model_without_nf4_layers_warns(torch_path):
    """weights="nf4" on a bf16 model: one warning, and the model's own weights (its tokens and log-probs)."""
    from tests.test_rollout import tiny_model

    torch_path(kernel=False)
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="weights='nf4' found no bitsandbytes NF4 layer"):
        got = generate_with_config(model, char_tokenizer(), PROMPTS, 2, SamplingParams(max_new_tokens=6), seed=3,
                                   config=NF4)
    want = generate_with_config(model, char_tokenizer(), PROMPTS, 2, SamplingParams(max_new_tokens=6), seed=3,
                                config=MODEL)
    assert completions(got) == completions(want) and torch.equal(got.logprobs, want.logprobs)


def test_auto_falls_back_to_nf4_when_no_copy_fits():
    """"auto" takes a copy when one fits, else "nf4" for a model whose NF4 bases the kernel reads and compute in
    16 bits (on a device the kernel runs on), else the model's own weights; "nf4" is no copy kind."""
    model = nf4_model(CONFIGS["llama"](), compute_dtype=torch.bfloat16)
    extra = decode_weights.AUTO_HEADROOM_BYTES + decode_weights.build_bytes(model)
    fused, dense = (decode_weights.copy_bytes(model, kind) + extra for kind in ("fused", "dense"))
    assert decode_weights.auto_weights(model, fused) == "fused"
    assert decode_weights.auto_weights(model, dense) == ("dense" if dense < fused else "fused")
    assert decode_weights.auto_weights(model, dense - 1) == "nf4"
    assert decode_weights.auto_weights(model, dense - 1, nf4=False) == "model"
    lora = nf4_model(CONFIGS["llama"](), lora=True, compute_dtype=torch.float16)
    assert decode_weights.auto_weights(lora, 0) == "nf4"
    # fp32 compute runs the kernel's fp32 dots (unmeasured): bitsandbytes' forward
    assert decode_weights.auto_weights(nf4_model(CONFIGS["llama"]()), 0) == "model"
    fp4 = nf4_model(CONFIGS["llama"](), compute_dtype=torch.bfloat16)
    for layer in decode_weights.nf4_linears(fp4):  # FP4 bases: nothing the kernel reads
        layer.weight.quant_state.quant_type = "fp4"
    assert decode_weights.auto_weights(fp4, 0) == "model"
    assert decode_weights.resolved_weights(model, "nf4") == "nf4"
    with pytest.raises(ValueError, match="kind"):
        decode_weights.copied_weights(model, "nf4").__enter__()


def test_auto_decodes_with_nf4_when_building_its_copy_runs_out_of_memory(monkeypatch):
    """The dense copy "auto" chose fails to build (the second layer copied raises the allocator's error): the
    rollout goes on with "nf4" (every NF4 base swapped, a warning says so); afterwards the model is as it was."""
    model = nf4_model(CONFIGS["llama"](), lora=True, compute_dtype=torch.bfloat16)
    classes = {name: type(m) for name, m in model.named_modules()}
    copy_layer, calls = decode_weights._copy, []

    def out_of_memory_on_the_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB")
        return copy_layer(*args)

    monkeypatch.setattr(decode_weights, "_copy", out_of_memory_on_the_second)
    bases = decode_weights.nf4_linears(model)
    with pytest.warns(UserWarning, match="decoding with 'nf4'"):
        with decode_weights._copy_or_fallback(model, "dense") as modules:
            assert modules == bases and all(hasattr(b, "fastgrpo_nf4") for b in bases)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert not [n for n, m in model.named_modules() if any(a.startswith("fastgrpo_") for a in vars(m))]
    calls.clear()
    with pytest.warns(UserWarning, match="the model's own weights"):  # a device the kernel does not run on
        with decode_weights._copy_or_fallback(model, "dense", nf4=False) as modules:
            assert modules == []


@pytest.mark.parametrize("lora", [False, True])
def test_layers_scope_compiles_one_layer(compiles, lora):
    """compile_scope="layers": one frame for the layers (the swapped Linear4bit class and its NF4 parts are guarded
    by class, shape and value, not identity) and one for the sampling, across calls of three prompt lengths; the
    uncompiled engine's tokens and log-probs."""
    model = nf4_model(DEEP["llama"](), nested=True, lora=lora)
    config = EngineConfig(**FIXED, compile_scope="layers", weights="nf4")
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20)
    for prompts in PROMPT_SETS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = generate_with_config(model, char_tokenizer(), prompts, 3, params, seed=7, config=config)
        assert compiles.frame_count == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = generate_with_config(model, char_tokenizer(), PROMPT_SETS[-1], 3, params, seed=7,
                                     config=EngineConfig(**{**FIXED, "compile": False}, weights="nf4"))
    assert completions(got) == completions(eager)
    torch.testing.assert_close(got.logprobs, eager.logprobs, atol=1e-5, rtol=0)


# ---- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("arch, lora", [("qwen2", False), ("llama", True)])
def test_gpu_nf4_engine_compiled_and_graphed(arch, lora):
    """On CUDA (Inductor, CUDA graph, the Triton kernel), nested NF4. An fp32 model (the kernel's "ieee" dots on
    bitsandbytes' fp32 W) gives the model engine's tokens (bitsandbytes' CUDA forward) with log-probs within
    KERNEL_GAP (module docstring), and compiled and graphed the eager step's. A bf16 model decodes graphed with no
    fallback warning (its compiled step is not compared with the eager one: Inductor fuses elementwise ops without
    the eager path's bf16 roundings between them, which moves log-probs by bf16 ulps and can flip a sampled token)."""
    torch._dynamo.reset()
    model = nf4_model(CONFIGS[arch](), nested=True, lora=lora).cuda()
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    got = run(model, EngineConfig(weights="nf4", compile=False), params, G=4)
    want = run(model, EngineConfig(weights="model", compile=False), params, G=4)
    assert completions(got) == completions(want)
    gap = (got.logprobs - want.logprobs).abs().max().item()
    assert gap <= KERNEL_GAP, f"log-prob gap {gap:.3e} > {KERNEL_GAP:.3e}"
    graphed = generate_with_config(model, char_tokenizer(), PROMPTS, 4, params, seed=3,
                                   config=EngineConfig(weights="nf4"))
    assert completions(graphed) == completions(got)
    torch.testing.assert_close(graphed.logprobs, got.logprobs, atol=1e-4, rtol=0)
    model.bfloat16()
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.compute_dtype = torch.bfloat16
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = generate_with_config(model, char_tokenizer(), PROMPTS, 4, params, seed=3,
                                       config=EngineConfig(weights="nf4"))
    assert not [w for w in caught if str(w.message).startswith("rollout:")], [str(w.message) for w in caught]
    assert torch.isfinite(graphed.logprobs).all()
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_auto_decodes_with_nf4_where_no_copy_fits(monkeypatch):
    """On a GPU the kernel runs on, a bf16 NF4 + LoRA model with (reported) free memory below any copy: "auto"
    resolves to "nf4" and decodes exactly as weights="nf4" does (uncompiled: same kernels, same bits)."""
    model = nf4_model(CONFIGS["llama"](), nested=True, lora=True, compute_dtype=torch.bfloat16).cuda().bfloat16()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 << 30))
    # and no cached blocks: resolved_weights counts them as free, and an earlier test in this process may have left
    # gigabytes in the allocator's cache (under xdist "fused" then fitted)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: torch.cuda.memory_allocated(device))
    assert decode_weights.resolved_weights(model, "auto") == "nf4"
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    got = run(model, EngineConfig(weights="auto", compile=False), params, G=2)
    want = run(model, EngineConfig(weights="nf4", compile=False), params, G=2)
    assert completions(got) == completions(want)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=0, rtol=0)
