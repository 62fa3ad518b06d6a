"""Import and export of the original PowerInfer's GGUF layout (model file and GPU index split file).

What the original reads, checked in its sources (SJTU-IPADS/PowerInfer: llama.cpp, ggml.c, ggml.h,
gguf-py/gguf/constants.py, convert-hf-to-powerinfer-gguf.py, convert.py,
powerinfer-py/powerinfer/export_split.py):

Model file
- An ordinary GGUF v3 file whose first 4 bytes are b"PWRI" instead of b"GGUF": the converters
  write a normal GGUF, then overwrite the first uint32 with int.from_bytes(b"PWRI", "little")
  (convert-hf-to-powerinfer-gguf.py, convert.py). gguf_init_from_file (ggml.c) accepts either
  magic, b"PWRI" meaning sparse inference, rejects version 1; the rest of the header is GGUF's.
- The sparse loader (llm_load_sparse_model_tensors, llama.cpp) serves architectures llama,
  bamboo (and refact, falcon) with: token_embd [n_embd, n_vocab], output_norm, output
  [n_embd, n_vocab] (required: no tied embeddings), per layer attn_norm, attn_q/k/v/output,
  ffn_norm, ffn_gate [n_embd, n_ff], ffn_up [n_embd, n_ff], and instead of ffn_down:
  blk.N.ffn_down_t.weight [n_embd, n_ff] (ggml order: one row of n_embd per neuron; numpy
  (n_ff, n_embd)), blk.N.fc1.weight [n_embd, r] (numpy (r, n_embd)), blk.N.fc2.weight [r, n_ff]
  (numpy (n_ff, r)); r is a wildcard, so it may differ per layer. No attention biases. With a
  CUDA build the loader refuses a file holding any other tensor ("wrong number of tensors"), and
  both converters write ffn_down_t in place of ffn_down (convert.py: postprocess_transpose), so
  the export below does the same. convert.py (HF llama and mistral -> arch "llama") permutes
  q/k rows as llama.cpp does, which loader.py undoes as for any llama GGUF.
- Types: the converter stores 2-D tensors in the file's type (f16 by default); the CPU axpy over
  ffn_down_t (ggml.c, ggml_compute_forward_mul_mat_axpy) reads f16 rows (or Q4_0), hence F16 here.
- Key powerinfer.sparse_threshold (f32, optional; gguf_writer.add_sparse_threshold), read only for
  PWRI files; default 0.0 (or the LLAMA_SPARSE_PRED_THRESHOLD environment variable).
- Predictor at run time (llm_build_ffn_sparse): idx = fc2 @ relu(fc1 @ x); a neuron is computed
  unless `gpu_idx[i] == 1 || idx[i] < threshold` (ggml_compute_forward_mul_mat_sparse), so it is
  active when its logit >= threshold; no sigmoid. x for llama/bamboo is `ffn_inp`, the pre-norm
  residual entering the FFN: build_llama_variants passes `ffn_inp, // as for now, llama's pred use
  the same input as the ffn` while the FFN itself gets llm_build_norm(ffn_inp); falcon passes
  `inpL, // Falcon uses the layer's input as the pred input`.
- FFN of a PWRI file: llama runs relu(gate) * up (LLM_FFN_RELU, LLM_FFN_PAR), bamboo
  relu(gate) * relu(up) (LLM_FFN_SYM), whatever the dense model's activation.

GPU index split file
- Looked for at `<model file name>.generated.gpuidx` (llm_load_gpu_split_with_budget).
- Written by export_split.py with GGUFWriter(path, "generic.gpu_index"), then its first 8 bytes
  overwritten with b"PWRI" and version 3. Keys: general.architecture, generic.gpu_index.block_count
  (u32, add_block_count; not read back), split.vram_capacity (u64, required and type-checked:
  the split is used only when the VRAM budget >= it).
- Tensors, read by position (llama_gpu_split_loader): exactly 2 per layer, tensor 2N is
  blk.N.gpu_idx (I32 [n_ff], 1 = neuron on the GPU) and 2N+1 blk.N.gpu_bucket (I32, the sorted
  indices of the GPU neurons); a layer with none or all neurons on the GPU ignores its bucket.
  I32 is type 18 there (ggml.h: I8, I16, I32 follow Q8_K = 15); today's ggml numbers it 26 and
  reads 18 as IQ3_XXS, so compat.gguf_reader maps 16-18 back for PWRI files.

Ours only (the original ignores unknown keys): powerinfer.ffn_activation (the FFN activation) and
powerinfer.predictor_input ("ffn" or "layer": which x the predictors were trained on).
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from ..errors import ConfigError, ModelLoadError
from .bundle import Bundle, BundleError, model_record, write_atomically
from .gguf import dequantize, gguf_metadata, open_gguf
from .loader import load_checkpoint

PWRI_MAGIC, GGUF_VERSION = b"PWRI", 3


SPLIT_ARCH = "generic.gpu_index"


THRESHOLD_KEY, VRAM_KEY = "powerinfer.sparse_threshold", "split.vram_capacity"


ACT_KEY, INPUT_KEY = "powerinfer.ffn_activation", "powerinfer.predictor_input"


FFN_ACTS = {"llama": "reglu", "bamboo": "dreglu"}  # architectures the original reads, their FFN


F16, I32 = 1, 18  # ggml type ids in the original's ggml.h (today's ggml numbers I32 26)


U32, F32, STR, U64 = 4, 6, 8, 10  # GGUF value type ids


_PACK = {U32: "<I", F32: "<f", U64: "<Q"}


_PREDICTOR_TENSOR = re.compile(r"blk\.(\d+)\.(fc1|fc2|ffn_down_t|ffn_down)\.weight")


def split_path(model_file: Path) -> Path:
    """Where the original looks for a model's GPU index split file."""
    return Path(model_file).with_name(Path(model_file).name + ".generated.gpuidx")


