"""PEFT's trainable_token_indices (LoraConfig(trainable_token_indices=[...]): some rows of the embedding trained, and
of a tied lm_head with them) under vLLM's merged weight sync, against test_rollout_vllm's stand-in for vLLM's model
(its fused names and padded vocabulary rows). bind refused it once vLLM had built its engine (~140 s cold), saying
vLLM's model had no weight for model.embed_tokens.token_adapter.weight. Now vLLM's embedding (and lm_head) holds the
base rows with the trained rows in place, a copy of its own whose trained rows alone each sync writes: the trainer's
base rows stay the frozen originals its reference forward runs. A tied embedding / lm_head that the trained model
runs with other rows in each is refused before vLLM builds, as is the adapter sync. The engine runs in
tests/test_vllm_gpu.py (test_merge_sync_runs_the_trained_token_rows)."""
import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, TrainableTokensConfig, get_peft_model
from test_rollout_vllm import H, V, assert_runs, logits, tiny, trained_away, vllm_like
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastgrpo.rollout import vllm as vllm_engine
from fastgrpo.rollout.vllm_lora import merged_sources
from fastgrpo.rollout.vllm_weights import bind
from fastgrpo.train.default_task import build_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
ROWS, HEAD_ROWS = [3, 5], [4, 6]
UNTIED = "model: trainable_token_indices on {}: vLLM ties the embedding and lm_head to one weight, while the trained " \
         "model runs other token rows in each; give the indices as a list (the embedding's trained rows, which PEFT " \
         "runs in the tied head too) or use the built-in engine (GRPOConfig(rollout_engine='builtin'), " \
         "--rollout-engine builtin, or fastgrpo.rollout.BuiltinEngine in place of VLLMEngine)"
# (tied, adapter config): the layouts vLLM runs exactly
LAYOUTS = {
    "embedding": (False, dict(trainable_token_indices=ROWS)),
    "embedding-and-head": (False, dict(trainable_token_indices={"embed_tokens": ROWS, "lm_head": HEAD_ROWS})),
    "head": (False, dict(trainable_token_indices={"lm_head": HEAD_ROWS})),
    "tied": (True, dict(trainable_token_indices=ROWS)),
    "tied-same-rows": (True, dict(trainable_token_indices={"embed_tokens": ROWS, "lm_head": ROWS})),
    "tokens-alone": (False, dict(target_modules=["embed_tokens"], token_indices=ROWS)),  # TrainableTokensConfig
    "tokens-alone-tied": (True, dict(target_modules=["embed_tokens"], token_indices=ROWS)),
}


def trained(tied: bool, options: dict):
    """LoRA on q/v (or PEFT's TrainableTokensConfig alone) with trained token rows, all away from their initial
    values (trained rows equal to the originals would hide which of the two vLLM runs)."""
    config = (TrainableTokensConfig(**options) if "token_indices" in options else
              LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **options))
    model = get_peft_model(tiny(tied=tied), config)
    return trained_away(model)


def token_layers(model) -> dict:
    """HF module name -> the PEFT TrainableTokensLayer that runs in its place."""
    from peft.tuners.trainable_tokens import TrainableTokensLayer

    return {name.removeprefix("base_model.model.").removesuffix(".token_adapter"): module
            for name, module in model.named_modules() if isinstance(module, TrainableTokensLayer)}


def vllm_rows(fake, module: str) -> torch.Tensor:
    """The rows vLLM runs for HF's module (a tied lm_head is vLLM's embedding)."""
    head = module == "lm_head" and hasattr(fake, "lm_head")
    return (fake.lm_head if head else fake.model.embed_tokens).weight[:V]


