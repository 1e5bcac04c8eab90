"""PEFT tuners and LoRA options other than plain LoRA, on tiny Llama and Qwen2 models (random weights, trained-away
adapters): what trains, what the built-in rollout engine samples from and what the export writes must be one model.

Checked for rsLoRA, DoRA, LoRA biases, rank / alpha patterns, LoRA on the embeddings, LoHa, LoKr, IA3, AdaLoRA,
VeRA, OFT and two LoRA adapters with one or both active: patch_model + the fused GRPO loss give eager PEFT's loss and
gradients (tests/test_patching_variants.py's oracle); the built-in engine's decode copies ("dense", "fused": a LoRA
layer merged into one weight, any other tuner layer running its own forward) give HF generate's greedy tokens and
log-probs; the export writes a model computing the PEFT model's logits, or the layout is refused before the first
step (check_mergeable). Found and fixed: LoHa, LoKr, IA3, VeRA and OFT were refused by the export (now merged by
PEFT's merge on a copy of each layer); adapters merged by merge_adapter were exported with their delta added twice;
a LoRA initialization that moves part of the base weights into the adapter (PiSSA, OLoRA, ...) made GRPO's KL
reference (the model with its adapters disabled) the residual weights; prompt learning failed mid-step; vLLM refused
another tuner only once it had built its engine.
"""
import copy
import sys

import pytest
import torch
from peft import (
    AdaLoraConfig, IA3Config, LoHaConfig, LoKrConfig, LoraConfig, OFTConfig, PrefixTuningConfig, PromptTuningConfig,
    VeraConfig, get_peft_model,
)

from fastgrpo.hf import peft as hf_peft
from fastgrpo.loss.model import sequence_logprobs
from fastgrpo.patching import patch_model
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.vllm_settings import BUILTIN_ENGINE
from fastgrpo.train import default_task
from tests.test_adapter_layout_early import RUNS, _base, _grpo, assert_exported_as_merged
from tests.test_patching_variants import assert_same_grpo_step
from tests.test_rollout import PROMPTS, char_tokenizer, completions, hf_greedy, tiny_model

TARGETS = ["q_proj", "v_proj", "down_proj"]
FP32_EPS = torch.finfo(torch.float32).eps
TUNERS = {
    "rslora": lambda: LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, use_rslora=True),
    "dora": lambda: LoraConfig(r=4, target_modules=TARGETS, use_dora=True),
    "bias-lora-only": lambda: LoraConfig(r=4, target_modules=TARGETS, bias="lora_only"),
    "bias-all": lambda: LoraConfig(r=4, target_modules=TARGETS, bias="all"),
    "lora-bias": lambda: LoraConfig(r=4, target_modules=TARGETS, lora_bias=True),
    "rank-alpha-patterns": lambda: LoraConfig(r=4, target_modules=TARGETS, rank_pattern={"v_proj": 2},
                                              alpha_pattern={"down_proj": 32}),
    "embedding": lambda: LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]),
    "loha": lambda: LoHaConfig(r=4, target_modules=TARGETS),
    "lokr": lambda: LoKrConfig(r=4, target_modules=TARGETS),
    "ia3": lambda: IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj"]),
    "adalora": lambda: AdaLoraConfig(init_r=4, target_r=2, target_modules=TARGETS, total_step=10),
    "vera": lambda: VeraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "oft": lambda: OFTConfig(r=0, oft_block_size=8, target_modules=TARGETS),
}


def _adapted(model, tuner: str, seed: int = 1):
    """model with the tuner's adapter, every trainable tensor moved away from its initial value (a zero LoRA B, an
    IA3 vector of ones or an identity OFT rotation would make any mix-up invisible)."""
    model = get_peft_model(model, TUNERS[tuner]())
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.2 * torch.randn_like(param))
    return model


def _two_adapters(model, active):
    """Two LoRA adapters on overlapping layers ("two" a DoRA one where it runs alone), `active` of them on."""
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                           adapter_name="one")
    model.add_adapter("two", LoraConfig(r=2, target_modules=["q_proj", "k_proj"], init_lora_weights=False,
                                      use_dora=active == ["two"]))
    model.base_model.set_adapter(active)
    return model


LAYOUTS = {
    **{tuner: lambda arch, tuner=tuner: _adapted(tiny_model(arch), tuner) for tuner in TUNERS},
    "two-adapters-one-active": lambda arch: _two_adapters(tiny_model(arch), ["two"]),
    "two-adapters-both-active": lambda arch: _two_adapters(tiny_model(arch), ["one", "two"]),
}