def export_pwri(model_file: Path, bundle: Bundle, out: Path, predictor_input: str = "ffn",
                threshold: float = 0.0) -> Path:
    """Write `out`, a PowerInfer model file: the tensors and metadata of `model_file` (the GGUF
    the bundle was made from) copied byte for byte, each blk.N.ffn_down replaced by its transpose
    blk.N.ffn_down_t (f16), output.weight added for a tied model, and the bundle's predictors
    `predictors.{predictor_input}` as blk.N.fc1/fc2 (f16); magic b"PWRI".

    The original feeds llama/bamboo predictors the residual entering the FFN ("ffn"); predictors
    trained on the layer input ("layer") are written as they are and marked in
    powerinfer.predictor_input."""
    model_file, out = Path(model_file), Path(out)
    if out.resolve() == model_file.resolve():  # (it overwrote the model, orphaning its bundle)
        raise ConfigError(f"--out {out} is the model file itself: name another file")
    bundle.check_model(model_file)
    ck = load_checkpoint(model_file, with_weights=False)
    a, arch = ck.args, ck.info["gguf_arch"]
    if FFN_ACTS.get(arch) != a.ffn_act or a.qkv_bias or a.o_bias:
        # (said as "cannot load model", which it could)
        raise ConfigError(f"{model_file.name} cannot be written as a PWRI file: the original "
                          "PowerInfer runs PWRI files of llama (reglu FFN) and bamboo (dreglu "
                          f"FFN) models without attention biases; this is {arch} with a "
                          f"{a.ffn_act} FFN"
                          + (" and attention biases" if a.qkv_bias or a.o_bias else ""))
    part = f"predictors.{predictor_input}"
    bundle.require(part, "train-predictors")
    pred = bundle.load_tensors(f"{part}.safetensors")

    reader = open_gguf(model_file)
    tensors = {}  # name: (ggml shape, ggml type, bytes as a uint8 or typed array)
    for t in reader.tensors:
        m = _PREDICTOR_TENSOR.fullmatch(t.name)
        if m and m[2] == "ffn_down":
            tensors[f"blk.{m[1]}.ffn_down_t.weight"] = _f16(dequantize(t).T)
        elif not (m and m[2] in ("fc1", "fc2")):
            tensors[t.name] = _raw(reader, t)
    tensors.setdefault("output.weight", tensors["token_embd.weight"])  # the original requires it
    for i in range(a.n_layers):
        if f"blk.{i}.ffn_down_t.weight" not in tensors:
            raise ModelLoadError(model_file, f"no blk.{i}.ffn_down.weight")
        fc1, fc2 = pred.get(f"fc1.{i}"), pred.get(f"fc2.{i}")
        if fc1 is None or fc2 is None or fc1.ndim != 2 or fc1.shape[1] != a.dim \
                or fc2.shape != (a.ffn_dim, fc1.shape[0]):
            raise BundleError(bundle.path, f"{part}.safetensors: layer {i} needs fc1.{i} (rank, "
                              f"{a.dim}) and fc2.{i} ({a.ffn_dim}, rank); it has "
                              f"{_shape(fc1)} and {_shape(fc2)}")
        tensors[f"blk.{i}.fc1.weight"] = _f16(fc1)
        tensors[f"blk.{i}.fc2.weight"] = _f16(fc2)

    ours = (THRESHOLD_KEY, ACT_KEY, INPUT_KEY)
    kvs = [raw_field(reader, f) for k, f in reader.fields.items()
           if not k.startswith("GGUF.") and k not in ours]
    kvs += [kv_record(THRESHOLD_KEY, F32, threshold), kv_record(ACT_KEY, STR, a.ffn_act),
            kv_record(INPUT_KEY, STR, predictor_input)]
    write_gguf(out, PWRI_MAGIC, kvs, tensors, int(reader.alignment))
    return out


