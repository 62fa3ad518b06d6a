"""Small random checkpoints for tests, built with transformers (the oracle) and written in the
formats the loader reads:

* Hugging Face folders via transformers' own `save_pretrained` (config.json + model.safetensors),
  plus a byte-level BPE tokenizer.json so that `PowerInfer.from_pretrained` works on them;
* GGUF files via `gguf.GGUFWriter`, in llama.cpp's layout (q/k rows permuted the way
  convert_hf_to_gguf.py does), F32 / F16 / Q8_0 tensors, a minimal gpt2-style tokenizer.

Weights are re-drawn with scales that give O(1) activations and logits (transformers' default
init, std 0.02, makes every logit ~0 and would let almost any bug pass a 1e-4 tolerance).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

# ----------------------------------------------------------------------------------- tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# (left, right) merges in rank order; each side exists by the time it is used
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
          ("Ġ", "s"), ("r", "e"), ("a", "t"), ("e", "n"), ("o", "u"), ("i", "s"), ("Ġ", "w"),
          ("Ġ", "o"), ("a", "n"), ("n", "d"), ("Ġa", "nd"), ("Ġ", "c"), ("in", "g"), ("Ġ", "b"),
          ("o", "r"), ("e", "s"), ("Ġ", "f"), ("Ġ", "m"), ("Ġ", "p"), ("l", "l"), ("Ġ", "h"),
          ("i", "t"), ("Ġ", "d"), ("Ġ", "l"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("Ġo", "f"),
          ("Ġ", "i"), ("Ġi", "s"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, GGUF token types, merges "a b"): specials, the 256 byte symbols, merged pieces."""
    byte_syms = [bytes_to_unicode()[b] for b in range(256)]
    tokens = SPECIALS + byte_syms + [a + b for a, b in MERGES]
    assert len(set(tokens)) == len(tokens)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3: control, 1: normal
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


VOCAB_SIZE = len(byte_vocab()[0])  # 299


def write_hf_tokenizer(folder: Path) -> None:
    """tokenizer.json (byte-level BPE over byte_vocab) + tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, _ = byte_vocab()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False}))


# ------------------------------------------------------------------------------ HF models

def llama_family_config(model_type: str = "llama", hidden_act: str = "silu", tied: bool = False,
                        **overrides):
    """A tiny config: dim 64, 2 layers, 4 heads, 2 kv heads (GQA), ffn 128."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[model_type]
    kw = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, hidden_act=hidden_act,
              max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tied,
              bos_token_id=None, eos_token_id=0, pad_token_id=0)
    kw.update(overrides)
    return cls(**kw)


def opt_config(**overrides):
    from transformers import OPTConfig

    kw = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
              num_attention_heads=4, max_position_embeddings=128, do_layer_norm_before=True,
              word_embed_proj_dim=64, activation_function="relu", enable_bias=True,
              dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
              bos_token_id=None, eos_token_id=0, pad_token_id=0)
    kw.update(overrides)
    return OPTConfig(**kw)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, logit_scale: float = 3.0) -> None:
    """Redraw every parameter: norms ~ 1 +- 0.2, biases ~ 0.2, embeddings ~ N(0, 1), linear
    weights ~ N(0, 1/fan_in); the LM head scaled so logits have std ~ logit_scale."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters are listed once
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.ndim == 1:
            p.copy_(0.2 * r if name.endswith("bias") else 1 + 0.2 * r)
        elif "embed" in name:
            p.copy_(r)
        elif "lm_head" in name:
            p.copy_(r * logit_scale / math.sqrt(p.shape[1]))
        else:
            p.copy_(r / math.sqrt(p.shape[1]))


def build_hf_model(config, seed: int):
    """transformers' model for `config` in fp32 eval mode with random weights (eager attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def add_drelu_hooks(model) -> list:
    """dReLU on a transformers LLaMA built with hidden_act="relu": relu(gate) * relu(up), by
    applying relu to each mlp.up_proj output. Returns the hook handles."""
    return [layer.mlp.up_proj.register_forward_hook(lambda mod, inp, out: torch.relu(out))
            for layer in model.model.layers]


