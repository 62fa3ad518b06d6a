"""The hybrid sparse FFN with oracle masks reproduces the dense model (ReLU-family models)."""
import pytest
import torch

import checkpoints as C
from powerinfer import Config, PowerInfer, SamplingParams
from powerinfer.formats.args import ModelArgs
from powerinfer.model.transformer import Transformer
from powerinfer.model.sparse import HybridFFN, apply_hybrid_ffn


def random_model(act: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    opt = act == "relu"
    a = ModelArgs(arch="opt" if opt else "llama", vocab_size=300, dim=64, n_layers=3, n_heads=4,
                  n_kv_heads=4 if opt else 2, ffn_dim=256, ffn_act=act, max_seq_len=128,
                  qkv_bias=opt, o_bias=opt, ffn_bias=opt, layer_norm=opt, learned_pos=opt)
    m = Transformer(a)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    m.setup_cache(2, 64)
    return m.eval().requires_grad_(False)


def decode_logits(m: Transformer, tokens: list[list[int]], steps: int):
    # prefill, then feed fixed tokens one at a time; returns the decode logits (steps, B, vocab)
    B, T = len(tokens), len(tokens[0])
    with torch.inference_mode():
        m(torch.tensor(tokens), torch.arange(T).expand(B, T))
        out = []
        for s in range(steps):
            tok = torch.tensor([[(7 * s + b) % 300] for b in range(B)])
            out.append(m(tok, torch.full((B, 1), T + s))[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("act", ["reglu", "dreglu", "relu"])
def test_oracle_sparse_equals_dense(act):
    dense = random_model(act)
    sparse = random_model(act)
    g = torch.Generator().manual_seed(1)
    hot = [torch.rand(256, generator=g) < 0.3 for _ in range(3)]  # 30% of neurons "on the GPU"
    apply_hybrid_ffn(sparse, hot=hot)
    assert all(isinstance(b.ffn, HybridFFN) for b in sparse.layers)
    prompts = [[1, 5, 9, 13, 2, 8], [4, 4, 200, 17, 31, 99]]
    a, b = decode_logits(dense, prompts, 12), decode_logits(sparse, prompts, 12)
    assert a.abs().max() > 1  # logits with a spread, so the tolerance means something
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_sparse_skips_inactive_neurons():
    m = random_model("reglu")
    fired = []
    apply_hybrid_ffn(m)
    def computed(mod, args):  # the neurons a decode step asks for: indices, or a mask (kernel)
        if len(args) > 1:
            sel = args[1]
            fired.append((int(sel.sum()) if sel.dtype == torch.bool else len(sel)) / 256)

    for b in m.layers:  # record how many neurons each decode step computes
        b.ffn.cold.register_forward_pre_hook(computed)
    decode_logits(m, [[1, 2, 3]], 3)
    assert fired and 0.2 < sum(fired) / len(fired) < 0.8  # ReGLU on random weights: about half


@pytest.mark.slow
def test_oracle_sparse_greedy_256_tokens_identical(tmp_path):
    model = C.build_hf_model(C.llama_family_config(hidden_act="relu", max_position_embeddings=512),
                             seed=3)
    folder = C.save_hf(model, tmp_path / "relu")
    dense = PowerInfer.from_pretrained(folder, config=Config(dtype="float32", max_batch=1, max_seq_len=300))
    sparse = PowerInfer.from_pretrained(folder, config=Config(dtype="float32", max_batch=1, max_seq_len=300))
    apply_hybrid_ffn(sparse.model)
    ids = dense.tokenize("hello world")
    outs = []
    for m in (dense, sparse):
        seq = m.engine.new_sequence(ids, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
        list(m.engine.run([seq]))
        outs.append(seq.output)
    assert len(outs[0]) == 256 and len(set(outs[0])) > 10 and outs[0] == outs[1]


@pytest.mark.parametrize("source", ["ffn", "layer"])
def test_mask_source_reads_the_pre_norm_input_it_names(source):
    m = random_model("reglu")
    seen, expected = [], []

    def masks(layer, x):  # predict everything: the output stays dense
        seen.append((layer, x.clone()))
        return torch.ones(*x.shape[:-1], 256, dtype=torch.bool)
    apply_hybrid_ffn(m, masks, predictor_input=source)
    for i, b in enumerate(m.layers):
        target = b if source == "layer" else b.ffn  # the block's input, or the FFN's (pre-norm)
        target.register_forward_pre_hook(lambda mod, args, i=i: expected.append((i, args[0].clone())))
    dense = random_model("reglu")
    a, b = decode_logits(dense, [[1, 2, 3]], 2), decode_logits(m, [[1, 2, 3]], 2)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    # the decode steps' inputs, in order (prefill runs dense and asks for no masks)
    decode_inputs = [e for e in expected if e[1].shape[1] == 1]
    assert len(seen) == len(decode_inputs) == 2 * 3
    for (i, x), (j, y) in zip(seen, decode_inputs):
        assert i == j and torch.equal(x, y)


@pytest.mark.parametrize("dtype,source,threshold", [(torch.float32, "ffn", 0.0),
                                                    (torch.bfloat16, "layer", 0.05)])
def test_predicted_decode_in_one_kernel_call_equals_the_modules(monkeypatch, dtype, source,
                                                                threshold):
    # a decode step whose predictor, rule and neurons run as one kernel call
    # (`kernels.predicted_ffn`) gives the logits of the modules' own path (the predictor's
    # GEMVs, the masks, the neuron kernel, one op at a time), for one sequence and for two
    # (each keeping its own predicted neurons); while `stats` records, the modules' path runs
    from powerinfer import kernels
    from powerinfer.model import sparse
    from powerinfer.model.predictor import Predictors, run_dtype
    if not kernels.available():
        pytest.skip("the kernel library is not built here")
    g = torch.Generator().manual_seed(3)
    pdt = run_dtype(dtype)
    preds = Predictors([(torch.randn(32, 64, generator=g) / 8).to(pdt) for _ in range(3)],
                       [torch.randn(256, 32, generator=g).to(pdt) for _ in range(3)], source,
                       threshold=0.5)
    models = []  # the same model twice: one decoding in one call a layer, one op by op
    for _ in range(2):
        m = random_model("reglu").to(dtype)
        m.setup_cache(2, 64)
        apply_hybrid_ffn(m, preds.active, predictor_input=source, thresholds=[threshold] * 3)
        models.append(m)
    calls = []
    real = kernels.predicted_ffn
    monkeypatch.setattr(kernels, "predicted_ffn", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for tokens in ([[1, 5, 9, 13]], [[1, 5, 9, 13], [4, 200, 17, 99]]):
        calls.clear()
        fused = decode_logits(models[0], tokens, 4)
        assert calls == [len(tokens)] * 4 * 3  # every decode step and layer, in one call
        monkeypatch.setattr(sparse, "FUSED_DECODE", False)  # the modules' path
        modules = decode_logits(models[1], tokens, 4)
        monkeypatch.setattr(sparse, "FUSED_DECODE", True)
        assert len(calls) == 4 * 3  # (none more)
        assert torch.equal(fused, modules)
        assert float(fused.float().std()) > 0.1  # logits with a spread
    f = models[0].layers[0].ffn
    assert f._fused[1] is not None and f._fused[1][0] is f.cold and len(f.cold.idx) == 256
    # the share of neurons the predictor picks is neither none nor all
    share = float(preds.active(0, torch.randn(8, 64, generator=g).to(dtype)).float().mean())
    assert 0.05 < share < 0.95
    from powerinfer.model.sparse import LayerStats
    calls.clear()
    for b in models[0].layers:
        b.ffn.stats = LayerStats()
    decode_logits(models[0], [[1, 5, 9, 13]], 2)
    st = models[0].layers[0].ffn.stats
    assert calls == [] and st.computed > 0
    # what fired is counted too: some of it outside the predicted neurons, some inside
    assert 0 < st.hit < st.fired and st.hit <= st.computed and 0 < st.mass_hit < st.mass_fired
    # other masks (an oracle's), then the predictor's again: found again each time
    for b in models[0].layers:
        b.ffn.stats, b.ffn.masks = None, lambda i, x: torch.ones(*x.shape[:-1], 256, dtype=torch.bool)
    decode_logits(models[0], [[1, 5, 9, 13]], 2)
    assert calls == [] and models[0].layers[0].ffn._fused[1] is None
    for b in models[0].layers:
        b.ffn.masks = preds.active
    decode_logits(models[0], [[1, 5, 9, 13]], 2)
    assert calls == [1] * 2 * 3