@pytest.mark.parametrize("share", [True, False], ids=["shared", "copied"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_runs_the_trained_token_rows(layout, share):
    tied, options = LAYOUTS[layout]
    model = trained(tied, options)
    layers = token_layers(model)
    originals = {name: layer.base_layer.weight.detach().clone() for name, layer in layers.items()}
    plain = copy.deepcopy(model).merge_and_unload()
    want = logits(model)
    fake = vllm_like(tied=tied)
    copies = bind(model, fake, share=share, merged=merged_sources(model))
    assert_runs(fake, plain, tied)
    torch.testing.assert_close(logits(model), want, rtol=0, atol=0)  # the trainer's forward is unchanged
    for name, layer in layers.items():
        indices = layer.token_indices["default"]
        rows = vllm_rows(fake, name)
        assert torch.equal(rows[indices], layer.trainable_tokens_delta["default"].detach())
        assert not torch.equal(rows, originals[name])  # not the frozen base rows...
        assert torch.equal(layer.base_layer.weight, originals[name])  # ...which stay the trainer's, for the reference
        assert layer.base_layer.weight.data_ptr() != rows.data_ptr()
    copied = {c.hf_name for c in copies}
    assert {name for name, layer in layers.items() if layer.tied_adapter is None} <= {n[:-7] for n in copied}
    assert ("model.layers.0.mlp.up_proj.weight" in copied) != share  # the rest is shared as before


@pytest.mark.parametrize("layout", ["embedding-and-head", "tied", "tokens-alone"])
def test_an_optimizer_step_on_the_trained_rows_reaches_vllm_with_the_sync(layout):
    """A real AdamW step after bind (the trainer builds its optimizer once the engine is built) moves the trained rows
    in place; the sync's refresh of the copies (load_weights) brings vLLM to the stepped model, rows included."""
    tied, options = LAYOUTS[layout]
    model = trained(tied, options)
    fake = vllm_like(tied=tied)
    copies = bind(model, fake, merged=merged_sources(model))
    layers = token_layers(model)
    before = {name: vllm_rows(fake, name).clone() for name in layers}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(input_ids=torch.tensor([[3, 4, 5, 6, 7, 3, 5]])).logits.logsumexp(-1).sum().backward()
    optimizer.step()
    for name, layer in layers.items():
        indices = layer.token_indices["default"]
        assert not torch.equal(layer.trainable_tokens_delta["default"].detach(), before[name][indices])
        assert torch.equal(vllm_rows(fake, name), before[name])  # nothing reaches vLLM before the sync
    with torch.no_grad():  # as load_weights refreshes them
        for rows in copies:
            rows.refresh()
    assert_runs(fake, copy.deepcopy(model).merge_and_unload(), tied)
    for name, layer in layers.items():
        indices = layer.token_indices["default"]
        assert torch.equal(vllm_rows(fake, name)[indices], layer.trainable_tokens_delta["default"].detach())


def test_an_active_adapter_without_trained_rows_runs_the_base_rows():
    """The layer runs its base rows where the active adapter trains none (PEFT's set_adapter to another one)."""
    model = trained(False, LAYOUTS["embedding"][1])
    model.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    model.set_adapter("other")
    fake = vllm_like(tied=False)
    bind(model, fake, merged=merged_sources(model))
    assert_runs(fake, copy.deepcopy(model).merge_and_unload(), False)
    assert torch.equal(fake.model.embed_tokens.weight[:V], token_layers(model)["model.embed_tokens"].base_layer.weight)


def test_the_weight_is_the_one_the_layers_forward_runs_with_the_adapters_on_and_off():
    """trained_tokens_weight (the export's) and the base weight with trained_rows put in place (what a sync writes
    into vLLM's copy) are the weight the layer's forward runs: the trained rows in place, and under PEFT's
    disable_adapter() (GRPO's KL reference forward) the frozen base rows."""
    from fastgrpo.hf.peft import trained_rows, trained_tokens_weight

    def base_with_trained_rows(layer):
        weight = layer.base_layer.weight.detach().clone()
        for indices, values in trained_rows(layer):
            weight[indices] = values
        return weight

    model = trained(False, LAYOUTS["embedding"][1])
    layer = token_layers(model)["model.embed_tokens"]
    ids = torch.arange(V)
    for weight in (trained_tokens_weight(layer), base_with_trained_rows(layer)):
        assert torch.equal(torch.nn.functional.embedding(ids, weight), layer(ids))
    with model.disable_adapter():
        assert trained_rows(layer) == []
        assert torch.equal(trained_tokens_weight(layer), layer.base_layer.weight)
        assert torch.equal(torch.nn.functional.embedding(ids, trained_tokens_weight(layer)), layer(ids))


@pytest.mark.parametrize("options, named", [
    (dict(trainable_token_indices={"lm_head": HEAD_ROWS}), "lm_head"),
    (dict(trainable_token_indices={"embed_tokens": ROWS, "lm_head": HEAD_ROWS}), "model.embed_tokens and lm_head"),
    (dict(target_modules=["lm_head"], token_indices=HEAD_ROWS), "lm_head"),  # TrainableTokensConfig: no LoRA layer
], ids=["head", "other-rows-each", "tokens-alone-head"])
def test_other_rows_in_a_tied_embedding_and_head_are_refused_before_vllm_builds(no_vllm, options, named):
    """vLLM's tied lm_head IS its embedding: one weight cannot hold the head's trained rows and the embedding's
    base rows (or two sets of rows trained apart). PEFT's merge_and_unload writes both into the one tied weight."""
    model = trained(True, options)
    refusal = UNTIED.format(named)
    with pytest.raises(ValueError) as caught:
        merged_sources(model)
    assert str(caught.value) == refusal
    with pytest.raises(ValueError) as caught:
        vllm_engine.VLLMEngine(model, build_tokenizer(), max_model_len=32, lora_sync="merge",
                                  execution="eager")
    assert str(caught.value) == refusal


class Built(Exception):
    """vLLM's engine was asked for: every check before it passed."""


@pytest.mark.parametrize("layout", ["tokens-alone", "tokens-alone-tied"])
def test_trainable_tokens_alone_reach_vllms_build(layout, monkeypatch):
    """PEFT's TrainableTokensConfig alone (no LoRA layer) runs under the merged sync; the refusal of other tuners
    (LoHa, IA3, ...) refused it too, naming TRAINABLE_TOKENS as an adapter vLLM does not run."""
    class BuildingVLLM:
        def LLM(**kwargs):  # noqa: N802 - vllm.LLM
            raise Built

    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: BuildingVLLM)
    monkeypatch.setattr(vllm_engine, "check_model", lambda model: None)  # it wants the model on CUDA
    monkeypatch.setattr(vllm_engine, "_process_state_kept", contextlib.nullcontext)  # CUDA's RNG state
    with pytest.raises(Built):
        vllm_engine.VLLMEngine(trained(*LAYOUTS[layout]), build_tokenizer(), max_model_len=32, execution="eager")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_adapter_sync_refuses_trainable_tokens_before_vllm_builds(no_vllm, tied):
    """vLLM's LoRA path runs the adapter over vLLM's own base, whose rows are the frozen originals; its PEFTHelper
    knows no trained token rows."""
    model = trained(tied, LAYOUTS["tied" if tied else "embedding"][1])
    with pytest.raises(ValueError) as caught:
        vllm_engine.VLLMEngine(model, build_tokenizer(), max_model_len=32, lora_sync="adapter",
                                  execution="eager")
    assert str(caught.value) == (
        "model: vLLM's LoRA does not run adapters with ['trainable_token_indices']; use lora_sync='merge' "
        "(GRPOConfig(vllm_lora_sync='merge'), --vllm-lora-sync merge)")


OTHER_ROWS, UNTRAINED = [4, 6], 10  # a second adapter's trained rows; a row no adapter trains


def with_a_second_adapter(tied: bool):
    """trained(...) plus an adapter "other" training OTHER_ROWS (its rows and LoRA away from the base's)."""
    model = trained(tied, LAYOUTS["tied" if tied else "embedding"][1])
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                          trainable_token_indices=OTHER_ROWS, init_lora_weights=False))
    with torch.no_grad():
        token_layers(model)["model.embed_tokens"].trainable_tokens_delta["other"].add_(1.0)
    return model


