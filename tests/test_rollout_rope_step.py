"""The engine's decode steps run dynamic and longrope rotary modules without HF's per-call frequency update
(fastgrpo/rollout/rope_step.py): no host sync in a step (what made the CUDA-graph capture fail), the same tokens and
log-probs as HF's forward, and HF's own forward back afterwards."""
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.modeling_rope_utils import dynamic_rope_update

from fastgrpo.hf.rope_update import position_updated_rotaries
from fastgrpo.rollout import decode
from fastgrpo.rollout.rope_step import rotary_without_updates
from tests.test_rollout_variants import PROMPTS, engine_greedy, hf_forward, model_of

# dynamic rescales past max_position_embeddings (49; gemma3: on its global layers), the long variant is past its
# longrope threshold (2) from the prefill on, the short one below its threshold (49) throughout
ROPE_VARIANTS = ["llama-dynamic-rope", "gemma3-dynamic-global", "phi3-longrope-long", "phi3-longrope-short"]
LONG = 60  # tokens of an HF forward past both thresholds of 49


def chain(forward) -> list:
    """The codes of a forward's decorator chain, outermost first (functools.wraps' __wrapped__)."""
    codes, link = [], getattr(forward, "__func__", forward)
    while link is not None:
        codes.append(link.__code__)
        link = getattr(link, "__wrapped__", None)
    return codes


UPDATE = dynamic_rope_update(lambda module, x, position_ids: None).__code__  # its wrapper's code, one for all


class ScalarReads(TorchDispatchMode):
    """Records the ops that copy a tensor's value to the host (.item(), bool(tensor), int(tensor)): a device sync,
    which a CUDA-graph capture cannot take."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_decode_steps_make_no_host_sync_and_skip_the_rope_update(variant, monkeypatch):
    model = model_of(variant)
    rotary = model.model.rotary_emb
    assert UPDATE in chain(type(rotary).forward)
    steps = []  # per decode step: (host reads, whether the rotary's forward in effect runs HF's update)

    def recorded(*args, **kwargs):
        with ScalarReads() as mode:
            step(*args, **kwargs)
        steps.append((mode.reads, UPDATE in chain(rotary.forward)))

    step = decode._decode_step
    monkeypatch.setattr(decode, "_decode_step", recorded)
    engine_greedy(model)
    assert len(steps) == 23  # S - 1: the prefill samples the first token
    assert steps == [(0, False)] * len(steps), steps


def test_the_dynamic_update_syncs_on_the_host():
    """What the test above guards against: HF's decorated forward of a dynamic rotary module reads a value on the
    host (transformers 5.17 and 5.24; 5.17's longrope update too, 5.24's no longer)."""
    rotary = model_of("llama-dynamic-rope").model.rotary_emb
    with ScalarReads() as mode:
        rotary(torch.zeros(1, 1, 4), torch.tensor([[3]]))
    assert mode.reads > 0


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_hf_forward_is_back_after_a_rollout_from_a_grown_rope_state(variant):
    """Before the rollout HF's forward runs past the thresholds (dynamic grows its frequencies, longrope switches to
    the long factors): the prefill's update resets them, so the engine still equals HF's forward over each row.
    Afterwards the rotary module has no forward of its own again and HF's forward gives what it gave before."""
    model = model_of(variant)
    rotary = model.model.rotary_emb
    ids = [torch.arange(5, 5 + n)[None] % 40 for n in (9, LONG)]
    with torch.no_grad():
        before = [model(x).logits for x in ids]
    out = engine_greedy(model)
    assert "forward" not in rotary.__dict__
    assert rotary.forward.__func__ is type(rotary).forward
    for row, prompt in zip(range(0, 2 * len(PROMPTS), 2), PROMPTS):
        want = hf_forward(model, prompt, out.tokens[row])
        assert torch.equal(out.tokens[row], want.argmax(-1)), (variant, row)
        # the bound of tests/test_rollout_variants.py (fp32 forwards of different shapes)
        torch.testing.assert_close(out.logprobs[row].double(), want.gather(1, out.tokens[row][:, None])[:, 0],
                                   atol=1e-4, rtol=0)
    with torch.no_grad():
        after = [model(x).logits for x in ids]
    for x, b, a in zip(ids, before, after):
        assert torch.equal(b, a), (variant, x.shape[1], (b - a).abs().max().item())


