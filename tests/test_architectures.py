"""Gemma 3, Qwen3, Phi-3 and Falcon (its new decoder architecture, and Falcon-7B's multi-query
with one norm) against transformers, on small random checkpoints written both as Hugging Face
folders and as GGUF files in llama.cpp's layout:

* fp32 logits within 1e-3 of transformers' over 24 positions (Gemma's sliding layers see a
  window of 8: the test runs three windows past it);
* the in-process engine's greedy tokens equal to transformers' (up to a near-tie);
* bf16 and 4-bit (a Q4_0 file) tracking the fp32 engine of the same file;
* the actor runtime (attention split by KV heads where there are two) equal to the in-process
  engine, each executor holding only its share.
"""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

import checkpoints as C
from greedy import assert_same_or_near_tie
from powerinfer import Config, PowerInfer
from powerinfer.errors import ModelLoadError
from powerinfer.formats.loader import load_checkpoint
from powerinfer.model.transformer import Transformer

ARCHS = ["gemma3", "qwen3", "phi3", "falcon", "falcon-7b"]
TOL = 1e-3
T = 24


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{arch: (transformers model, HF folder, F32 GGUF, Q4_0 GGUF)}, built once."""
    root, out = tmp_path_factory.mktemp("archs"), {}
    for i, arch in enumerate(ARCHS):
        hf = C.build_hf_model(C.arch_config(arch), seed=10 + i)
        folder = C.save_hf(hf, root / arch)
        f32, q4 = root / f"{arch}.gguf", root / f"{arch}-q4_0.gguf"
        C.write_arch_gguf(f32, hf, arch)
        C.write_arch_gguf(q4, hf, arch, gguf.GGMLQuantizationType.Q4_0)
        out[arch] = (hf, folder, f32, q4)
    return out


def ids(B: int, seed: int) -> torch.Tensor:
    return torch.randint(0, C.VOCAB_SIZE, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(made, arch, fmt):
    hf, folder, f32, _ = made[arch]
    ck = load_checkpoint(folder if fmt == "hf" else f32, torch.float32)
    model = Transformer.from_weights(ck.args, ck.weights, torch.float32, "cpu")
    model.setup_cache(2, 64)
    x = ids(2, seed=3)
    with torch.inference_mode():
        ours = model(x, torch.arange(T).expand(2, T))
        theirs = hf(input_ids=x, attention_mask=torch.ones_like(x)).logits.float()
        # and one token at a time through the paged cache, past Gemma's window
        steps = [model(x[:, t:t + 1], torch.full((2, 1), t)) for t in range(T)]
    assert theirs.std() > 1
    err = (ours - theirs).abs().max().item()
    assert err <= TOL, f"{arch} {fmt}: max-abs difference {err:.3g}"
    err = (torch.cat(steps, 1) - theirs).abs().max().item()
    assert err <= TOL, f"{arch} {fmt} decoded a token at a time: max-abs difference {err:.3g}"


def test_the_architecture_switches_are_read(made):
    a = load_checkpoint(made["gemma3"][2], torch.float32, with_weights=False).args
    assert (a.ffn_act, a.qk_norm, a.post_norms, a.swa_pattern, a.sliding_window) == \
        ("geglu", True, True, 6, 8)
    assert [a.window(i) for i in range(7)] == [8, 8, 8, 8, 8, 0, 8]
    assert a.rope_base_local == 50.0 and a.embed_scale == 8.0 and a.tie_embeddings
    for arch in ("falcon", "falcon-7b"):
        f = load_checkpoint(made[arch][1], torch.float32, with_weights=False).args
        assert f.parallel and f.layer_norm and f.ffn_act == "gelu"
        assert f.n_kv_heads == (2 if arch == "falcon" else 1)
    assert load_checkpoint(made["qwen3"][2], torch.float32, with_weights=False).args.qk_norm


def test_an_unknown_architecture_keeps_its_clear_error(made, tmp_path):
    folder = made["qwen3"][1]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text((folder / "config.json").read_text()
                                     .replace('"qwen3"', '"mamba"'))
    with pytest.raises(ModelLoadError, match="unknown architecture model_type='mamba'"):
        load_checkpoint(bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_matches_transformers(made, arch):
    hf, _, f32, _ = made[arch]
    pi = PowerInfer.from_pretrained(f32, Config(dtype="float32", max_seq_len=64, max_batch=2))
    prompt = ids(1, seed=7)[0, :6].tolist()
    seq = pi.engine.new_sequence(prompt, pi_params(20))
    list(pi.engine.run([seq]))
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        x = torch.tensor([prompt])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20,
                          pad_token_id=0)
    assert_same_or_near_tie(pi, prompt, out[0, len(prompt):].tolist(), seq.output, 1e-3)


def pi_params(n: int):
    from powerinfer import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def greedy(pi: PowerInfer, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = [[] for _ in prompts]
    for ev in pi._run(prompts, n, dict(temperature=0, ignore_eos=True)):
        if ev.token >= 0:
            out[ev.index].append(ev.token)
    return out


PROMPTS = [[5, 17, 99, 150, 33, 2, 250, 7], [9, 8, 7]]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_and_int4_track_the_fp32_engine(made, arch):
    # the same Q4_0 file: fp32 dense is the reference; bf16 and int4 (4-bit projections, 8-bit
    # head) part from it only at a close call of its own logits
    q4 = made[arch][3]
    ref = PowerInfer.from_pretrained(q4, Config(dtype="float32", weights="dense", max_seq_len=64))
    want = greedy(ref, PROMPTS, 16)
    for weights in ("dense", "int4"):
        pi = PowerInfer.from_pretrained(q4, Config(dtype="bfloat16", weights=weights, max_seq_len=64))
        assert pi.config.weights == weights
        for p, w, g in zip(PROMPTS, want, greedy(pi, PROMPTS, 16)):
            assert_same_or_near_tie(ref, p, w, g, 0.25)


@pytest.fixture(scope="module")
def ray_session():
    import ray
    threads = torch.get_num_threads()
    yield
    ray.shutdown()
    torch.set_num_threads(threads)  # the engines here set it to 1


@pytest.mark.slow
# Gemma 3 (split attention with q/k norms, sliding layers, norms after each branch) and
# Falcon-7B (parallel branches, LayerNorm, GELU, one KV head); Qwen3's q/k norms are Gemma's,
# Phi-3's fused tensors and Falcon-40B's regrouped q/k/v are the loader's row ranges
@pytest.mark.parametrize("arch", ["gemma3", "falcon-7b"])
def test_actor_runtime_equals_the_in_process_engine(made, ray_session, arch):
    path = made[arch][2]
    kw = dict(dtype="float32", weights="dense", max_seq_len=64, max_batch=2, cpu_threads=1)
    ref = PowerInfer.from_pretrained(path, Config(**kw))
    pi = PowerInfer.from_pretrained(path, Config(runtime="actors", cold_executors=1, **kw))
    try:
        info = pi.engine.group.info
        n_kv = ref.args.n_kv_heads
        if n_kv > 1:  # attention split by KV heads: each executor holds one
            assert info["hot"]["kv_heads"] == [0, 1] and info["cold.0"]["kv_heads"] == [1, 2]
        # each executor holds its share: together about the model once, not twice
        total = sum(info[r].get("held_bytes", 0) for r in ("cold.0",))
        assert 0 < total < sum(t.numel() * 4 for t in ref.model.state_dict().values())
        for batch in ([PROMPTS[0]], PROMPTS):
            for p, want, got in zip(batch, greedy(ref, batch, 16), greedy(pi, batch, 16)):
                assert_same_or_near_tie(ref, p, want, got, 1e-3)
    finally:
        pi.close()


def test_a_hot_executor_says_it_needs_torch_from_the_models_shape(made):
    # Falcon's parallel branches and LayerNorm are layers the native loop does not run: the hot
    # executor says so from the table's arguments before any loading child (which would read
    # its share of the model and import torch to find the same), with int4 weights too; the
    # LLaMA-family ones it may run go on to the child, and dense weights are said as such
    from actors.hot_native import torch_needed
    from powerinfer.formats.loader import load_checkpoint
    int4 = Config(dtype="bfloat16", weights="int4").resolve(True)
    for arch in ("falcon", "falcon-7b", "gemma3", "qwen3", "phi3"):
        args = load_checkpoint(made[arch][3], with_weights=False).args
        why = torch_needed(int4, None, "auto", args)
        if arch.startswith("falcon"):
            assert why is not None and "parallel branches" in why, (arch, why)
        else:
            assert why is None, (arch, why)
    dense = Config(dtype="float32", weights="dense").resolve(True)
    assert "weights='dense'" in torch_needed(dense, None, "auto", args)


def test_the_sparsity_pipeline_on_geglu_with_a_residual_past_float16(tmp_path):
    # Gemma's residual stream grows past float16's range (65504) on the real model: embeddings
    # scaled up here do the same. Thresholds calibrated on |gelu_tanh(gate x)|, samples kept
    # exact, predictors trained on them, the bundle's sparse model evaluated.
    from powerinfer.sparsity.evaluate import evaluate
    from powerinfer.sparsity.train import train_predictors
    from powerinfer.sparsity.profile import ProfileOptions, profile

    hf = C.build_hf_model(C.arch_config("gemma3", tie_word_embeddings=False), seed=3)
    with torch.no_grad():  # (untied: the head keeps its scale)
        hf.model.embed_tokens.weight.mul_(2e4)
    folder = C.save_hf(hf, tmp_path / "loud")
    opts = ProfileOptions(tokens=1200, window=64, samples=200, sparsity=0.3, calib_tokens=600)
    b = profile(str(folder), "lee", tmp_path / "bundle", opts, progress=False)
    t = b.load_tensors("thresholds.safetensors")
    assert (t["threshold"] > 0).all()
    counts, _, tokens = b.stats()
    for c in counts:  # calibrated on the first 600 tokens, measured on all 1200
        assert abs((1 - c.sum() / (tokens * 128)) - 0.3) < 0.06
    x = b.samples(0)["x_layer"]
    assert np.isfinite(x).all() and np.abs(x).max() > 65504  # past float16, kept
    train_predictors(b, "ffn", ranks=[16], epochs=3, progress=False)
    rows = {r["label"]: r for r in evaluate(str(folder), b, tokens=300, window=64,
                                              progress=False)}
    dense, oracle = rows["dense"], rows["oracle"]  # at the calibrated 30%
    assert math.isfinite(dense["ppl"]) and math.isfinite(oracle["ppl"])
    assert 0.2 < oracle["sparsity"] < 0.4
    predicted = [r for k, r in rows.items() if k.startswith("predicted")]
    assert predicted and all(math.isfinite(r["ppl"]) for r in predicted)