def save_hf(model, folder: Path, extra_config: dict | None = None, tokenizer: bool = True) -> Path:
    """save_pretrained (safetensors), then merge `extra_config` into config.json."""
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    assert (folder / "model.safetensors").exists(), sorted(p.name for p in folder.iterdir())
    if extra_config:
        cfg_file = folder / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.update(extra_config)
        cfg_file.write_text(json.dumps(cfg, indent=1))
    if tokenizer:
        write_hf_tokenizer(folder)
    return folder


# ---------------------------------------------------------------------------------- GGUF

def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate_half -> interleaved RoPE)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    """What a tensor stored as `qtype` reads back as (float32)."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16).astype(np.float32)
    q = gguf.quants.quantize(w.astype(np.float32), qtype)
    return np.asarray(gguf.quants.dequantize(q, qtype), dtype=np.float32).reshape(w.shape)


def add_byte_tokenizer(w) -> None:
    """byte_vocab as a gpt2-style GGUF tokenizer, EOS 0, no BOS."""
    tokens, types, merges = byte_vocab()
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)


def hf_from_gguf(path: Path):
    """transformers' own reading of a real GGUF file, fp32, eager attention: the oracle.

    transformers parses the file with the `gguf` package's reader, twice (configuration, then
    tensors); here that reader is the project's (`compat.reader_class`, a subclass with its
    arrays sliced from one view), which gives the same fields part for part
    (tests/test_convert.py checks it against the stock reader on the real default model) in
    a tenth of the time: Gemma 3's 262k-token vocabulary took 11 s a parse. And transformers
    asks `gguf.get_tensor_name_map` for the same (architecture, block count) once a module of
    the model, about 400 times, each building the same table again (6-9 s of the oracle's
    load); here each is built once and handed out again (transformers only reads it). What the
    oracle makes of the fields (configuration, tensor names, permutations, the model) is
    transformers'."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    from powerinfer.compat import reader_class

    stock = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = reader_class()
    gguf.get_tensor_name_map = functools.cache(stock[1])
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32,
                                                     attn_implementation="eager")
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = stock
    return model.eval()