def sync(copies) -> None:
    with torch.no_grad():  # as load_weights refreshes them
        for rows in copies:
            rows.refresh()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_sync_writes_the_trained_rows_and_gives_back_the_base_rows_no_longer_trained(tied):
    """Each sync brings vLLM's embedding to merge_and_unload's weight, bit for bit, writing trained rows alone: a
    marker in vLLM's copy of an untrained row survives it. When the trained rows change between syncs (set_adapter
    to an adapter training others; fastgrpo's trainer never switches, a user of VLLMEngine may), the rows trained
    before get the base's values back. A base weight written in place is copied whole again."""
    model = with_a_second_adapter(tied)
    layer = token_layers(model)["model.embed_tokens"]
    fake = vllm_like(tied=tied)
    copies = bind(model, fake, merged=merged_sources(model))
    embedding = fake.model.embed_tokens.weight
    changes = {
        "the trained rows stepped": lambda: layer.trainable_tokens_delta["default"].add_(1.0),
        "other rows trained": lambda: model.set_adapter("other"),
        "the first rows again": lambda: model.set_adapter("default"),
    }
    for change, apply in changes.items():
        with torch.no_grad():
            apply()
            untrained_row = embedding[UNTRAINED].clone()
            embedding[UNTRAINED] = 1e4
        sync(copies)
        assert (embedding[UNTRAINED] == 1e4).all(), f"{change}: the sync wrote an untrained row"
        with torch.no_grad():
            embedding[UNTRAINED] = untrained_row
        assert_runs(fake, copy.deepcopy(model).merge_and_unload(), tied)
    with torch.no_grad():  # an optimizer step on a base left trainable
        layer.base_layer.weight.mul_(2.0)
    sync(copies)
    assert_runs(fake, copy.deepcopy(model).merge_and_unload(), tied)
    with model.disable_adapter():
        sync(copies)
    assert torch.equal(embedding[:V], layer.base_layer.weight)


