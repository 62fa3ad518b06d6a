"""Hugging Face checkpoints (a folder of config.json and safetensors): architecture and tensors."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..errors import ModelLoadError
from .args import ModelArgs
from .gguf import _pattern_of
from .source import (
    HF_LLAMA,
    HF_OPT,
    Checkpoint,
    TensorSource,
    expand_names,
    fused_parts,
    split_fused,
)

HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")


HF_TYPES = (*HF_LLAMA_TYPES, "falcon", "opt")


HF_ACTS = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu", "dreglu": "dreglu",
           "gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}


_HF_LAYER = "model.layers.{i}."


HF_RENAMES = {
    "gemma3_text": {"{i}.ffn_norm": _HF_LAYER + "pre_feedforward_layernorm.weight",
                    "{i}.post_attn_norm": _HF_LAYER + "post_attention_layernorm.weight",
                    "{i}.post_ffn_norm": _HF_LAYER + "post_feedforward_layernorm.weight"},
    "phi3": {"{i}.qkv": _HF_LAYER + "self_attn.qkv_proj.weight",
             "{i}.gate_up": _HF_LAYER + "mlp.gate_up_proj.weight"},
}


def _falcon_hf_names(cfg: dict) -> dict[str, str]:
    """Falcon's Hugging Face names, canonical -> source (Falcon-7B's one norm is the source of
    both attn_norm and ffn_norm)."""
    t, h = "transformer.", "transformer.h.{i}."
    names = {"embed": t + "word_embeddings.weight", "norm": t + "ln_f.weight",
             "norm_b": t + "ln_f.bias", "output": "lm_head.weight",
             "{i}.qkv": h + "self_attention.query_key_value.weight",
             "{i}.o": h + "self_attention.dense.weight",
             "{i}.up": h + "mlp.dense_h_to_4h.weight", "{i}.down": h + "mlp.dense_4h_to_h.weight"}
    if cfg.get("new_decoder_architecture") and cfg.get("num_ln_in_parallel_attn", 2) == 2:
        for canon, hf in (("attn_norm", "ln_attn"), ("ffn_norm", "ln_mlp")):
            names[f"{{i}}.{canon}"], names[f"{{i}}.{canon}_b"] = h + hf + ".weight", h + hf + ".bias"
    else:  # one norm read by both branches
        for end in ("weight", "bias"):
            canon = "" if end == "weight" else "_b"
            names[f"{{i}}.attn_norm{canon}"] = h + "input_layernorm." + end
            names[f"{{i}}.ffn_norm{canon}"] = h + "input_layernorm." + end
    return names


class Entry(NamedTuple):
    """Where one tensor of a Hugging Face folder is: its file, its name there, and the rows of
    that tensor it is (None: all; a fused tensor's part, a Falcon q/k/v)."""
    file: Path
    key: str
    rows: torch.Tensor | None = None
    add: float = 0.0  # added on read (Gemma's norm weights are stored as w - 1)


class SafetensorsSource(TensorSource):
    """Tensors of a Hugging Face folder's safetensors files, one tensor at a time."""

    def __init__(self, files: dict[str, Entry]):
        self._files = files  # canonical name -> Entry
        self.names = frozenset(files)

    def _slice(self, name: str, fn):
        from safetensors import safe_open

        e = self._files[name]
        with safe_open(e.file, framework="pt") as st:
            return fn(st, e.key)

    def kind(self, name: str) -> str:
        return self._slice(name, lambda st, k: st.get_slice(k).get_dtype())

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._slice(name, lambda st, k: st.get_slice(k).get_shape()))
        rows = self._files[name].rows
        return shape if rows is None else (len(rows), *shape[1:])

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        e = self._files[name]
        w = self._slice(name, lambda st, k: st.get_tensor(k))
        w = w if e.rows is None else w[e.rows]
        return (w.float() + e.add).to(dtype) if e.add else w.to(dtype)

    def close(self):
        self._files = {}


