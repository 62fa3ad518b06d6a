"""What a torch-free actor's loading child hands it (`actors.pack` writes it, `clib.unpack`
reads it): the native loop's arguments with every tensor as `Packed` (in the memory file),
`Mapped` (in the model's own file), `Zeros` (allocated by the actor: a KV cache) or a `Slot` (a
value only the running process knows).
A module of its own, with neither torch nor the loader behind it, so that the child, the torch
executor that packs and the torch-free one share it without importing each other."""
from __future__ import annotations

from typing import NamedTuple

# tensor element types by code, the order of csrc/capi.h's PI_DTYPES (bfloat16 held as uint16)
DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "bool")


class Slot(str):
    """A value of the loop's arguments that only the process that runs it knows: a channel's
    address or size, the group's RoPE tables (mapped), the input-sparsity counters."""


# (the child's placeholders for the RoPE tables and the masks' channel)
ROPE = ((Slot("rope_cos"), Slot("rope_sin")), (Slot("rope_cos_local"), Slot("rope_sin_local")))
AHEAD = Slot("ahead")


class Packed(NamedTuple):
    """A tensor the child wrote: its offset in the memory file, element type, shape (C order)."""
    offset: int
    dtype: int
    shape: tuple[int, ...]


class Mapped(NamedTuple):
    """A tensor the model reads in place from its file (a GGUF file's own bytes: Gemma 3's
    embedding), which the actor maps again rather than holding a copy: its pages are the page
    cache's, shared with every process that maps the file, and only those read become resident.
    The file, the tensor's offset in it, element type, shape (C order)."""
    path: str
    offset: int
    dtype: int
    shape: tuple[int, ...]


class Zeros(NamedTuple):
    """A tensor the actor allocates zeroed (a KV cache: resident as its blocks are written); its
    first dimension `BLOCKS`, the plane's KV block count, which the actor knows (so what a child
    packed holds for a pool of any size: `shard_cache`)."""
    dtype: int
    shape: tuple


BLOCKS = Slot("num_blocks")
