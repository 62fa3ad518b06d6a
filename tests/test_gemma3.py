"""The real Gemma 3 270M file (Q4_K_M, from its registry packages) against transformers loading the
same file: fp32 logits, greedy tokens; and the shipped configuration (its K-quants
converted once to the kernel's blocks, bf16 with 4-bit projections) tracking fp32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import hf_from_gguf
from greedy import assert_same_or_near_tie
from powerinfer import Config, PowerInfer
from powerinfer.model.transformer import Transformer
from conftest import CPU_CLASSES

PROMPT = "The capital of France is"
LONG = ("Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is "
        "lower, so water boils at a lower temperature. ") * 24  # past the 512-position window


@pytest.fixture(scope="module")
def hf(gemma_model_path):
    return hf_from_gguf(gemma_model_path)


@pytest.fixture(scope="module")
def ours(gemma_fp32):
    return gemma_fp32


@pytest.fixture(scope="module")
def fp32_tracks(ours) -> dict:
    """fp32's greedy tokens after a short prompt and after one past the sliding window (decoded
    once for every class the shipped configuration is held to)"""
    def greedy(ids, n):
        return tuple(e.token for e in ours._run([ids], n, dict(temperature=0, ignore_eos=True))
                     if e.token >= 0)
    return {(tuple(ids), n): greedy(ids, n)
            for ids, n in ((ours.tokenize(PROMPT), 24), (ours.tokenize(LONG)[:560], 8))}


@pytest.mark.slow
def test_logits_match_transformers_past_the_sliding_window(ours, hf):
    ids = ours.tokenize(LONG)
    assert len(ids) > 600  # the sliding layers see 512 positions back
    x = torch.tensor([ids])
    with torch.inference_mode():
        theirs = hf(input_ids=x).logits[0].float()
    m: Transformer = ours.model
    mine = torch.stack([ours.engine.logits(ids[:n]) for n in (8, 300, len(ids))])
    ref = theirs[[7, 299, len(ids) - 1]]
    err = (mine - ref).abs().max().item()
    assert err < 2e-3 * ref.abs().max().item(), f"max-abs difference {err:.3g}"
    assert m.args.swa_pattern == 6 and m.args.window(5) == 0 and m.args.window(0) == 512


@pytest.mark.slow
def test_greedy_matches_transformers_for_32_tokens(ours, hf):
    ids = ours.tokenize(PROMPT)
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                          max_new_tokens=32, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    events = ours._run([ids], 32, dict(temperature=0, ignore_eos=True))
    got = [e.token for e in events if e.token >= 0]
    assert got == want, (ours.detokenize(got), ours.detokenize(want))
    assert "Paris" in ours.detokenize(got) or "capital" in ours.detokenize(got)


@pytest.mark.slow
@pytest.mark.parametrize("isa", CPU_CLASSES or ["auto"])
def test_the_shipped_configuration_tracks_fp32(gemma_model_path, ours, fp32_tracks,
                                                 isa):
    # defaults, on every class this CPU runs (each held to below its best): the K-quants and
    # Q5_0 read in their own blocks (a copy in Q8_0/Q4_1 for the rest), bf16 activations, the tied
    # 8-bit head over the file's Q8_0 embedding rows; its decode steps in the native loop, here
    # past the sliding layers' 512 positions (each layer's window and RoPE table its own)
    pi = PowerInfer.from_pretrained(gemma_model_path, Config(max_seq_len=1024, cpu_isa=isa))
    from powerinfer import kernels
    from powerinfer.model.quant import neuron_format
    if kernels.available():
        assert (pi.config.weights, pi.config.dtype, kernels.isa()) == ("int4", "bfloat16", isa)
        assert pi.engine.native is not None
        # the projections in the file's own bits: Q4_K and Q6_K, and Q5_0 where a Q4_K row
        # would not be whole super-blocks (640 wide)
        from powerinfer.model.quant import KQuantLinear
        held = {s[2] for m in pi.model.modules() if isinstance(m, KQuantLinear) for s in m.segments}
        assert {"q4kx16", "q6kx16", "q5x16"} <= held
        # neuron sets (sparse, or the actor group's split) keep Q8_0 rows
        assert pi.checkpoint.info["ffn_type"] == "Q8_0"
        assert neuron_format("int4", pi.checkpoint.info, torch.empty(0, dtype=torch.bfloat16)) == "q8_0"
    for (prompt, n), want in fp32_tracks.items():
        ids = list(prompt)
        got = [e.token for e in pi._run([ids], n, dict(temperature=0, ignore_eos=True))
               if e.token >= 0]
        assert_same_or_near_tie(ours, ids, list(want), got, 0.5)
    chat = pi.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert pi.tokenizer.encode("<end_of_turn>")[-1] in pi.tokenizer.eog_ids


@pytest.mark.slow
def test_the_actor_groups_executors_hold_their_shares_without_torch(gemma_model_path, ours,
                                                                      fp32_tracks):
    # the actor runtime's default split of Gemma 3 (a hot and a cold executor): each one's share
    # of every layer's FFN a block slice of the file's Q8_0 rows (one GEMV of 16-row groups, as
    # the whole model's projections are held), so the cold executor's native loop answers every
    # message and it runs without torch (`actors/cold_native.py`); its one KV head keeps every
    # head on the hot executor, whose layer loop runs the layers' own variants (the embedding's
    # scale, the sliding windows, the local RoPE table, the q/k norms, the post-norms of its
    # own and the cold sums) natively and without torch too (`actors/hot_native.py`); greedy
    # tracks fp32 as the in-process engine does, past the sliding window too. (One executor
    # with the whole model, as a server runs models that share their cores, is served and
    # compared in tests/test_serve.py.)
    from powerinfer import kernels
    if not kernels.available():
        pytest.skip("the CPU kernel does not run here: the cold executor computes with torch")
    threads = torch.get_num_threads()
    pi = PowerInfer.from_pretrained(gemma_model_path, Config(runtime="actors", max_seq_len=1024,
                                                             cpu_threads=1))
    try:
        cold, hot = pi.engine.group.info["cold.0"], pi.engine.group.info["hot"]
        assert cold["torch"] is False and cold["torch_why"] == "", cold
        assert cold["block_slices"] == pi.engine.args.n_layers == 18
        assert hot["torch"] is False and hot["torch_why"] == "", hot
        # its 262,144-row embedding read in the file's own pages, as the torch executor reads
        # it (mapped again, not copied into its memory: `actors.packed.Mapped`)
        with open(f"/proc/{hot['pid']}/maps") as f:
            assert str(Path(gemma_model_path).resolve()) in f.read()
        assert_tracks(pi, ours, fp32_tracks)  # (the cold executor's neurons in every answer)
    finally:
        pi.close()
        import ray
        ray.shutdown()
        torch.set_num_threads(threads)


def assert_tracks(pi, ours, fp32_tracks):
    """Greedy decodes of `fp32_tracks`' prompts track fp32 as the in-process engine does."""
    for (prompt, n), want in fp32_tracks.items():
        ids = list(prompt)
        got = [e.token for e in pi._run([ids], n, dict(temperature=0, ignore_eos=True))
               if e.token >= 0]
        assert_same_or_near_tie(ours, ids, list(want), got, 0.5)