def write_llama_gguf(path: Path, model, ffn_activation: str | None = None,
                     qtype=None, arch: str = "llama", down_qtype=None) -> dict[str, torch.Tensor]:
    """Write a transformers LLaMA-family model as a llama.cpp-style GGUF file.

    2-D tensors are stored as `qtype` (F32 default, F16, or a quantized type); 1-D tensors
    (norms, biases) stay F32 as llama.cpp keeps them. `ffn_activation` ("reglu"/"dreglu") goes in
    the string key powerinfer.ffn_activation. A tied model gets no output.weight. down_qtype:
    ffn_down's type where it differs (a Q4_K_M file's more-bits layers keep down in more bits).

    Returns the HF-named state dict as the file stores it (after the F16/quantization round
    trip, q/k in HF order): load it into a transformers model to get the oracle for this file.
    Quantization blocks run along rows, so permuting rows commutes with the round trip.
    """
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = T.F32 if qtype is None else qtype
    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tied = bool(cfg.tie_word_embeddings)
    permuted = arch != "qwen2"  # llama.cpp permutes q/k for its LLaMA-layout archs, not qwen2
    effective: dict[str, torch.Tensor] = {}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", f"random-{arch}")
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_kv)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", float(rope_theta))
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    if ffn_activation is not None:
        w.add_string("powerinfer.ffn_activation", ffn_activation)
    add_byte_tokenizer(w)

    def put(gguf_name: str, hf_name: str, permute_heads: int | None = None, qtype=qtype):
        arr = sd[hf_name]
        if arr.ndim == 1 or qtype == T.F32:
            stored, eff = arr.astype(np.float32), arr.astype(np.float32)
        elif qtype == T.F16:
            stored, eff = arr.astype(np.float16), roundtrip(arr, T.F16)
        else:
            stored, eff = gguf.quants.quantize(arr.astype(np.float32), qtype), roundtrip(arr, qtype)
        if permute_heads is not None and permuted:  # rows only: works on quantized blocks too
            stored = permute_qk(stored, permute_heads)
        if stored.dtype == np.uint8:
            w.add_tensor(gguf_name, stored, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(stored))
        effective[hf_name] = torch.from_numpy(np.ascontiguousarray(eff))

    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight")
    if not tied:
        put("output.weight", "lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", n_head)
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", n_kv)
        put(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight")
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight")
        for b, heads in (("q", n_head), ("k", n_kv), ("v", None)):
            if p + f"self_attn.{b}_proj.bias" in sd:
                put(f"blk.{i}.attn_{b}.bias", p + f"self_attn.{b}_proj.bias", heads)
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
        put(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight")
        put(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight")
        put(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight",
            qtype=qtype if down_qtype is None else down_qtype)
    if tied:
        effective["lm_head.weight"] = effective["model.embed_tokens.weight"]

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return effective


# ----------------------------------------------------------- Gemma 3, Qwen3, Phi-3, Falcon

def arch_config(arch: str, **overrides):
    """A tiny config of another family (dim 64, 2 kv heads where it has them, ffn 128).
    gemma3: 7 layers (sliding, the 6th full) with a sliding window of 8 positions."""
    from transformers import FalconConfig, Gemma3TextConfig, Phi3Config, Qwen3Config

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4,
                  max_position_embeddings=256, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    if arch == "gemma3":
        kw = dict(common, intermediate_size=128, num_hidden_layers=7, num_key_value_heads=2,
                  head_dim=32, query_pre_attn_scalar=32, sliding_window=8, rms_norm_eps=1e-6,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
                  tie_word_embeddings=True)
        cls = Gemma3TextConfig
    elif arch == "qwen3":
        kw = dict(common, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
        cls = Qwen3Config
    elif arch == "phi3":
        kw = dict(common, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)
        cls = Phi3Config
    elif arch == "falcon":  # the new decoder architecture (Falcon-40B's): grouped KV, two norms
        kw = dict(common, num_hidden_layers=2, new_decoder_architecture=True, num_kv_heads=2,
                  num_ln_in_parallel_attn=2, parallel_attn=True, bias=False, alibi=False,
                  ffn_hidden_size=128, layer_norm_epsilon=1e-5, activation="gelu",
                  tie_word_embeddings=False)
        cls = FalconConfig
    elif arch == "falcon-7b":  # multi-query, one norm for both branches
        kw = dict(common, num_hidden_layers=2, new_decoder_architecture=False, multi_query=True,
                  parallel_attn=True, bias=False, alibi=False, ffn_hidden_size=128,
                  layer_norm_epsilon=1e-5, activation="gelu", tie_word_embeddings=True)
        cls = FalconConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def write_arch_gguf(path: Path, model, arch: str, qtype=None) -> None:
    """Write a transformers Gemma 3 / Qwen3 / Phi-3 / Falcon model as llama.cpp's converter
    lays it out: Gemma's norms stored as 1 + w, Phi-3's q/k/v and gate/up fused, Falcon's
    q/k/v rows regrouped as all q, all k, all v (none of these archs permutes q/k)."""
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = T.F32 if qtype is None else qtype
    cfg = model.config
    kind = "falcon" if arch.startswith("falcon") else arch
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), kind)
    n_head = cfg.num_attention_heads
    if kind == "falcon":
        new = cfg.new_decoder_architecture
        n_kv = cfg.num_kv_heads if new else 1
        head_dim, ffn, n_layers = cfg.hidden_size // n_head, cfg.ffn_hidden_size, cfg.num_hidden_layers
        w.add_float32("falcon.attention.layer_norm_epsilon", cfg.layer_norm_epsilon)
    else:
        n_kv, head_dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
        ffn, n_layers = cfg.intermediate_size, cfg.num_hidden_layers
        w.add_float32(f"{kind}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)
    w.add_string("general.name", f"random-{arch}")
    w.add_uint32(f"{kind}.block_count", n_layers)
    w.add_uint32(f"{kind}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{kind}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{kind}.feed_forward_length", ffn)
    w.add_uint32(f"{kind}.attention.head_count", n_head)
    w.add_uint32(f"{kind}.attention.head_count_kv", n_kv)
    w.add_uint32(f"{kind}.attention.key_length", head_dim)
    w.add_uint32(f"{kind}.attention.value_length", head_dim)
    w.add_float32(f"{kind}.rope.freq_base", float(rope.get("rope_theta", 10000.0)))
    w.add_uint32(f"{kind}.rope.dimension_count", head_dim)
    if kind == "gemma3":
        w.add_uint32("gemma3.attention.sliding_window", cfg.sliding_window)
        local = cfg.rope_parameters["sliding_attention"]["rope_theta"]
        w.add_float32("gemma3.rope.freq_base_swa", float(local))
    add_byte_tokenizer(w)

    def put(name: str, arr: np.ndarray):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qtype == T.F32:
            w.add_tensor(name, arr)
        elif qtype == T.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    if kind == "falcon":
        t = "transformer."
        put("token_embd.weight", sd[t + "word_embeddings.weight"])
        put("output_norm.weight", sd[t + "ln_f.weight"])
        put("output_norm.bias", sd[t + "ln_f.bias"])
        if not cfg.tie_word_embeddings:
            put("output.weight", sd["lm_head.weight"])
        g = n_head // n_kv
        for i in range(n_layers):
            p, b = f"{t}h.{i}.", f"blk.{i}."
            if new:
                put(b + "attn_norm.weight", sd[p + "ln_mlp.weight"])
                put(b + "attn_norm.bias", sd[p + "ln_mlp.bias"])
                put(b + "attn_norm_2.weight", sd[p + "ln_attn.weight"])
                put(b + "attn_norm_2.bias", sd[p + "ln_attn.bias"])
            else:
                put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
                put(b + "attn_norm.bias", sd[p + "input_layernorm.bias"])
            qkv = sd[p + "self_attention.query_key_value.weight"]
            if new:  # (kv groups, g q heads + k + v, head_dim, dim) -> all q, all k, all v
                x = qkv.reshape(n_kv, g + 2, head_dim, -1)
                qkv = np.concatenate([x[:, :g].reshape(-1, x.shape[-1]),
                                      x[:, g].reshape(-1, x.shape[-1]),
                                      x[:, g + 1].reshape(-1, x.shape[-1])])
            put(b + "attn_qkv.weight", qkv)
            put(b + "attn_output.weight", sd[p + "self_attention.dense.weight"])
            put(b + "ffn_up.weight", sd[p + "mlp.dense_h_to_4h.weight"])
            put(b + "ffn_down.weight", sd[p + "mlp.dense_4h_to_h.weight"])
    else:
        add = 1.0 if kind == "gemma3" else 0.0  # llama.cpp's converter stores Gemma's 1 + w
        put("token_embd.weight", sd["model.embed_tokens.weight"])
        put("output_norm.weight", sd["model.norm.weight"] + add)
        if not cfg.tie_word_embeddings:
            put("output.weight", sd["lm_head.weight"])
        for i in range(n_layers):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"] + add)
            put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
            put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
            if kind == "phi3":
                put(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
                put(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
                put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
                continue
            for n in "qkv":
                put(b + f"attn_{n}.weight", sd[p + f"self_attn.{n}_proj.weight"])
            put(b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"] + add)
            put(b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"] + add)
            put(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
            put(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
            if kind == "gemma3":
                put(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"] + add)
                put(b + "ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"] + add)
                put(b + "post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"] + add)
            else:
                put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
