"""A method bound to a module instance that does not keep the instance alive.

patch_model and enable_offload_checkpointing put forwards in a module's __dict__. A types.MethodType there holds
the module (module -> __dict__ -> method -> module): a reference cycle, so `del model; torch.cuda.empty_cache()`
gave no GPU memory back until the next gc pass. WeakBoundMethod reaches the module through a weak reference.
"""
from __future__ import annotations

import copy
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any


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