def _hf_rope(path: Path, cfg: dict, rope: dict) -> tuple | None:
    """The rope scaling of a Hugging Face config (`rope` its rope_parameters, transformers >= 5)."""
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return ("llama3", scaling["factor"], scaling["low_freq_factor"],
                scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
    if kind == "linear":
        return ("linear", float(scaling["factor"]))
    if kind in ("longrope", "su"):
        original = (scaling.get("original_max_position_embeddings")
                    or cfg.get("original_max_position_embeddings"))
        factor = cfg.get("max_position_embeddings", original) / original
        mscale = scaling.get("attention_factor")
        if mscale is None:
            mscale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return ("longrope", tuple(scaling["short_factor"]), tuple(scaling["long_factor"]),
                int(original), float(mscale))
    raise ModelLoadError(path, f"unsupported rope scaling {scaling}")


def _hf_args(path: Path, cfg: dict) -> tuple[ModelArgs, int, dict]:
    """(ModelArgs, the TENSOR_NAMES column, the architecture's renames) of a config.json."""
    mtype = cfg.get("model_type")
    if mtype in HF_LLAMA_TYPES:
        return _hf_llama_args(path, cfg), HF_LLAMA, HF_RENAMES.get(mtype, {})
    if mtype == "falcon":
        return _hf_falcon_args(path, cfg), HF_LLAMA, {"only": _falcon_hf_names(cfg)}
    if mtype == "opt":
        return _hf_opt_args(path, cfg), HF_OPT, {}
    raise ModelLoadError(path, f"unknown architecture model_type={mtype!r} "
                         f"(supported: {', '.join(HF_TYPES)})")


def _hf_llama_args(path: Path, cfg: dict) -> ModelArgs:
    """The LLaMA family's (LLaMA, Mistral, Qwen2/3, Phi-3, Gemma 3) ModelArgs."""
    mtype = cfg.get("model_type")
    get = cfg.get
    gemma = mtype == "gemma3_text"
    if get("mlp_bias"):
        raise ModelLoadError(path, "mlp_bias=True is not supported")
    act_name = get("ffn_activation") or get("hidden_activation") or get("hidden_act", "silu")
    if act_name not in HF_ACTS:
        raise ModelLoadError(path, f"unsupported hidden_act {act_name!r}")
    rope = get("rope_parameters") or {}  # transformers >= 5 keeps rope settings here
    local = {}
    if gemma and "full_attention" in rope:  # per layer type
        rope, local = rope["full_attention"], rope.get("sliding_attention", {})
    n_heads = get("num_attention_heads")
    if mtype in ("qwen2", "qwen3") and get("use_sliding_window"):
        raise ModelLoadError(path, f"{mtype} with use_sliding_window=True is not supported")
    if (get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelLoadError(path, "partial rotary embedding is not supported")
    if get("final_logit_softcapping") or get("attn_logit_softcapping"):
        raise ModelLoadError(path, "logit soft-capping is not supported")
    window = (get("sliding_window") or 0) if mtype in ("mistral", "phi3", "gemma3_text") else 0
    extra = {}
    if gemma:
        types = get("layer_types") or [
            "full_attention" if (i + 1) % get("sliding_window_pattern", 6) == 0
            else "sliding_attention" for i in range(get("num_hidden_layers"))]
        pattern = _pattern_of([t == "sliding_attention" for t in types], path)
        head_dim = get("head_dim") or get("hidden_size") // n_heads
        extra = dict(swa_pattern=pattern if window else 0, qk_norm=True, post_norms=True,
                     embed_scale=get("hidden_size") ** 0.5,
                     attn_scale=float(get("query_pre_attn_scalar") or head_dim) ** -0.5,
                     rope_base_local=float(local.get("rope_theta") or get("rope_local_base_freq")
                                           or 10000.0) if window else 0.0)
    elif mtype == "qwen3":
        extra = dict(qk_norm=True)
    return ModelArgs(
        arch="llama", vocab_size=get("vocab_size"), dim=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, ffn_dim=get("intermediate_size"),
        head_dim=get("head_dim") or 0, ffn_act=HF_ACTS[act_name],
        norm_eps=get("rms_norm_eps", 1e-6),
        rope_base=get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=_hf_rope(path, cfg, rope),
        max_seq_len=get("max_position_embeddings", 2048),
        qkv_bias=mtype == "qwen2" or bool(get("attention_bias")),
        o_bias=bool(get("attention_bias")), sliding_window=window,
        tie_embeddings=bool(get("tie_word_embeddings", gemma)), **extra,
    )


def _hf_falcon_args(path: Path, cfg: dict) -> ModelArgs:
    """Falcon's ModelArgs (RoPE, parallel attention, no biases: its 7B and 40B layouts)."""
    get = cfg.get
    if get("alibi") or not get("parallel_attn", True) or get("bias"):
        raise ModelLoadError(path, "only Falcon with RoPE, parallel attention and no biases "
                             "is supported")
    new = bool(get("new_decoder_architecture"))
    if not new and not get("multi_query", True):
        raise ModelLoadError(path, "Falcon with per-head interleaved q/k/v is not supported")
    n_heads = get("num_attention_heads")
    act = get("activation", "gelu")
    if act not in ("gelu", "relu"):
        raise ModelLoadError(path, f"unsupported Falcon activation {act!r}")
    rope = get("rope_parameters") or {}
    dim = get("hidden_size")
    return ModelArgs(
        arch="llama", vocab_size=get("vocab_size"), dim=dim, n_layers=get("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=(get("num_kv_heads") or n_heads) if new else 1,
        ffn_dim=get("ffn_hidden_size") or 4 * dim, ffn_act=act,
        norm_eps=get("layer_norm_epsilon", 1e-5),
        rope_base=get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=_hf_rope(path, cfg, rope),
        max_seq_len=get("max_position_embeddings", 2048), layer_norm=True, parallel=True,
        tie_embeddings=bool(get("tie_word_embeddings", True)),
    )


def _hf_opt_args(path: Path, cfg: dict) -> ModelArgs:
    """OPT's ModelArgs (pre-layer-norm, ReLU, biases, learned positions)."""
    get = cfg.get
    if not get("do_layer_norm_before", True):
        raise ModelLoadError(path, "OPT with post-layer-norm (do_layer_norm_before=False) "
                             "is not supported")
    if get("word_embed_proj_dim", get("hidden_size")) != get("hidden_size"):
        raise ModelLoadError(path, "OPT with word_embed_proj_dim != hidden_size is not supported")
    if get("activation_function", "relu") != "relu" or not get("enable_bias", True):
        raise ModelLoadError(path, "only OPT with ReLU and biases is supported")
    return ModelArgs(
        arch="opt", vocab_size=get("vocab_size"), dim=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=get("num_attention_heads"),
        n_kv_heads=get("num_attention_heads"), ffn_dim=get("ffn_dim"), ffn_act="relu",
        norm_eps=1e-5, max_seq_len=get("max_position_embeddings", 2048), qkv_bias=True,
        o_bias=True, ffn_bias=True, tie_embeddings=bool(get("tie_word_embeddings", True)),
        layer_norm=True, learned_pos=True,
    )


def _falcon_qkv_rows(a: ModelArgs, new: bool) -> dict[str, torch.Tensor]:
    """Falcon's query_key_value rows of q, k and v: contiguous with one KV head; in the new
    decoder architecture, groups of (heads per KV head) q rows, then one k and one v."""
    hd, g = a.head_dim, a.n_heads // a.n_kv_heads
    if not new:
        return {n: torch.arange(lo, hi) for n, lo, hi in fused_parts(a)["qkv"]}
    rows = torch.arange(a.n_kv_heads * (g + 2) * hd).view(a.n_kv_heads, g + 2, hd)
    return {"q": rows[:, :g].reshape(-1), "k": rows[:, g].reshape(-1), "v": rows[:, g + 1].reshape(-1)}


def load_hf(path: Path, dtype, with_weights: bool) -> Checkpoint:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(path, "folder has no config.json")
    cfg = json.loads(cfg_file.read_text())
    args, column, renames = _hf_args(path, cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "folder has no *.safetensors files")
    only = renames.pop("only", None)
    names = expand_names(column, args.n_layers, renames, only)
    types, n_params, found = Counter(), 0, {}
    # Gemma's norms scale by (1 + w) and store w: read as 1 + w, as its GGUF files hold them
    offset = 1.0 if cfg.get("model_type") == "gemma3_text" else 0.0
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    # checkpoints saved from the base model lack the "model." prefix
                    canons = names.get(name) or names.get("model." + name)
                    if canons is None:
                        continue
                    for canon in canons:
                        norm = canon.endswith("norm") and offset
                        found[canon] = Entry(f, name, None, offset if norm else 0.0)
                    sl = st.get_slice(name)
                    types[sl.get_dtype()] += 1
                    n_params += int(np.prod(sl.get_shape()))
        except Exception as e:
            raise ModelLoadError(f, f"corrupt safetensors file ({type(e).__name__}: {e})") from e
    if cfg.get("model_type") == "falcon":  # its q/k/v rows may be interleaved
        rows = _falcon_qkv_rows(args, bool(cfg.get("new_decoder_architecture")))
        found = split_fused(found, args, lambda e, sub, lo, hi: e._replace(rows=rows[sub]))
    else:
        found = split_fused(found, args,
                            lambda e, sub, lo, hi: e._replace(rows=torch.arange(lo, hi)))
    if "output" not in found and not args.tie_embeddings:
        args.tie_embeddings = True  # no lm_head saved: it is the embedding matrix
    source = SafetensorsSource(found)
    weights = {c: source.get(c, dtype) for c in found} if with_weights else {}
    info = {"format": "safetensors", "hf_model_type": cfg.get("model_type"),
            "file_bytes": sum(f.stat().st_size for f in files), "tensor_types": dict(types),
            "n_params": n_params,
            "name": path.name}
    return Checkpoint(path, args, weights, ("hf", path), info, source=source)