def export_gpu_index(bundle: Bundle, out: Path, vram_capacity: int) -> Path:
    """Write the bundle's placement as the original's split file (see `split_path` for the
    name it looks for). vram_capacity: bytes the GPU part needs; the original uses the split
    only under a VRAM budget at least this large."""
    hot = bundle.placement()
    tensors = {}
    for i, h in enumerate(hot):  # the original reads them by position: gpu_idx, gpu_bucket, ...
        tensors[f"blk.{i}.gpu_idx"] = _tensor(h.astype(np.int32), I32)
        tensors[f"blk.{i}.gpu_bucket"] = _tensor(np.flatnonzero(h).astype(np.int32), I32)
    kvs = [kv_record("general.architecture", STR, SPLIT_ARCH),
           kv_record(f"{SPLIT_ARCH}.block_count", U32, len(hot)), kv_record(VRAM_KEY, U64, vram_capacity)]
    write_gguf(Path(out), PWRI_MAGIC, kvs, tensors)
    return Path(out)


def import_pwri(model_file: Path, bundle_dir: Path, gpu_index: Path | None = None) -> Bundle:
    """Create a bundle at `bundle_dir` from a PowerInfer model file: its predictors (and, from
    `gpu_index` or the split file found next to the model, its placement)."""
    model_file = Path(model_file)
    ck = load_checkpoint(model_file, with_weights=False)
    a, meta = ck.args, ck.tokenizer_source[1]  # a GGUF checkpoint's metadata
    if ck.info["format"] != "PWRI":
        raise ModelLoadError(model_file, "not a PowerInfer model file (magic b'GGUF', "
                             "expected b'PWRI')")
    fc = {}
    for i in range(a.n_layers):
        t1, t2 = ck.extra.get(f"blk.{i}.fc1.weight"), ck.extra.get(f"blk.{i}.fc2.weight")
        if t1 is None or t2 is None:
            raise ModelLoadError(model_file, f"no predictor for layer {i} "
                                 f"(blk.{i}.fc1.weight / blk.{i}.fc2.weight)")
        fc1, fc2 = dequantize(t1), dequantize(t2)  # numpy (r, dim), (ffn_dim, r)
        if fc1.shape[1] != a.dim or fc2.shape != (a.ffn_dim, len(fc1)):
            raise ModelLoadError(model_file, f"predictor of layer {i} has shapes {fc1.shape} and "
                                 f"{fc2.shape}, expected (rank, {a.dim}) and ({a.ffn_dim}, rank)")
        fc[f"fc1.{i}"], fc[f"fc2.{i}"] = fc1, fc2
    if gpu_index is None and split_path(model_file).is_file():
        gpu_index = split_path(model_file)
    hot = None
    if gpu_index is not None:
        hot, vram = read_gpu_index(gpu_index)
        if len(hot) != a.n_layers or any(len(h) != a.ffn_dim for h in hot):
            raise ModelLoadError(gpu_index, f"GPU index of {len(hot)} layers x "
                                 f"{sorted({len(h) for h in hot})} neurons does not fit "
                                 f"{model_file.name} ({a.n_layers} x {a.ffn_dim})")

    bundle = Bundle.create(bundle_dir, model=model_record(model_file, a))
    # PowerInfer's models are ReLU-family: a neuron fires when its activation is above 0
    bundle.save_tensors("thresholds.safetensors",
                        {"threshold": np.zeros(a.n_layers, np.float32)})
    bundle.mark("thresholds", {"source": model_file.name, "sparsity": None})
    inp = str(meta.get(INPUT_KEY, "ffn"))
    threshold = float(meta.get(THRESHOLD_KEY, 0.0))
    bundle.save_tensors(f"predictors.{inp}.safetensors", fc)
    bundle.save_json(f"predictors.{inp}.json",
                     [{"layer": i, "rank": len(fc[f"fc1.{i}"])} for i in range(a.n_layers)])
    bundle.mark(f"predictors.{inp}", {"source": model_file.name, "threshold": threshold})
    if hot is not None:
        bundle.save_tensors("placement.safetensors",
                            {f"hot.{i}": h.astype(np.uint8) for i, h in enumerate(hot)})
        bundle.save_json("placement.json", {
            "source": Path(gpu_index).name, "vram_capacity": vram,
            "hot_neurons": [int(h.sum()) for h in hot]})
        bundle.mark("placement", {"source": Path(gpu_index).name, "vram_capacity": vram})
    return bundle


