"""Workarounds for library versions and platforms, kept in one place."""
from __future__ import annotations

import types

import numpy as np
import torch


def gguf_reader(path):
    """A `gguf.GGUFReader` that parses over a plain ndarray view of its memory map.

    The stock reader slices an `np.memmap` hundreds of thousands of times while reading metadata,
    and memmap's `__array_finalize__` dominates (over 3 s for a 49k-token vocabulary); the same
    parse over a plain view of the same mapping takes a fraction of that.
    """
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    return _PlainViewReader(path, "r")


def compile_per_instance(method):
    """torch.compile a bound method with its own compiled-code cache, and without re-checking
    the module state on every call.

    Dynamo's guards on every parameter and submodule cost over 1 ms a decode step of a 30-layer
    model; the documented filter that skips them assumes one model per compiled function, but
    Dynamo keeps one cache per code object, which every instance of a class shares: a second
    model would be handed the first model's graph. A copy of the code object gives this instance
    a cache of its own."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    return torch.compile(types.MethodType(own, method.__self__), dynamic=True, options={
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
