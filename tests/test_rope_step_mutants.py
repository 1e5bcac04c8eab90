"""Decode steps without HF's rope update (fastgrpo/rollout/rope_step.py, fastgrpo/hf/rope_update.py), where the
suite's other cases could not tell a mutant apart (found by the rope-step mutation audit). No rollout: the rotary
module of a tiny dynamic-rope Llama alone."""
import functools
import types

import pytest
import torch

from fastgrpo.hf.rope_update import position_updated_rotaries
from fastgrpo.rollout.rope_step import rotary_without_updates
from tests.test_rollout_rope_step import ScalarReads, _closure
from tests.test_rollout_variants import model_of


def _rotary():
    return model_of("llama-dynamic-rope").model.rotary_emb


def test_a_method_bound_by_someone_else_stays():
    """A rotary forward bound on the instance as a method of another function (a library's own rotary) is not HF's:
    the decode steps keep it. The suite bound a functools.partial, which has no __func__, so a check that took any
    bound method for HF's passed it."""
    rotary = _rotary()

    def theirs(module, x, position_ids):
        return type(module).forward(module, x, position_ids)

    rotary.forward = types.MethodType(theirs, rotary)
    with rotary_without_updates(rotary):
        assert rotary.forward.__func__ is theirs
    assert rotary.forward.__func__ is theirs


def _twice(forward):
    kept = forward  # a second cell holding the same function: the one the wrapper calls

    @functools.wraps(forward)
    def logged(module, x, position_ids):
        assert forward is not None
        return kept(module, x, position_ids)

    return logged


@pytest.mark.parametrize("wrap", [_closure, _twice], ids=["closure", "two-cells"])
def test_what_is_found_runs_without_the_update(wrap):
    """What position_updated_rotaries returns for a class whose forward has a link above HF's update (5.17 stacks
    torch.no_grad) must not run the update: the dynamic one reads a value on the host. The suite followed the rebuilt
    chain's __wrapped__ and compared numbers at positions the update leaves alone, so a rebuilt link still calling
    the update passed; as did rebuilding only the first of two cells holding the function (the wrapper below calls
    it through the second)."""
    rotary = _rotary()
    rotary.__class__ = type("Rotary", (type(rotary),), {"forward": wrap(type(rotary).forward)})
    found = position_updated_rotaries(rotary)
    assert found or wrap is _twice  # the closure wrapper is rebuilt: the test does not pass for want of it
    for module, without in found:
        with ScalarReads() as reads:
            without(module, torch.zeros(1, 1, 4), torch.tensor([[3]]))
        assert reads.reads == 0
