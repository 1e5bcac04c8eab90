"""Reversible binding of forwards on module instances, shared by patch_model and activation offload.

`bind_forward` puts a new forward in one module's __dict__ (accelerate's hooked modules keep theirs in
`_old_forward`) and returns how to restore exactly what was there; no class is modified. A types.MethodType in a
module's __dict__ would hold the module (module -> __dict__ -> method -> module): a reference cycle, so
`del model; torch.cuda.empty_cache()` gave no GPU memory back until the next gc pass. WeakBoundMethod reaches the
module through a weak reference instead.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple


class WeakBoundMethod:
    """`func` bound to `instance` as types.MethodType binds it, holding the instance weakly.

    It reads like a bound method: __func__, __self__, inspect.signature without the first parameter. A deepcopy
    (e.g. of a patched model) is bound to the copy of the instance, and so are the bound methods func's closure
    holds: a copy's forward that wraps the instance's previous forward calls the copy's, not the original's.
    """

    __slots__ = ("__func__", "_instance", "__weakref__")

    def __init__(self, func: Callable, instance: object) -> None:
        self.__func__ = func
        self._instance = weakref.ref(instance)

    @property
    def __self__(self) -> Any:
        instance = self._instance()
        if instance is None:
            raise ReferenceError(f"{self.__func__.__qualname__}: the instance it was bound to has been freed")
        return instance

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # HF's generate reads the kwargs forward takes from it
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __deepcopy__(self, memo: dict) -> WeakBoundMethod:
        return WeakBoundMethod(_with_rebound_closure(self.__func__, memo), copy.deepcopy(self.__self__, memo))

    def __reduce__(self):
        # pickle (torch.save(model)) would fail inside the function held, naming a transformers function
        owner = type(self._instance()).__name__
        raise TypeError(
            f"model: a model patched by fastgrpo cannot be pickled ({owner}.forward is bound on the instance); save "
            "its state_dict() or use save_pretrained(), or call fastgrpo.unpatch_model(model) (or "
            "fastgrpo.disable_offload_checkpointing) first"
        )

    def __repr__(self) -> str:
        instance = self._instance()
        target = "a freed instance" if instance is None else f"{type(instance).__name__} at {id(instance):#x}"
        return f"<weakly bound method {self.__func__.__qualname__} of {target}>"


def _with_rebound_closure(func: Callable, memo: dict) -> Callable:
    """func whose closure's bound methods (the forward it wraps) are deep-copied, so bound to the copies of their
    instances; the rest of the closure is shared, as deepcopy shares functions."""
    cells = func.__closure__ if isinstance(func, types.FunctionType) else None
    if not cells or not any(_holds_bound_method(cell) for cell in cells):
        return func
    closure = tuple(
        types.CellType(copy.deepcopy(cell.cell_contents, memo)) if _holds_bound_method(cell) else cell
        for cell in cells
    )
    return copy_function(func, func.__globals__, closure)


def _holds_bound_method(cell: types.CellType) -> bool:
    try:
        return isinstance(cell.cell_contents, (WeakBoundMethod, types.MethodType))
    except ValueError:  # an empty cell
        return False


def copy_function(fn: types.FunctionType, scope: dict, closure: tuple | None) -> types.FunctionType:
    """fn's code run against other globals (`scope`) and another closure."""
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, closure)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__qualname__ = fn.__qualname__
    clone.__dict__.update(fn.__dict__)
    return clone


class Binding(NamedTuple):
    previous: Callable  # the forward that was in effect (the class's, weakly bound, or an instance-level one)
    restore: Callable[[], None]  # puts back exactly what was there; weakly bound to the module


def bind_forward(module: Any, make_forward: Callable[[Callable], Callable]) -> Binding:
    """Bind make_forward(previous) on this instance as its forward, `previous` being the forward in effect.

    The new forward is bound weakly (it receives the module as its first argument). A deepcopy of the module copies
    the binding with it, and the copy's `restore` restores the copy.
    """
    attr = "_old_forward" if hasattr(module, "_hf_hook") else "forward"
    own = module.__dict__.get(attr)
    previous = own if own is not None else WeakBoundMethod(type(module).forward, module)
    bound = WeakBoundMethod(make_forward(previous), module)
    module.__dict__[attr] = bound

    def restore(module: Any) -> None:
        if module.__dict__.get(attr) is not bound:
            # Bound over since, by a forward that may call this one (TRL's trainers wrap the model's forward with
            # their fused lm_head): that one stays, and this one now passes straight to the forward it replaced.
            bound.__func__ = _passing_to(previous, inspect.signature(bound.__func__))
        elif own is None:
            del module.__dict__[attr]
        else:
            module.__dict__[attr] = own

    return Binding(previous, WeakBoundMethod(restore, module))


def _passing_to(previous: Callable, signature: inspect.Signature) -> Callable:
    """A forward (taking the module first) that calls `previous`, showing `signature`."""

    def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        return previous(*args, **kwargs)

    forward.__signature__ = signature
    return forward


def as_method(module: Any, undo: contextlib.ExitStack) -> None:
    """Until `undo` closes, a WeakBoundMethod forward of `module` becomes a types.MethodType of the same function,
    for torch.compile: dynamo guards an instance-level forward that is not a types.MethodType by its identity (a
    forward bound anew per call recompiles per call) and a MethodType by its function's code. The strong reference
    cycle this makes is undone with it."""
    bound = module.__dict__.get("forward")
    if isinstance(bound, WeakBoundMethod):
        module.__dict__["forward"] = types.MethodType(bound.__func__, module)
        undo.callback(module.__dict__.__setitem__, "forward", bound)


def signature_with_self(previous: Callable) -> inspect.Signature:
    """`previous`'s signature with `self` first, for a forward bind_forward binds over it: HF reads a forward's
    parameter names (generate builds the attention mask from pad tokens and passes logits_to_keep only to a forward
    that names them; the Trainer drops the dataset columns it does not name, every one for (*args, **kwargs))."""
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.signature(previous)
    return signature.replace(parameters=[this, *signature.parameters.values()])