def test_a_decode_step_that_fails_leaves_hf_forward_bound(monkeypatch):
    """The training forwards after a failed rollout (an out-of-memory step, an interrupt) still update by position."""
    model = model_of("llama-dynamic-rope")
    rotary = model.model.rotary_emb

    def failing(*args, **kwargs):
        assert UPDATE not in chain(rotary.forward)  # the rollout had bound its forward
        raise RuntimeError("step failed")

    monkeypatch.setattr(decode, "_decode_step", failing)
    with pytest.raises(RuntimeError, match="step failed"):
        engine_greedy(model)
    assert "forward" not in rotary.__dict__


def test_one_trace_serves_every_rollout():
    """compile_scope="step" traces the rotary module inside the step, compiled once for every rollout: the forward
    bound anew per rollout must not be guarded by its identity (a recompile per rollout, and past dynamo's limit of 8
    an eager step), and it traces without a graph break (fullgraph)."""
    rotary = model_of("llama-dynamic-rope").model.rotary_emb
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run = torch.compile(lambda module, x, positions: module(x, positions), backend="eager", fullgraph=True,
                        dynamic=False)
    for last in (3, 4, 5):
        with rotary_without_updates(rotary):
            cos, sin = run(rotary, torch.zeros(1, 1, 4), torch.tensor([[last]]))
        torch.testing.assert_close((cos, sin), rotary(torch.zeros(1, 1, 4), torch.tensor([[last]])), atol=0, rtol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def _closure(forward):
    @functools.wraps(forward)
    def logged(module, x, position_ids):
        return forward(module, x, position_ids)

    return logged


def _no_wrapped(forward):
    def plain(module, x, position_ids):
        return forward(module, x, position_ids)

    return plain


def _opaque(forward):
    table = {"forward": forward}  # the closure holds the table, not the function

    @functools.wraps(forward)
    def looked_up(module, x, position_ids):
        return table["forward"](module, x, position_ids)

    return looked_up


@pytest.mark.parametrize("wrap, found", [(None, True), (_closure, True), (_no_wrapped, False), (_opaque, False)],
                         ids=["hf", "closure", "no-wrapped", "opaque"])
def test_the_update_is_taken_out_of_the_decorator_chain(wrap, found):
    """The forward without the update is the class's decorator chain with HF's update link taken out, the links
    above it kept (5.17 stacks torch.no_grad on top). A class whose chain cannot be followed (a later transformers,
    a subclass) keeps its forward: nothing is found."""
    rotary = model_of("llama-dynamic-rope").model.rotary_emb
    if wrap is not None:
        rotary.__class__ = type("Rotary", (type(rotary),), {"forward": wrap(type(rotary).forward)})
    rotaries = position_updated_rotaries(rotary)
    if not found:
        assert rotaries == []
        return
    [(module, without)] = rotaries
    assert module is rotary
    assert chain(without) == [code for code in chain(type(rotary).forward) if code is not UPDATE]
    positions = torch.tensor([[3, 4]])
    torch.testing.assert_close(without(rotary, torch.zeros(1, 2, 4), positions),
                               rotary(torch.zeros(1, 2, 4), positions), atol=0, rtol=0)


def test_other_rope_types_and_forwards_bound_by_others_are_left_alone():
    assert position_updated_rotaries(model_of("llama-linear-rope-gelu-tied")) == []
    rotary = model_of("llama-dynamic-rope").model.rotary_emb
    theirs = functools.partial(type(rotary).forward, rotary)
    rotary.forward = theirs
    with rotary_without_updates(rotary):
        assert rotary.forward is theirs
    assert rotary.forward is theirs