class NewStorages(TorchDispatchMode):
    """The bytes of each tensor storage created by the ops run under it (an in-place op's output is its input;
    lift_fresh's input is a tensor torch.tensor just built from Python data)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  and func is not torch.ops.aten.lift_fresh.default}
        self.sizes += [t.untyped_storage().nbytes() for t in tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


@pytest.mark.parametrize("share", [True, False], ids=["shared", "copied"])
@pytest.mark.parametrize("layout", ["embedding-and-head", "tied", "tokens-alone"])
def test_a_sync_allocates_the_trained_rows_not_the_weight(layout, share):
    """A sync of the trained token rows allocates at most a cast of each layer's k trained rows [k, H] and their k
    int64 indices: for Llama-3.1-8B's embedding (128256 x 4096 in bf16) a few KB where PEFT's get_merged_weights
    built the whole 1 GB weight each sync."""
    tied, options = LAYOUTS[layout]
    model = trained(tied, options)
    fake = vllm_like(tied=tied)
    copies = bind(model, fake, share=share, merged=merged_sources(model))
    layers = {name: layer for name, layer in token_layers(model).items() if layer.tied_adapter is None}
    token_copies = [c for c in copies if c.hf_name.removesuffix(".weight") in layers]
    assert len(token_copies) == len(layers)
    with torch.no_grad():
        for layer in layers.values():
            layer.trainable_tokens_delta["default"].add_(1.0)
    with NewStorages() as created:
        sync(token_copies)
    item = next(iter(layers.values())).base_layer.weight.element_size()
    budget = sum(len(layer.token_indices["default"]) * (H * item + 8) for layer in layers.values())
    whole = V * H * item
    assert sum(created.sizes) <= budget and max(created.sizes, default=0) < whole, (
        f"a sync created storages of {created.sizes} bytes; budget {budget}, the whole weight {whole}")
    assert_runs(fake, copy.deepcopy(model).merge_and_unload(), tied)


def test_a_base_weight_given_other_data_is_copied_whole():
    """A base weight whose data is another tensor since the last sync (weight.data = ..., as PEFT's merge writes it;
    its version counter stays) reaches vLLM whole."""
    model = trained(False, LAYOUTS["embedding"][1])
    layer = token_layers(model)["model.embed_tokens"]
    fake = vllm_like(tied=False)
    copies = bind(model, fake, merged=merged_sources(model))
    sync(copies)
    version = layer.base_layer.weight._version
    layer.base_layer.weight.data = torch.randn_like(layer.base_layer.weight)
    assert layer.base_layer.weight._version == version
    sync(copies)
    assert_runs(fake, copy.deepcopy(model).merge_and_unload(), False)


@pytest.mark.parametrize("trainer_dtype, vllm_dtype", [(torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32)], ids=["fp32-bf16", "bf16-fp32"])
def test_vllm_runs_the_rows_merge_and_unload_writes_in_another_dtype(trainer_dtype, vllm_dtype):
    """vLLM's weights in another dtype than the trainer's (an fp32 trainer, a bf16 engine; or a bf16 base whose
    trained rows PEFT keeps in fp32, under an fp32 engine): each sync casts the rows as merge_and_unload's weight
    holds them (the base's dtype), then to vLLM's."""
    model = get_peft_model(tiny(tied=False).to(trainer_dtype),
                           LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=ROWS))
    layer = token_layers(model)["model.embed_tokens"]
    fake = vllm_like(tied=False).to(vllm_dtype)
    copies = bind(model, fake, merged=merged_sources(model))
    for step in range(2):
        with torch.no_grad():
            layer.trainable_tokens_delta["default"].add_(torch.randn_like(layer.trainable_tokens_delta["default"]))
        sync(copies)
        want = copy.deepcopy(model).merge_and_unload().model.embed_tokens.weight.to(vllm_dtype)
        assert torch.equal(fake.model.embed_tokens.weight[:V], want), f"sync {step}"


@pytest.mark.parametrize("after", ["adapters-off", "other-adapter"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_rows_merged_at_a_sync_get_the_base_back_after_peft_unmerges(tied, after):
    """A sync while PEFT's merge_adapter() holds the trained rows in the base weight copies it whole; PEFT's
    unmerge_adapter() then writes the originals back in place through weight.data, which moves no version counter.
    A later sync with those rows no longer trained (the adapters off, another adapter active) left vLLM on the
    merged rows; it gives the base's rows back, as for rows trained at the sync before."""
    model = with_a_second_adapter(tied)
    layer = token_layers(model)["model.embed_tokens"]
    fake = vllm_like(tied=tied)
    copies = bind(model, fake, merged=merged_sources(model))
    model.merge_adapter()
    sync(copies)
    model.unmerge_adapter()
    assert not torch.equal(fake.model.embed_tokens.weight[ROWS], layer.base_layer.weight[ROWS])  # merged rows
    if after == "adapters-off":
        with model.disable_adapter():
            sync(copies)
        assert torch.equal(fake.model.embed_tokens.weight[:V], layer.base_layer.weight)
    else:
        model.set_adapter("other")
        sync(copies)
        assert_runs(fake, copy.deepcopy(model).merge_and_unload(), tied)
        assert torch.equal(fake.model.embed_tokens.weight[ROWS], layer.base_layer.weight[ROWS])
