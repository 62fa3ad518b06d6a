"""GGUF block types the CPU kernel cannot read (K-quants, I-quants, Q5), converted once per file
to the nearest one it can, and cached beside the model's bundle.

The kernel reads Q4_0, Q4_1 and Q8_0 blocks (and f32/bf16 rows). A file with other block types
would otherwise be widened to bf16 at load, three to four times its size in memory. Instead its
weights are rewritten, a tensor at a time, as

- Q4_1 from the 2- to 4.5-bit types (Q2_K, Q3_K, Q4_K, IQ*, TQ*). A Q4_K sub-block of 32 is a
  scale and a minimum over 4-bit codes, which is what a Q4_1 block is: those are rewritten
  block for block, the codes kept (`q4_k_to_q4_1`, exact up to the fp16 rounding of the
  sub-block's scale and minimum); the others are dequantized and requantized;
- Q8_0 from the 5- to 6.5-bit ones (Q5_0, Q5_1, Q5_K, Q6_K): nothing 4-bit would keep them.

The copy holds the converted tensors and every metadata record, nothing else: the model's other
tensors are read from the original, which must stay beside it (a Q4_0 file whose only K-quant is
its Q6_K output head is copied as that head alone, not as a second whole file). The copy is
`<model>.bundle/kernel-formats.gguf` (or, where the model's folder is read-only, under
`~/.cache/powerinfer/`), with `kernel-formats.json` beside it: per converted tensor its types
and its relative RMS error (||w' - w|| / ||w||, w dequantized from the original), and their
summary, which is also logged. It is made again if the model file changes (size or mtime), and
once over a whole-file copy an earlier version made.
"""
from __future__ import annotations

import fcntl
import json
import logging
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from ..formats.bundle import (CONVERTED_ONLY_KEY, SOURCE_KEY, cache_path, converted_report,
                              source_stamp)
from ..formats.gguf import open_gguf
from ..formats.kquants import KQUANT_LAYOUTS, dequantize, q4_k_codes
from ..formats.loader import load_checkpoint
from ..formats.pwri import GGUF_VERSION, STR, U32, kv_record, raw_field, write_gguf
from ..kernels import quantize_rows

log = logging.getLogger("powerinfer")


KERNEL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")  # read as they are


LAYOUT = "converted-only"  # the report's mark of a copy holding only the converted tensors


TO_Q8 = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_1", "Q8_K")


def target(kind: str) -> str | None:
    """The type a tensor of type `kind` is converted to (None: kept as it is)."""
    if kind in KERNEL_TYPES or kind.startswith("I") and kind[1:].isdigit():  # I8..I64
        return None
    return "Q8_0" if kind in TO_Q8 else "Q4_1"


def needs_conversion(info: dict) -> bool:
    """Whether a checkpoint (its `info`) has block types the kernel cannot read."""
    return info.get("format") == "GGUF" and any(
        target(t) for t in info.get("tensor_types", {}))


def converted(model: Path, progress: bool = True) -> Path:
    """The model's converted copy, made now if it is missing or stale. Processes loading the
    model at once (a model's replicas) make it once: one converts, the others wait for it."""
    model = Path(model)
    out = cache_path(model)
    report = out.with_suffix(".json")
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file() and (made := converted_report(out)) is not None and \
                made["source"] == source_stamp(model) and made.get("layout") == LAYOUT:
            return out
        summary = convert(model, out, progress)
        summary["layout"] = LAYOUT
        summary["model"] = str(model.resolve())  # where the K-quant blocks kept as they are live
        report.write_text(json.dumps(summary, indent=1))
    own = [k for k in summary["types"] if k in KQUANT_LAYOUTS]  # read as they are (int4)
    why = (f"a 4-bit load reads its {', '.join(own)} blocks as they are; a copy in 32-wide "
           "blocks, for a sparse FFN's records and a GPU," if own else
           "has block types the CPU kernel cannot read:")
    log.info("%s: %s converted once to %s (%s); relative RMS error over the converted tensors: "
             "mean %.2f%%, worst %.2f%% (%s)", model.name, why, out,
             ", ".join(f"{k}->{v}" for k, v in summary["types"].items()),
             100 * summary["mean_error"], 100 * summary["max_error"], summary["worst"])
    return out


