"""The loading child of a torch-free actor (`cold_native`, `pred_native`, through `clib.load`):
`python -m actors.pack MODULE:CLASS FD` reads the role's arguments (pickled) from stdin, builds
the role's torch implementation in its packing mode (it loads what it holds with the same code as
ever, and maps no channel), and has it write the tensors of its native loop's arguments into the
memory file FD (`pack`), what it says of itself going back pickled on stdout; or the load's
error, as itself. The load's prints and logs go to stderr."""
from __future__ import annotations

import importlib
import os
import pickle
import sys

import torch

from powerinfer.formats.gguf import mapped_at

from .packed import BLOCKS, DTYPES, Mapped, Packed, Slot, Zeros


def packed_tensor(t: torch.Tensor, fd: int, at: int) -> tuple[object, int]:
    """t written into the file fd at `at` or after (aligned), as `cold_native` maps it back: its
    `Packed` and where the file's next tensor may start; a tensor without memory (meta: a KV
    cache the executor allocates, its blocks first) as `Zeros`, one the model reads in place from
    its file (`GGUFSource.mapped_rows`) as `Mapped`, nothing written."""
    code = DTYPES.index(str(t.dtype).removeprefix("torch."))
    if t.device.type == "meta":
        return Zeros(code, (BLOCKS, *t.shape[1:])), at
    t = t.detach()
    n = t.numel() * t.element_size()
    if n and t.device.type == "cpu" and t.is_contiguous():
        if (in_file := mapped_at(t.data_ptr(), n)) is not None:
            return Mapped(*in_file, code, tuple(t.shape)), at
    t = t.contiguous()
    align = 4096 if n >= 1 << 20 else 64
    at = -(-at // align) * align
    if n:
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < n:
            done += os.pwrite(fd, data[done:], at + done)
    return Packed(at, code, tuple(t.shape)), at + n


def pack_args(args: tuple, fd: int, slots: dict[int, str]) -> tuple[tuple, int]:
    """A native loop's arguments with every tensor written into fd (`packed_tensor`), lists
    walked, and the tensors whose memory only the running process may own (`slots`: id ->
    name: counters it updates) as `Slot`s; and the file's size."""
    end = 0

    def put(v):
        nonlocal end
        if isinstance(v, list):
            return [put(x) for x in v]
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) in slots:
            return Slot(slots[id(v)])
        packed, end = packed_tensor(v, fd, end)
        return packed

    return tuple(put(v) for v in args), end


def main():
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        module, name = sys.argv[1].split(":")
        kwargs = pickle.load(sys.stdin.buffer)
        role = getattr(importlib.import_module(module), name)(**kwargs, packing=True)
        got = role.pack(int(sys.argv[2]))
    except Exception as e:  # noqa: BLE001 - the role's to raise
        try:
            pickle.loads(pickle.dumps(e))
            got = {"error": e}
        except Exception:  # noqa: BLE001 - (an error that does not pickle: its text)
            got = {"error": RuntimeError(f"{type(e).__name__}: {e}")}
    out.write(pickle.dumps(got))
    out.close()


if __name__ == "__main__":
    main()
