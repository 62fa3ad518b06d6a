"""The architecture a model file describes (`ModelArgs`): its shapes, activation and RoPE."""
from __future__ import annotations

from dataclasses import dataclass

FFN_ACTS = ("swiglu", "reglu", "dreglu", "relu", "geglu", "gelu")


UNGATED = ("relu", "gelu")  # one up projection, no gate


@dataclass(slots=True)
class ModelArgs:
    arch: str  # "llama" (the LLaMA family) or "opt"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0: dim // n_heads
    # swiglu: silu(g)*u, reglu: relu(g)*u, dreglu: relu(g)*relu(u), geglu: gelu_tanh(g)*u,
    # relu: relu(u), gelu: gelu(u) (erf)
    ffn_act: str = "swiglu"
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_pos), ("linear", factor)
    # or ("longrope", short factors, long factors, original_max_pos, attention factor)
    rope_scaling: tuple | None = None
    max_seq_len: int = 2048  # the model's trained context
    qkv_bias: bool = False  # Qwen2, OPT, LLaMA with attention_bias
    o_bias: bool = False  # OPT, LLaMA with attention_bias
    ffn_bias: bool = False  # OPT
    sliding_window: int = 0  # Mistral: attend to the last `sliding_window` positions (0: all)
    # Gemma 3: layer i slides only if i % swa_pattern < swa_pattern - 1 (0: every layer slides)
    swa_pattern: int = 0
    rope_base_local: float = 0.0  # the sliding layers' RoPE base (0: rope_base)
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before RoPE
    post_norms: bool = False  # Gemma 3: RMSNorm on the attention and FFN outputs too
    embed_scale: float = 0.0  # Gemma: embeddings times this (sqrt(dim)); 0: none
    attn_scale: float = 0.0  # scores times this (0: head_dim ** -0.5)
    parallel: bool = False  # Falcon: h = x + attn(attn_norm(x)) + ffn(ffn_norm(x))
    # OPT switches
    layer_norm: bool = False  # LayerNorm with bias instead of RMSNorm
    learned_pos: bool = False  # learned absolute positions (offset 2) instead of RoPE

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        assert self.arch in ("llama", "opt"), self.arch
        assert self.ffn_act in FFN_ACTS, self.ffn_act
        assert self.n_heads % self.n_kv_heads == 0, (self.n_heads, self.n_kv_heads)

    @property
    def gated(self) -> bool:
        return self.ffn_act not in UNGATED

    def window(self, layer: int) -> int:
        """The positions layer attends to back from each token (0: all)."""
        if self.swa_pattern and layer % self.swa_pattern == self.swa_pattern - 1:
            return 0
        return self.sliding_window

    def local(self, layer: int) -> bool:
        """Whether layer runs the sliding layers' own RoPE table (`rope_base_local`)."""
        return bool(self.rope_base_local) and self.window(layer) > 0

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (OPT's: max_seq_len and 2 unused leading rows,
        positions offset by 2), 0 where positions are RoPE's."""
        return self.max_seq_len + 2 if self.learned_pos else 0

    def outside_native_loop(self) -> str | None:
        """What of this model's layers the native layer loops (`hot_layers`) do not run, said from
        its shape alone (`engine.native.native_model`), else None."""
        if self.parallel:
            return "attention and FFN in parallel branches"
        if self.layer_norm:
            return "LayerNorm"
        if self.learned_pos:
            return "learned positions"
        if self.head_dim % 16:
            return f"heads of {self.head_dim}, not a multiple of 16"
        return None

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def uniform(self) -> bool:
        """Every layer's attention alike (one window, one RoPE table, no q/k norms): what the
        kernel library's native cold-executor loop runs."""
        return not (self.swa_pattern or self.rope_base_local or self.qk_norm)
