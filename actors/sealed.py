"""A model's table as the group's actors receive it: `Sealed`, pickled once with its architecture
beside it. Its own module, light to import: a torch-free cold executor (`cold_native`) unpickles
the seal and passes the bytes on to its loading child unopened."""
from __future__ import annotations

import pickle
from dataclasses import dataclass

from powerinfer.formats.args import ModelArgs


@dataclass(frozen=True)
class Sealed:
    """A model's table (`ModelFile`) pickled once, its architecture beside it: unpickling the
    table imports torch (its readers'), so a process that computes without torch (a torch-free
    cold executor, `cold_native`) receives it sealed and hands the bytes to its loading child."""
    args: ModelArgs
    data: bytes
    # the files the table reads (the model's, a converted copy's): what a shard cache entry of
    # it follows from beside the bytes (`shard_cache.key`)
    files: tuple = ()

    @classmethod
    def of(cls, table) -> "Sealed":
        from .shard_cache import named_files
        return cls(table.args, pickle.dumps(table), tuple(sorted(named_files(table), key=str)))

    def open(self):
        return pickle.loads(self.data)


def unseal(model):
    """The table of a `Sealed` one, or model as it is."""
    return model.open() if isinstance(model, Sealed) else model