def convert(model: Path, out: Path, progress: bool = True, whole: bool = False) -> dict:
    """Write `out`: `model`'s tensors of types the kernel cannot read, converted, and its
    records. whole: every other tensor too, byte for byte (the whole-file copy earlier versions
    made, which loads without the original: `benchmarks/convert.py`'s baseline)."""
    import gguf


    reader = open_gguf(model)
    if int(reader.fields["GGUF.version"].parts[-1][0]) != GGUF_VERSION:
        raise ModelLoadError(model, "only GGUF version 3 files are converted")
    errors: dict[str, float] = {}
    types: dict[str, str] = {}
    tensors = {}
    bar = _progress(progress, sum(1 for t in reader.tensors if target(t.tensor_type.name)),
                    model.name)

    def produce(t, to):
        def run():
            n = int(t.shape[0])  # a row's values (ggml's shape is reversed)
            w = dequantize(t.data, t.tensor_type.name, n)
            if t.tensor_type.name == "Q4_K":
                q = q4_k_to_q4_1(np.asarray(t.data, np.uint8).reshape(w.shape[0], -1))
            else:
                q = quantize_rows(w, to.lower()).numpy()
            back = dequantize(q, to, n)
            errors[t.name] = float(torch.linalg.vector_norm(back - w)
                                   / max(float(torch.linalg.vector_norm(w)), 1e-30))
            bar.update(1)
            return q
        return run

    for t in reader.tensors:
        kind, shape = t.tensor_type.name, tuple(int(d) for d in t.shape)
        to = target(kind)
        if to is None:  # read from the original
            if whole:
                tensors[t.name] = (shape, int(t.tensor_type), t.data.view(np.uint8).reshape(-1))
            continue
        if len(shape) != 2 or shape[0] % 32:
            raise ModelLoadError(model, f"tensor {t.name} ({kind}, shape {shape}) cannot be "
                                 "converted to a 32-wide block type")
        qt = gguf.GGMLQuantizationType[to]
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        tensors[t.name] = (shape, int(qt), (shape[0] // block * nbytes * shape[1], produce(t, to)))
        types[kind] = to
    kvs = [raw_field(reader, f) for k, f in reader.fields.items()
           if not k.startswith("GGUF.") and k not in (SOURCE_KEY, CONVERTED_ONLY_KEY)]
    kvs.append(kv_record(SOURCE_KEY, STR, source_stamp(model)))
    kvs += [] if whole else [kv_record(CONVERTED_ONLY_KEY, U32, 1)]
    write_gguf(out, bytes(reader.data[:4]), kvs, tensors, int(reader.alignment))
    bar.close()
    worst = max(errors, key=errors.get) if errors else None
    return {"source": source_stamp(model), "types": types, "tensors": errors,
            "mean_error": float(np.mean(list(errors.values()))) if errors else 0.0,
            "max_error": errors[worst] if worst else 0.0, "worst": worst}


def q4_k_to_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows (rows, 144 bytes per 256 weights) -> Q4_1 rows (rows, 20 bytes per 32), the
    same 4-bit codes under each sub-block's own scale and minimum (ggml's block_q4_K layout:
    d, dmin (fp16), 12 bytes of 6-bit sub-block scales and minimums, 128 bytes of codes)."""

    rows = raw.shape[0]
    b = np.array(raw, np.uint8).reshape(rows, -1, 144)  # (a copy: the file's map is read-only)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, mn, codes = (t.numpy() for t in q4_k_codes(torch.from_numpy(b)))
    scale = (d[..., None] * sc).astype(np.float16)  # (rows, blocks, 8 sub-blocks)
    minimum = (-dmin[..., None] * mn).astype(np.float16)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # Q4_1: weight i low, weight i+16 high
    out = np.concatenate([scale[..., None].view(np.uint8), minimum[..., None].view(np.uint8),
                          packed], axis=-1)
    return out.reshape(rows, -1)


def _progress(enabled: bool, total: int, name: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"converting {name}", unit="tensor", disable=not enabled)


def kernel_ready(ck, config, progress: bool = True):
    """The checkpoint (header only) a load with `config` reads: `ck`, or its converted copy's
    where the file has block types the kernel cannot read and the configuration keeps weights
    quantized (weights or cold_weights "int4", or "auto" where that chooses 4-bit blocks on this
    machine: `Config.resolve`)."""

    decided = config.resolve(True)
    if "int4" not in (decided.weights, decided.cold_weights) or not needs_conversion(ck.info):
        return ck
    return load_checkpoint(converted(ck.path, progress), with_weights=False)
