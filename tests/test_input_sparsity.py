"""Input sparsity in every projection (TEAL's method) on the real default model: thresholds from
the calibration text give about the asked-for share of zeros on text the calibration did not
see, a zero threshold changes nothing, a prompt's rows stay dense, and the quality it costs
rises with the sparsity; TEAL's block-wise greedy allocation reaches its targets where a block
loses least."""
import pytest
import torch

from powerinfer.model.load import load_model
from powerinfer.sparsity.corpus import load_corpus, token_windows
from powerinfer.sparsity.input_sparsity import (PARTS, Sparsifier, calibrate, greedy_allocation,
                                                held_out_quality, model_wide, projections,
                                                sample_magnitudes, share_under, weights_of)


@pytest.fixture(scope="module")
def smol(default_model_path):
    model, tok, _ = load_model(default_model_path)
    calib = token_windows(tok, load_corpus("lee", "calibration"), 128, 1024)
    held = token_windows(tok, load_corpus("lee", "held_out"), 128, 512)
    return model, tok, sample_magnitudes(model, calib, progress=False), held


def test_thresholds_reach_their_sparsity_on_held_out_text(smol):
    model, _, hists, held = smol
    assert set(hists) == {(i, p) for i in range(model.args.n_layers) for p in PARTS}
    th = calibrate(hists, 0.4)
    assert all(t > 0 for t in th.values())
    s = Sparsifier(model, th)
    with torch.inference_mode(), s:
        for w in held:
            model(torch.tensor([w]), torch.arange(len(w))[None])
    per = {k: z / n for k, (z, n) in s.counts.per_key.items()}
    assert set(per) == set(th)
    # each input's own share near its target on other text than the calibration's (the output
    # projection's input moves most with the text: 0.38-0.52 seen), and the model-wide figure,
    # which weighs each by the weights it saves, nearer still
    far = sorted(per.items(), key=lambda kv: -abs(kv[1] - 0.4))[:3]
    assert all(abs(v - 0.4) < 0.15 for v in per.values()), far
    assert abs(s.realised(weights_of(model)) - 0.4) < 0.05
    w = weights_of(model)
    assert w[(0, "gate_up")] == 2 * w[(0, "down")]  # (SmolLM2: gated, gate and up in one)
    assert model_wide({(0, "qkv"): 1.0, (0, "down"): 0.0}, w) == pytest.approx(
        w[(0, "qkv")] / (w[(0, "qkv")] + w[(0, "down")]))


def test_zero_thresholds_change_nothing_and_a_prompt_stays_dense(smol):
    model, tok, hists, _ = smol
    ids = tok.encode("The capital of France is Paris, and the capital of Italy is",
                     parse_special=False)
    x, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
    with torch.inference_mode():
        model.setup_cache(1, len(ids))
        dense = model(x, pos)[0]
        with Sparsifier(model, calibrate(hists, 0.0)):
            assert torch.equal(model(x, pos)[0], dense)
        P = len(ids) - 3  # the prompt's rows dense, the last three as decode steps
        with Sparsifier(model, calibrate(hists, 0.5), dense_rows=P) as s:
            got = model(x, pos)[0]
    assert torch.equal(got[:P], dense[:P])  # (causal: the prompt's rows see only dense rows)
    assert not torch.allclose(got[P:], dense[P:], atol=1e-3)
    n = len(projections(model))
    assert s.counts.entries == sum(3 * m.weight.shape[1] for m in projections(model).values())
    assert n == 4 * model.args.n_layers


def test_quality_falls_as_sparsity_rises(smol):
    model, _, hists, held = smol
    rows = held_out_quality(model, held[:2], {f"{s}": calibrate(hists, s, ("qkv", "o", "gate_up"))
                                              for s in (0.25, 0.5)}, progress=False)
    assert rows["dense"]["ppl_delta"] == 0 and rows["dense"]["top1"] == 1.0
    lo, hi = rows["0.25"], rows["0.5"]
    assert 0 < lo["kl"] < hi["kl"] and lo["top1"] > hi["top1"]
    assert lo["ppl"] < hi["ppl"]
    assert 0.2 < lo["realised"] < 0.3 and 0.45 < hi["realised"] < 0.55


def test_the_greedy_allocation_reaches_each_target_where_a_block_loses_least(smol):
    # TEAL's block-wise greedy allocation on two layers over one short window: each block at
    # (or a step past) each target, its inputs at unequal shares, and its output further from
    # the dense block's under the uniform allocation than under the greedy one
    model, tok, hists, _ = smol
    window = [tok.encode("The capital of France is Paris. " * 12, parse_special=False)[:96]]
    parts, layers = ("qkv", "o", "gate_up"), [1, 20]
    got = greedy_allocation(model, window, hists, [0.25, 0.4], parts, layers=layers,
                            progress=False)
    w = weights_of(model)
    captured = {}
    hooks = [model.layers[i].register_forward_pre_hook(
        lambda _m, a, i=i: captured.setdefault(i, (a[0].clone(), *a[1:]))) for i in layers]
    with torch.inference_mode():
        model.setup_cache(1, len(window[0]))
        model(torch.tensor(window), torch.arange(len(window[0]))[None])
    for h in hooks:
        h.remove()
    for target, th in got.items():
        assert set(th) == {(i, p) for i in layers for p in parts}
        for i in layers:
            shares = {p: share_under(hists[(i, p)], th[(i, p)]) for p in parts}
            block = model_wide({(i, p): s for p, s in shares.items()}, w)
            assert target - 0.01 <= block < target + 0.1, (target, i, shares)
            assert max(shares.values()) - min(shares.values()) > 0.05, shares  # not uniform

            def error(thresholds, i=i):
                with torch.inference_mode(), Sparsifier(model, thresholds):
                    y = model.layers[i](*captured[i])
                with torch.inference_mode():
                    ref = model.layers[i](*captured[i])
                return float((y - ref).pow(2).sum())
            uniform = {(i, p): t for (j, p), t in calibrate(hists, block, parts).items() if j == i}
            assert error({(i, p): th[(i, p)] for p in parts}) < error(uniform), (target, i)
