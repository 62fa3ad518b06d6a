"""Placement solver: byte accounting against the real model, optimality, constraints, errors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from powerinfer.errors import ConfigError
from powerinfer.formats.args import ModelArgs
from powerinfer.model.transformer import Transformer
from powerinfer.sparsity.solver import gpu_bytes, neuron_bytes, solve

LLAMA_GQA = ModelArgs(arch="llama", vocab_size=97, dim=48, n_layers=3, n_heads=6, n_kv_heads=2,
                      ffn_dim=40, ffn_act="reglu", qkv_bias=True, tie_embeddings=True)
OPT = ModelArgs(arch="opt", vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=4,
                ffn_dim=56, ffn_act="relu", max_seq_len=64, qkv_bias=True, o_bias=True,
                ffn_bias=True, layer_norm=True, learned_pos=True)


def power_law(L: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.pareto(1.5, n) * rng.uniform(0.5, 2.0) for _ in range(L)]


def tiny(L: int, n: int, **kw) -> ModelArgs:
    return ModelArgs(arch="llama", vocab_size=10, dim=8, n_layers=L, n_heads=2, n_kv_heads=1,
                     ffn_dim=n, **kw)


@pytest.mark.parametrize("args", [LLAMA_GQA, OPT], ids=["llama-gqa", "opt"])
def test_bytes_match_the_model(args):
    batch, context, ranks = 3, 16, [4, 5, 6][:args.n_layers]
    model = Transformer(args).to(torch.bfloat16)
    model.setup_cache(batch, context)
    parts = {"attention": 0, "norms": 0, "ffn_bias": 0, "embeddings": 0, "lm_head": 0, "ffn": 0}
    for name, p in model.named_parameters():  # a tied lm_head is listed once, as tok_embeddings
        key = ("attention" if ".attn." in name else "norms" if "norm" in name
               else "ffn_bias" if name.endswith("w2.bias") else "ffn" if ".ffn." in name
               else "lm_head" if name.startswith("output") else "embeddings")
        parts[key] += p.numel() * p.element_size()
    buffers = dict(model.named_buffers())
    kv = sum(b.numel() * b.element_size() for k, b in buffers.items() if "kv_cache" in k)
    rope = sum(b.numel() * b.element_size() for k, b in buffers.items() if k.startswith("rope"))

    got = gpu_bytes(args, dtype_bytes=2, batch=batch, context=context, predictor_ranks=ranks)
    for k in ("attention", "norms", "ffn_bias", "embeddings", "lm_head"):
        assert got[k] == parts[k], k
    assert got["kv_cache"] == kv and got["rope"] == rope
    # the predictors in the dtype they run in on a GPU, whatever the model's
    from powerinfer.model.predictor import run_dtype
    assert got["predictors"] == sum(r * (args.dim + args.ffn_dim) for r in ranks) * \
        run_dtype(torch.bfloat16, "cuda").itemsize
    # where the Triton kernels hold them as Q8_0 rows (`predictor.device_format`), as a
    # Predictors object on such a device holds them: each matrix whose width is a multiple of 32
    from powerinfer.model import predictor as P
    q8 = gpu_bytes(args, dtype_bytes=2, batch=batch, context=context, predictor_ranks=ranks,
                   predictor_fmt="q8_0")
    assert {k: v for k, v in q8.items() if k != "predictors"} == \
        {k: v for k, v in got.items() if k != "predictors"}
    assert q8["predictors"] == P.held_bytes(ranks, args.dim, args.ffn_dim, 2, "q8_0")
    assert q8["predictors"] == sum(
        (r * args.dim // 32 * 34 if args.dim % 32 == 0 else r * args.dim * 2)
        + (args.ffn_dim * r // 32 * 34 if r % 32 == 0 else args.ffn_dim * r * 2) for r in ranks)
    # (a rank-1024 layer of the 70B shape: 40 MB where bf16 takes 75)
    assert P.held_bytes([1024], 8192, 28672, 2, "q8_0") == 1024 * (8192 + 28672) // 32 * 34
    assert P.held_bytes([1024], 8192, 28672, 2) == 1024 * (8192 + 28672) * 2
    assert parts["ffn"] == args.n_layers * args.ffn_dim * neuron_bytes(args, 2)
    # placement flags: a tied matrix stays on the GPU while either end needs it
    off = gpu_bytes(args, embeddings_on_gpu=False, lm_head_on_gpu=False)
    assert off["embeddings"] == off["lm_head"] == 0
    head = gpu_bytes(args, embeddings_on_gpu=False)
    assert head["lm_head"] == args.vocab_size * args.dim * 2


def brute_force(mass, cap, min_neurons, group):
    """Best mass over every subset of equal-sized groups with 0 or >= min_neurons per layer."""
    L, n = len(mass), len(mass[0])
    gm = [np.sort(m)[::-1].reshape(-1, group).sum(1) for m in mass]  # any subset, not prefixes
    best = 0.0
    for pick in itertools.product([0, 1], repeat=L * (n // group)):
        x = np.array(pick).reshape(L, -1)
        counts = x.sum(1) * group
        if counts.sum() <= cap and all(c == 0 or c >= min_neurons for c in counts):
            best = max(best, sum(float(g @ r) for g, r in zip(gm, x)))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_milp_matches_brute_force_and_beats_greedy(seed):
    args = tiny(3, 8)
    mass = power_law(3, 8, seed)
    nb, fixed = neuron_bytes(args), sum(gpu_bytes(args).values())
    for cap in (4, 6, 10, 14):
        p = solve(mass, args, fixed + cap * nb + nb - 1, group=2, min_share=0.5)
        assert p.min_neurons == 4 and p.status == "optimal"
        best = brute_force(mass, cap, 4, 2)
        assert p.objective >= p.greedy_objective - 1e-9
        assert p.objective <= best + 1e-9 and best - p.objective <= p.gap * p.objective + 1e-9
        assert p.bound >= best - 1e-9


def test_memory_budget_is_exact():
    args = tiny(4, 96, ffn_act="relu", ffn_bias=True)
    mass, nb = power_law(4, 96, 1), neuron_bytes(args)
    fixed = gpu_bytes(args, context=32)
    base = sum(fixed.values())
    for budget in (base + 70 * nb, base + 70 * nb - 1, base + 123 * nb + nb // 2):
        p = solve(mass, args, budget, fixed=fixed, group=8, min_share=0.0)
        assert p.used_bytes == base + nb * sum(h.sum() for h in p.hot) <= budget
        assert budget - p.used_bytes < 8 * nb  # no whole group left unused
    p = solve(mass, args, base + 64 * nb, fixed=fixed, group=8, min_share=0.0)
    assert p.used_bytes == base + 64 * nb


def test_layer_minimum_where_plain_greedy_breaks_it():
    args = tiny(2, 64)
    rng = np.random.default_rng(0)
    broad = 5.0 + rng.uniform(0, 0.1, 64)  # layer 0: every neuron worth ~5
    spiky = np.full(64, 0.01)
    spiky[[3, 17, 40, 60]] = 10.0  # layer 1: four neurons worth 10, the rest nothing
    mass, nb, base = [broad, spiky], neuron_bytes(args), sum(gpu_bytes(args).values())
    budget = base + 40 * nb
    # plain greedy (the global top 40 neurons) would leave layer 1 with a sliver of 4
    top = np.argsort(-np.concatenate(mass), kind="stable")[:40]
    assert (top >= 64).sum() == 4
    p = solve(mass, args, budget, group=4, min_share=0.25)
    assert p.hot_counts == [40, 0] and p.min_neurons == 16
    assert all(c == 0 or c >= 16 for c in p.hot_counts)
    # a hard floor keeps layer 1 on the GPU with its hot four among the 16
    f = solve(mass, args, budget, group=4, min_share=0.25, floor_share=0.25)
    assert f.hot_counts == [24, 16] and f.hot[1][[3, 17, 40, 60]].all()
    assert f.objective < p.objective


def test_hot_masks_are_in_model_order():
    args = tiny(2, 16)
    mass = [np.arange(16.0), np.arange(16.0)[::-1].copy()]
    p = solve(mass, args, sum(gpu_bytes(args).values()) + 8 * neuron_bytes(args), group=4,
              min_share=0.0)
    assert sorted(p.hot_counts) == [4, 4]
    for m, h in zip(mass, p.hot):
        if h.any():
            assert m[h].min() >= m[~h].max()


def test_infeasible_budgets_name_the_bytes():
    args = tiny(3, 32)
    mass, fixed = power_law(3, 32), gpu_bytes(args)
    base = sum(fixed.values())
    with pytest.raises(ConfigError, match=rf"\({base - 1:,} bytes\) is below .*\({base:,} bytes\)"
                                          r".*give at least --vram-budget 0.01, and more"):
        solve(mass, args, base - 1)
    need = 3 * 16 * neuron_bytes(args)
    with pytest.raises(ConfigError, match=rf"floor of 16 GPU neurons needs {need} bytes"):
        solve(mass, args, base + 40 * neuron_bytes(args), group=8, floor_share=0.5)


def test_deterministic_and_report():
    args = tiny(30, 1536, ffn_act="dreglu")  # the default model's FFN shape
    mass = power_law(30, 1536, 3)
    budget = sum(gpu_bytes(args).values()) + 30 * 300 * neuron_bytes(args)
    a, b = solve(mass, args, budget), solve(mass, args, budget)
    assert all((x == y).all() for x, y in zip(a.hot, b.hot))
    assert a.objective == b.objective and a.status == "optimal" and a.n_binaries > 0
    assert a.solve_s < 10 and 0 <= a.gap <= 1e-4
    text = a.table()
    assert "greedy" in text and "gap" in text and len(text.splitlines()) == 30 + 4
    r = a.report()
    assert r["used_bytes"] <= budget and r["hot_counts"] == a.hot_counts


def test_all_fit_returns_all_hot():
    args = tiny(2, 24)
    mass = power_law(2, 24)
    p = solve(mass, args, 10**9)
    assert all(h.all() for h in p.hot) and p.share == 1.0 and p.source == "all"


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_neurons_kept_in_a_files_blocks_count_their_records_bytes(fmt):
    # Config(weights="int4") on a GPU: a hot neuron is the Triton kernels' record (4-bit gate and
    # up rows, an 8-bit down row; Q8_0 throughout): the placement counts exactly what
    # `kernels.pack` makes, and the same free bytes hold that many more neurons
    from powerinfer import kernels
    args = ModelArgs(arch="llama", vocab_size=10, dim=64, n_layers=2, n_heads=2, n_kv_heads=1,
                     ffn_dim=96, ffn_act="reglu")
    g = torch.Generator().manual_seed(0)
    rec = kernels.pack(*(torch.randn(5, 64, generator=g) for _ in range(3)), fmt)
    nb = neuron_bytes(args, 2, fmt)
    assert rec.shape == (5, nb) and nb < neuron_bytes(args, 2) * (0.6 if fmt == "q8_0" else 0.4)
    mass, fixed = power_law(2, 96), gpu_bytes(args)
    budget = sum(fixed.values()) + 40 * neuron_bytes(args, 2)
    wide = solve(mass, args, budget, fixed=fixed, group=8, min_share=0.0)
    blocks = solve(mass, args, budget, fixed=fixed, group=8, min_share=0.0, neuron_fmt=fmt)
    assert sum(wide.hot_counts) == 40 and blocks.neuron_bytes == nb
    assert blocks.used_bytes == sum(fixed.values()) + nb * sum(blocks.hot_counts) <= budget
    assert sum(blocks.hot_counts) == 8 * ((budget - sum(fixed.values())) // nb // 8)
    assert blocks.share > wide.share
    assert neuron_bytes(OPT, 2, fmt) == kernels.record_bytes(fmt, OPT.dim, False) + 2  # up bias