@pytest.fixture
def torch_ops(monkeypatch):
    """The rollout's ops on their plain-torch path (tests/test_decode_weights.py: the interpreter takes ~0.1 s per
    linear and step)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("fastgrpo.ops.") and hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda *tensors: False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Qwen2's q/k/v have biases
@pytest.mark.parametrize("layout", LAYOUTS)
def test_patched_grpo_loss_trains_what_eager_peft_trains(layout, arch):
    model = LAYOUTS[layout](arch).train()
    assert_same_grpo_step(model, patch_model(copy.deepcopy(model)))




@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_engine_decodes_the_trained_model(torch_ops, layout, arch):
    """The decode copies ("dense" merges each LoRA layer it can into one weight, "fused" stacks q/k/v and gate/up)
    give HF generate's greedy tokens and its log-probs on the PEFT model itself."""
    tokenizer, model = char_tokenizer(), LAYOUTS[layout](arch).eval()
    wanted = [hf_greedy(model, tokenizer, prompt, 6) for prompt in PROMPTS[:2]]
    for weights in ("dense", "fused"):
        result = generate_with_config(model, tokenizer, PROMPTS[:2], 1, SamplingParams(max_new_tokens=6, temperature=0),
                                      seed=0, config=EngineConfig(weights=weights))
        for row, (tokens, logps) in enumerate(wanted):
            assert completions(result)[row] == tokens, (weights, PROMPTS[row])
            torch.testing.assert_close(result.logprobs[row, :len(tokens)].double(),
                                       torch.tensor(logps, dtype=torch.float64), atol=1e-4, rtol=0)


BASE_CHANGING = {"pissa": dict(init_lora_weights="pissa"), "pissa-niter": dict(init_lora_weights="pissa_niter_2"),
                 "olora": dict(init_lora_weights="olora")}


@pytest.mark.parametrize("init", BASE_CHANGING)
def test_a_reference_that_is_not_the_starting_model_is_refused(tmp_path, init):
    """PiSSA / OLoRA subtract the adapter's starting product from the base weights: with the adapter disabled (GRPO's
    KL reference for a PEFT model) the model is the residual, far from the one training started from. It was trained
    towards it silently; now GRPOTrainer refuses it in one line where beta > 0, and trains where beta = 0."""
    tokenizer = default_task.build_tokenizer()
    base = _base(tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        start = base(input_ids=ids).logits
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **BASE_CHANGING[init]))
        torch.testing.assert_close(model(input_ids=ids).logits, start, rtol=1e-4, atol=1e-4)
        with model.disable_adapter():
            residual = model(input_ids=ids).logits
    assert (residual - start).abs().max() > 1e-2  # the reference the KL pulled towards
    value = BASE_CHANGING[init]["init_lora_weights"]
    refusal = (f"model: adapter 'default' has init_lora_weights='{value}', which moved part of the base weights into "
               "the adapter, so the KL reference (the model with its adapters disabled) is not the model training "
               "started from; set beta=0, or initialize the adapter with init_lora_weights=True")
    with pytest.raises(ValueError) as refused:
        _grpo(model, tokenizer, tmp_path / "kl", export=False, beta=0.04)
    assert str(refused.value) == refusal
    history = _grpo(model, tokenizer, tmp_path / "no-kl", export=False, beta=0.0).train()
    assert [m["step"] for m in history] == [1]


def test_inits_that_keep_the_base_keep_their_reference(tmp_path):
    """Gaussian, orthogonal and the default initializations leave the base as it was: its KL reference is."""
    tokenizer = default_task.build_tokenizer()
    for init in (True, "gaussian", "orthogonal"):
        model = get_peft_model(_base(tokenizer), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init))
        assert hf_peft.base_changing_init(model) is None
        _grpo(model, tokenizer, tmp_path / str(init), export=False, beta=0.04)


@pytest.mark.parametrize(("init", "moves_base"), [
    ("pissa", True), ("pissa_niter_4", True), ("olora", True), ("OLoRA", True), ("corda", True), ("lora_ga", True),
    ("loftq", True),  # PEFT runs OLoRA for "olora" in any case, PiSSA and CorDA for their lowercase names only
    (True, False), (False, False), ("gaussian", False), ("orthogonal", False), ("eva", False), ("mica", False),
])
def test_base_changing_init_names_each_init_that_moves_the_base(init, moves_base):
    """Every PEFT initialization that writes W - B A * scale (or a quantized W) into the base is named, whatever
    adapter holds it; one that leaves the base (B A = 0 at init) is not. Configs alone: CorDA, LoRA-GA and LoftQ need
    data or a quantized base to initialize a model; LoftQ's config is set after construction, whose check of its
    loftq_config imports scipy (not among the test dependencies)."""
    mine = LoraConfig(r=4, init_lora_weights=init) if init != "loftq" else LoraConfig(r=4)
    mine.init_lora_weights = init
    model = torch.nn.Module()
    model.peft_config = {"other": LoraConfig(r=4), "mine": mine}
    assert hf_peft.base_changing_init(model) == (("mine", init) if moves_base else None)