def read_gpu_index(path: Path) -> tuple[list[np.ndarray], int]:
    """A split file's per-layer GPU masks (bool, (ffn_dim,)) and its split.vram_capacity."""
    path = Path(path)
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != SPLIT_ARCH:
        raise ModelLoadError(path, f"architecture {arch!r}, expected {SPLIT_ARCH!r} "
                             "(not a PowerInfer GPU index split file)")
    if VRAM_KEY not in meta:
        raise ModelLoadError(path, f"missing key {VRAM_KEY}")
    tensors = {t.name: t for t in reader.tensors}
    n = int(meta.get(f"{SPLIT_ARCH}.block_count", sum(k.endswith(".gpu_idx") for k in tensors)))
    hot = []
    for i in range(n):
        idx, bucket = tensors.get(f"blk.{i}.gpu_idx"), tensors.get(f"blk.{i}.gpu_bucket")
        if idx is None or bucket is None:
            raise ModelLoadError(path, f"layer {i} lacks blk.{i}.gpu_idx or blk.{i}.gpu_bucket")
        for t in (idx, bucket):
            if t.tensor_type.name != "I32" or len(t.shape) != 1:
                raise ModelLoadError(path, f"{t.name} is {t.tensor_type.name} "
                                     f"{list(t.shape)}, expected a 1-D I32 tensor")
        mask = np.asarray(idx.data)
        if not np.isin(mask, (0, 1)).all():
            raise ModelLoadError(path, f"blk.{i}.gpu_idx holds values other than 0 and 1")
        if not np.array_equal(np.flatnonzero(mask), np.asarray(bucket.data)):
            raise ModelLoadError(path, f"blk.{i}.gpu_idx and blk.{i}.gpu_bucket disagree "
                                 f"({int(mask.sum())} GPU neurons in gpu_idx, "
                                 f"{len(bucket.data)} in gpu_bucket, or not the same ones)")
        hot.append(mask.astype(bool))
    if len(tensors) != 2 * n:
        raise ModelLoadError(path, f"{len(tensors)} tensors, expected a gpu_idx and a gpu_bucket "
                             f"for each of {n} layers")
    return hot, int(meta[VRAM_KEY])


def _tensor(arr: np.ndarray, ggml_type: int):
    return tuple(reversed(arr.shape)), ggml_type, np.ascontiguousarray(arr)


def _f16(arr: np.ndarray):
    return _tensor(arr.astype(np.float16), F16)


def _raw(reader, t):
    return tuple(int(d) for d in t.shape), int(t.tensor_type), \
        reader.data[t.data_offset:t.data_offset + t.n_bytes]


def raw_field(reader, f) -> bytes:
    return reader.data[f.offset:f.offset + sum(int(p.nbytes) for p in f.parts)].tobytes()


def _shape(arr) -> str:
    return "nothing" if arr is None else str(tuple(arr.shape))


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv_record(key: str, vtype: int, value) -> bytes:
    val = _str(value) if vtype == STR else struct.pack(_PACK[vtype], value)
    return _str(key) + struct.pack("<I", vtype) + val


def _pad(n: int, align: int) -> int:
    return -n % align


def write_gguf(path: Path, magic: bytes, kvs: list[bytes], tensors: dict, align: int = 32):
    """GGUF v3 with `magic`: header, raw key/value records, tensor infos, aligned data.
    tensors: name -> (ggml shape, ggml type, data), data a uint8 or typed array, or
    (nbytes, a function returning it) so that a large file is written a tensor at a time. The
    file appears under its name only once complete."""
    def size(data) -> int:
        return data[0] if isinstance(data, tuple) else data.nbytes

    def write(tmp: Path):
        with open(tmp, "wb") as fh:
            fh.write(magic + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kvs))
                     + b"".join(kvs))
            offset = 0
            for name, (shape, ggml_type, data) in tensors.items():
                fh.write(_str(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape,
                                                  ggml_type, offset))
                offset += size(data) + _pad(size(data), align)
            fh.write(b"\0" * _pad(fh.tell(), align))
            for name, (_, _, data) in tensors.items():
                n = size(data)
                arr = np.ascontiguousarray(data[1]() if isinstance(data, tuple) else data)
                assert arr.nbytes == n, (name, arr.nbytes, n)
                fh.write(arr.data)
                fh.write(b"\0" * _pad(n, align))

    write_atomically(path, write)  # (a failed write, or `path` a folder, leaves no .tmp file)