EXPORTED = [name for name in LAYOUTS if name != "lora-bias"]  # over a base without a bias: refused (Llama's)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", EXPORTED)
def test_the_export_writes_the_model_the_peft_forward_runs(tmp_path, layout, arch):
    """final/ holds the weights merge_and_unload gives (bitwise, fp32) and, loaded as a plain HF model, computes the
    PEFT model's logits. LoHa, LoKr, IA3, VeRA and OFT were refused (merged weights lack ...q_proj.weight): they
    merge by PEFT's own merge on a copy of each layer, as DoRA does."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.train.final_export import export_model

    tokenizer, model = char_tokenizer(), LAYOUTS[layout](arch).eval()
    export_model(model, tokenizer, tmp_path / "final", dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(got.state_dict()) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got.state_dict()[name], tensor), (name, (got.state_dict()[name] - tensor).abs().max().item())
    ids = torch.tensor([[4, 9, 13, 2, 30, 7, 11, 5]])
    with torch.no_grad():
        peft_logits, exported = model(input_ids=ids).logits, got(input_ids=ids).logits
    # fp32: merged and unmerged products round differently, a few ulps of the largest logit per layer (seen: 12)
    err, bound = (exported - peft_logits).abs().max().item(), 64 * FP32_EPS * peft_logits.abs().max().item()
    assert err <= bound, (layout, err, bound)


@pytest.mark.parametrize("tuner", ["loha", "ia3"])
def test_a_grpo_run_of_another_tuner_trains_and_exports(tmp_path, tuner):
    """Refused before the first step where the run exported (its merge was unknown); now it trains and final/ holds
    the trained model merged."""
    tokenizer = default_task.build_tokenizer()
    model = _adapted(_base(tokenizer), tuner)
    history = _grpo(model, tokenizer, tmp_path, export=True, learning_rate=1e-2).train()
    assert [m["step"] for m in history] == [1]
    assert_exported_as_merged(model, tmp_path / "final")


def test_another_tuner_over_a_4bit_base_is_refused_by_the_export(tmp_path):
    """Its merge would have to quantize the merged weight again (as DoRA's over a 4-bit base): one line, at the
    start of a run that exports."""
    pytest.importorskip("bitsandbytes", reason="a 4-bit base needs bitsandbytes (the dev extra installs it)")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tokenizer = default_task.build_tokenizer()
    _base(tokenizer, arch="qwen2").save_pretrained(tmp_path / "base")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, device_map="cpu")
    model = get_peft_model(base, IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError) as refused:
        hf_peft.check_mergeable(model)
    assert str(refused.value) == ("model: model.layers.0.self_attn.q_proj: IA3Layer over a Linear4bit base "
                                  "(quantized, or not a linear or an embedding) cannot be merged into a plain weight; "
                                  "unsupported adapter layout")


PROMPT_LEARNING = {"prompt-tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
                   "prefix-tuning": lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)}


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("kind", PROMPT_LEARNING)
def test_prompt_learning_is_refused_when_the_trainer_is_built(tmp_path, kind, run):
    """PeftModel's forward adds the virtual tokens; the rollout and the fused loss run the base model's layers, so
    the run failed mid-step (GRPO's prefill: "Tensors must have same number of dimensions: got 2 and 4"; SFT's
    backward: "element 0 of tensors does not require grad"). Now one line before anything runs, and from the loss."""
    tokenizer = default_task.build_tokenizer()
    model = get_peft_model(_base(tokenizer), PROMPT_LEARNING[kind]())
    name = model.peft_config["default"].peft_type.value
    refusal = (f"model: adapter 'default' is {name} (prompt learning), which PeftModel's forward adds as virtual "
               "tokens, while fastgrpo's loss and rollout run the base model's layers; use an adapter in the layers "
               "(LoRA, ...)")
    with pytest.raises(ValueError) as refused:
        RUNS[run](model, tokenizer, tmp_path, export=False)
    assert str(refused.value) == refusal
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError) as refused:
        sequence_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0, 0, 1, 1]]))
    assert str(refused.value) == refusal


@pytest.mark.parametrize("tuner", ["loha", "ia3", "adalora"])
def test_vllm_refuses_another_tuner_before_it_builds(tuner, no_vllm):
    """vLLM runs LoRA adapters only: another tuner's parameters have no place in its model, which bind said once vLLM
    had built its engine (minutes), naming one as a weight vLLM's model lacks."""
    from fastgrpo.rollout import vllm as vllm_engine

    model = _adapted(_base(default_task.build_tokenizer(), "qwen2"), tuner)
    kind = model.peft_config["default"].peft_type.value
    with pytest.raises(ValueError) as refused:
        vllm_engine.VLLMEngine(model, char_tokenizer(), max_model_len=32)
    assert str(refused.value) == f"model: adapter 'default' is {kind}, and vLLM runs LoRA adapters only; use " \
                                 f"{BUILTIN_ENGINE}"


@pytest.mark.parametrize("tuner", ["rslora", "embedding", "dora", "loha", "ia3"])
def test_the_export_of_merged_adapters_adds_them_once(tmp_path, tuner):
    """After PEFT's merge_adapter (a user's faster evaluation, say) the base weights hold the adapters: the export
    added a plain LoRA's delta B A * scale to them again (rsLoRA here: logits 0.19 off)."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.train.final_export import export_model

    tokenizer, model = char_tokenizer(), _adapted(tiny_model("llama"), tuner).eval()
    ids = torch.tensor([[4, 9, 13, 2, 30, 7, 11, 5]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.base_model.merge_adapter()
        export_model(model, tokenizer, tmp_path / "final", dtype=torch.float32)
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()(input_ids=ids).logits
    err, bound = (got - want).abs().max().item(), 64 * FP32_EPS * want.abs().max().item()
    assert err <= bound, (tuner, err, bound)


@pytest.mark.parametrize("run", RUNS)
def test_adalora_says_what_the_trainers_do_not_run(tmp_path, caplog, run):
    """AdaLoRA's ranks are allocated by update_and_allocate in the user's loop, and its orthogonal regularization is
    added to a labels= loss by AdaLoraModel's forward: neither runs in fastgrpo's trainers, which said nothing."""
    import logging

    tokenizer = default_task.build_tokenizer()
    model = get_peft_model(_base(tokenizer), TUNERS["adalora"]())
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.input_checks"):
        RUNS[run](model, tokenizer, tmp_path, export=False)
    assert ("model: adapter 'default' is AdaLoRA, whose rank allocation (update_and_allocate) and orthogonal "
            "regularization (orth_reg_weight) fastgrpo's trainers do not run: it trains at its initial ranks "
            "(init_r=4), as an SVD-form LoRA") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.input_checks"):
        RUNS[run](get_peft_model(_base(tokenizer), TUNERS["rslora"]()), tokenizer, tmp_path / "lora", export=False)
    assert "AdaLoRA" not in caplog.text


def test_a_tuner_type_is_read_as_its_name_whether_enum_or_string():
    """peft_type holds a PeftType where PEFT built the config, and may hold the plain string where a config was
    written by hand; each check compares the name."""
    config = LoraConfig(r=4)
    assert hf_peft.peft_type_name(config) == "LORA"
    config.peft_type = "ADALORA"
    assert hf_peft.peft_type_name(config) == "ADALORA"

def _mixed(tokenizer):
    model = get_peft_model(_base(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                           adapter_name="lora", mixed=True)
    model.add_adapter("loha", LoHaConfig(r=4, target_modules=["q_proj", "down_proj"]))
    model.set_adapter(["lora", "loha"])
    return model


MIXED = ("model: a PeftMixedModel (get_peft_model(..., mixed=True), adapters of several tuner types at once) is not "
         "supported; use a PeftModel, whose adapters are of one tuner type")


@pytest.mark.parametrize("run", [*RUNS, "patch_model", "loss"])
def test_a_mixed_model_is_refused_in_one_line(tmp_path, run):
    """PeftMixedModel has no get_base_model: taken for the transformers model, patch_model bound the fused loss on it
    (its labels= forward then failed: no last_hidden_state) and the trainers failed mid-step (GRPO's rollout: no
    _supports_sdpa). Now one line, before anything runs."""
    tokenizer = default_task.build_tokenizer()
    model = _mixed(tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    calls = {**{name: lambda run=run: RUNS[run](model, tokenizer, tmp_path, export=False) for name in RUNS},
             "patch_model": lambda: patch_model(model),
             "loss": lambda: sequence_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0, 0, 1, 1]]))}
    with pytest.raises(ValueError) as refused:
        calls[run]()
    assert str(refused.value) == MIXED
