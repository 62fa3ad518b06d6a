"""Hugging Face transformers as an independent oracle for the dense model, the loaders, the
tokenizer and the engine.

* the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) loaded by both: logits, greedy
  tokens, incremental decode, tokenization (slow: loads 135M parameters twice);
* small random LLaMA-family checkpoints for every FFN variant (SwiGLU, ReGLU, dReLU), tied and
  untied, as HF folders (transformers' save_pretrained) and as llama.cpp-layout GGUF files
  (F32 / F16 / Q8_0), plus Qwen2, Mistral and OPT folders;
* batched prefill with right padding against each prompt alone.
* features outside the common path (LLaMA attention_bias, Mistral sliding_window) must be
  refused at load time or computed exactly: never silently wrong.

transformers runs in fp32 with eager attention; dReLU is transformers' LLaMA with
hidden_act="relu" plus a relu hook on every mlp.up_proj output.
"""
from __future__ import annotations

import copy

import gguf
import pytest
import torch

import checkpoints as C
from powerinfer import Config, PowerInfer, SamplingParams
from powerinfer.formats.loader import load_checkpoint
from powerinfer.model.transformer import Transformer

Q = gguf.GGMLQuantizationType
TOL = 1e-4  # fp32, random small models
REAL_TOL = 1e-3  # fp32, the 30-layer real model


# ------------------------------------------------------------------------------------ helpers

def load_ours(path, max_seq: int = 128, max_batch: int = 4) -> Transformer:
    ck = load_checkpoint(path, torch.float32)
    model = Transformer.from_weights(ck.args, ck.weights, torch.float32, "cpu")
    model.setup_cache(max_batch, max_seq)
    return model


@torch.inference_mode()
def ours_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Full causal forward of a (B, T) batch from position 0: (B, T, vocab)."""
    B, T = ids.shape
    return model(ids, torch.arange(T).expand(B, T))


@torch.inference_mode()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def random_ids(B: int, T: int, seed: int, vocab: int = C.VOCAB_SIZE) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "logits"):
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"{what}: max-abs difference {err:.3g} > {tol:g} (ref std {ref.std():.3g})"


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' generate(do_sample=False) for exactly n tokens (EOS disabled): the tokens
    and the raw logits of every step."""
    model.generation_config.eos_token_id = None  # like ignore_eos=True
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    assert len(new) == n, f"transformers generated {len(new)} tokens, wanted {n}"
    return new, [step[0].float() for step in out.logits]


def assert_same_greedy(ours: list[int], theirs: list[int], their_logits, tie_tol: float, what=""):
    """Token-for-token equality; a divergence is accepted only at a near-tie in transformers'
    own logits (then the continuations are no longer comparable)."""
    assert len(ours) == len(theirs), f"{what}: {len(ours)} tokens vs {len(theirs)}"
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            gap = (their_logits[j][b] - their_logits[j][a]).item()
            assert gap < tie_tol, (f"{what}: greedy tokens differ at step {j}: ours {a}, "
                                   f"transformers {b} (logit gap {gap:.3g})\n"
                                   f"ours   {ours}\ntheirs {theirs}")
            return


def engine_greedy(pi: PowerInfer, prompts: list[list[int]], max_tokens) -> list[list[int]]:
    """Greedy outputs of one engine run over `prompts` decoded together."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    seqs = [pi.engine.new_sequence(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
            for p, m in zip(prompts, max_tokens)]
    events = list(pi.engine.run(seqs))
    for i, (s, m) in enumerate(zip(seqs, max_tokens)):
        assert s.finish_reason == "length", (i, s.finish_reason)
        assert [e.token for e in events if e.index == i] == s.output
        assert len(s.output) == m
    return [s.output for s in seqs]


# ===================================================================== 1. the real default model

REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is 12 * 7? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def real_hf(default_model_path):
    return C.hf_from_gguf(default_model_path)


@pytest.fixture(scope="module")
def real_ours(default_model_path):
    """(Transformer from load_checkpoint + from_weights, PowerInfer on the same checkpoint)."""
    ck = load_checkpoint(default_model_path, torch.float32)
    model = Transformer.from_weights(ck.args, ck.weights, torch.float32, "cpu")
    model.setup_cache(1, 256)
    pi = PowerInfer(ck, Config(dtype="float32", max_seq_len=256, max_batch=4))  # its own copy; drops ck.weights
    return model, pi


@pytest.mark.slow
def test_real_model_logits_match_transformers(real_hf, real_ours):
    model, pi = real_ours
    assert model.args.tie_embeddings and model.args.n_kv_heads == 3
    for prompt in REAL_PROMPTS:
        ids = torch.tensor([pi.tokenize(prompt)])
        ref = hf_logits(real_hf, ids)
        ours = ours_logits(model, ids)
        assert_close(ours, ref, REAL_TOL, f"logits for {prompt!r}")
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_real_model_incremental_decode_matches_full_forward(real_hf, real_ours):
    model, pi = real_ours
    ids = torch.tensor([pi.tokenize(REAL_PROMPTS[2])])
    T, P = ids.shape[1], 7
    full = ours_logits(model, ids)
    assert_close(full, hf_logits(real_hf, ids), REAL_TOL, "full forward")
    with torch.inference_mode():
        steps = [model(ids[:, :P], torch.arange(P)[None])]  # prefill
        for t in range(P, T):  # then one token at a time against the KV cache
            steps.append(model(ids[:, t:t + 1], torch.tensor([[t]])))
    assert_close(torch.cat(steps, dim=1), full, 2e-4, "incremental vs full forward")


@pytest.mark.slow
def test_real_model_greedy_matches_transformers(real_hf, real_ours):
    _, pi = real_ours
    prompts = [pi.tokenize(REAL_PROMPTS[0]), pi.tokenize(REAL_PROMPTS[2])]  # 5 and 21 tokens
    n = 32
    theirs = [hf_greedy(real_hf, ids, n) for ids in prompts]
    # each prompt alone, through the engine
    alone = [engine_greedy(pi, [ids], n)[0] for ids in prompts]
    for k, ours in enumerate(alone):
        assert_same_greedy(ours, *theirs[k], tie_tol=2e-3, what=f"prompt {k} alone")
    # all together: different prompt lengths, chunked and batched prefill, batched decode
    for k, ours in enumerate(engine_greedy(pi, prompts, n)):
        assert_same_greedy(ours, *theirs[k], tie_tol=2e-3, what=f"prompt {k} in a batch")
    # the public text API returns exactly those tokens, detokenized
    text = pi.generate(REAL_PROMPTS[0], max_new_tokens=n, temperature=0, ignore_eos=True)
    assert text == pi.detokenize(alone[0])


TOKENIZER_TEXTS = [
    "Hello world",
    "Hello, World! How are you doing today?",
    "",
    " ",
    "   leading and trailing spaces   ",
    "multiple    spaces     between\twords",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "digits 1234567890, 3.14159, 1e-5 and -42",
    "unicode: café naïve façade, 日本語のテキスト, Привет мир, 안녕하세요",
    "emoji 🤖🎉👍🏽 and symbols ©®™ ∑∫√ ≠ ≤",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|im_end|>special <|endoftext|>tokens<|im_start|>",
    "code: def f(x):\n    return x**2  # comment\n",
    "contractions: don't, I'll, we've, they're, it's, I'm, you'd",
    "URL https://example.com/path?q=1&r=2 and email a.b@c.org",
    "ALLCAPS and MiXeD CaSe and snake_case_words",
]


@pytest.mark.slow
def test_real_model_tokenizer_matches_transformers(default_model_path, real_ours):
    from transformers import AutoTokenizer

    _, pi = real_ours
    hf = AutoTokenizer.from_pretrained(str(default_model_path.parent),
                                       gguf_file=default_model_path.name)
    for text in TOKENIZER_TEXTS:
        theirs = hf.encode(text, add_special_tokens=False)
        assert pi.tokenizer.encode(text, add_bos=False) == theirs, text
        assert pi.tokenize(text) == hf.encode(text), f"default special tokens: {text!r}"
        assert pi.detokenize(theirs) == hf.decode(theirs, skip_special_tokens=True), text
    # special tokens are single ids
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert pi.tokenizer.encode(t, add_bos=False) == [hf.convert_tokens_to_ids(t)]
    # chat template rendering agrees with transformers' (same jinja template from the GGUF;
    # without a system message this template inserts its default one)
    assert hf.chat_template
    for msgs in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                 [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "2+2?"}]):
        assert pi.tokenizer.apply_chat_template(msgs) == hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)
    # a prefill: the render ends inside the assistant's last message, as transformers cuts it
    for last in ("The capital of Germany is", "  Berlin, "):
        msgs = [{"role": "user", "content": "What is the capital of Germany?"},
                {"role": "assistant", "content": last}]
        ours = pi.tokenizer.apply_chat_template(msgs, continue_final_message=True)
        assert ours == hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
        assert ours.endswith(last.strip()) or ours.endswith(last)
    with pytest.raises(ValueError, match="the last message must be the assistant's"):
        pi.tokenizer.apply_chat_template(msgs[:1], continue_final_message=True)


# ================================================== 2. FFN variants on small random LLaMA models

HF_ACT = {"swiglu": "silu", "reglu": "relu", "dreglu": "relu"}


def llama_variant(act: str, tied: bool = False, seed: int = 0, **overrides):
    """transformers LLaMA for an FFN variant (dReLU: relu + relu hooks on up_proj)."""
    model = C.build_hf_model(C.llama_family_config("llama", HF_ACT[act], tied,
                                                   eos_token_id=None, **overrides), seed)
    if act == "dreglu":
        C.add_drelu_hooks(model)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("act", ["swiglu", "reglu", "dreglu"])
def test_hf_folder_ffn_variant_matches_transformers(tmp_path, act, tied):
    hf = llama_variant(act, tied, seed=10 * ["swiglu", "reglu", "dreglu"].index(act) + tied)
    extra = {"ffn_activation": "dreglu"} if act == "dreglu" else None
    folder = C.save_hf(hf, tmp_path / "hf", extra, tokenizer=False)
    ck = load_checkpoint(folder)
    assert ck.args.ffn_act == act and ck.args.tie_embeddings == tied
    model = load_ours(folder)
    ids = random_ids(2, 24, seed=1)
    ref = hf_logits(hf, ids)
    assert ref.std() > 1.0  # a test with near-zero logits would prove nothing
    assert_close(ours_logits(model, ids), ref, TOL)


GGUF_CASES = [  # (activation, stored type, tied)
    ("swiglu", Q.F32, False), ("swiglu", Q.F16, True), ("swiglu", Q.Q8_0, False),
    ("reglu", Q.F32, True), ("reglu", Q.F16, False), ("reglu", Q.Q8_0, True),
    ("dreglu", Q.F32, False), ("dreglu", Q.F16, False), ("dreglu", Q.Q8_0, True),
]


@pytest.mark.parametrize("act,qtype,tied", GGUF_CASES,
                         ids=[f"{a}-{q.name}-{'tied' if t else 'untied'}"
                              for a, q, t in GGUF_CASES])
def test_gguf_ffn_variant_matches_transformers(tmp_path, act, qtype, tied):
    hf = llama_variant(act, tied, seed=7)
    path = tmp_path / "model.gguf"
    stored = C.write_llama_gguf(path, hf, None if act == "swiglu" else act, qtype)
    ck = load_checkpoint(path)
    assert ck.args.ffn_act == act and ck.args.tie_embeddings == tied
    assert qtype in {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    model = load_ours(path)
    ids = random_ids(2, 24, seed=2)
    ours = ours_logits(model, ids)
    # oracle: transformers on exactly the weights the file holds (after the F16 / Q8_0 round trip)
    oracle = copy.deepcopy(hf)
    oracle.load_state_dict(stored, strict=True)
    assert_close(ours, hf_logits(oracle, ids), TOL, f"{qtype.name} vs dequantized oracle")
    # and close to the unquantized model, within what the storage type loses (relative to the
    # logits' spread: F16 ~0.2%, Q8_0 ~7% measured on these random weights)
    full = hf_logits(hf, ids)
    loose = TOL if qtype == Q.F32 else {Q.F16: 0.01, Q.Q8_0: 0.15}[qtype] * full.std().item()
    assert_close(ours, full, loose, f"{qtype.name} vs full-precision model")


def test_a_bamboo_file_is_drelu_llama_as_transformers_computes_it(tmp_path):
    """`general.architecture = bamboo` (PowerInfer's ReLU-fied Mistral): a LLaMA layout whose FFN
    is dReLU by its architecture name alone (no powerinfer.ffn_activation key), against
    transformers' LLaMA with relu on the gate and a relu hook on up."""
    hf = llama_variant("dreglu", seed=41)
    path = tmp_path / "bamboo.gguf"
    C.write_llama_gguf(path, hf, None, Q.F32, arch="bamboo")
    assert "powerinfer.ffn_activation" not in gguf.GGUFReader(path).fields
    ck = load_checkpoint(path)
    assert ck.args.ffn_act == "dreglu"
    ids = random_ids(2, 24, seed=5)
    ref = hf_logits(hf, ids)
    assert ref.std() > 1.0
    assert_close(ours_logits(load_ours(path), ids), ref, TOL)


@pytest.mark.parametrize("qtype,tied", [(Q.F32, False), (Q.F16, True), (Q.Q8_0, False)],
                         ids=["F32", "F16-tied", "Q8_0"])
def test_gguf_file_read_by_transformers_gguf_loader(tmp_path, qtype, tied):
    """transformers' own GGUF loader (its own q/k un-permutation and dequantization) reads the
    same file: validates the writer's llama.cpp layout independently of our loader."""
    from transformers import AutoModelForCausalLM

    hf = llama_variant("swiglu", tied, seed=11)
    path = tmp_path / "model.gguf"
    C.write_llama_gguf(path, hf, None, qtype)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    ids = random_ids(1, 20, seed=3)
    assert_close(ours_logits(load_ours(path), ids), hf_logits(theirs, ids), TOL)


def test_gguf_qwen2_arch_matches_transformers(tmp_path):
    """arch "qwen2": q/k not permuted by llama.cpp, q/k/v biases."""
    hf = C.build_hf_model(C.llama_family_config("qwen2", eos_token_id=None), seed=5)
    path = tmp_path / "qwen2.gguf"
    stored = C.write_llama_gguf(path, hf, None, Q.F32, arch="qwen2")
    assert "model.layers.0.self_attn.q_proj.bias" in stored
    ids = random_ids(2, 20, seed=4)
    assert_close(ours_logits(load_ours(path), ids), hf_logits(hf, ids), TOL)


def test_small_model_incremental_decode_matches_full_forward(tmp_path):
    hf = llama_variant("swiglu", seed=3)
    model = load_ours(C.save_hf(hf, tmp_path / "hf", tokenizer=False))
    ids = random_ids(2, 16, seed=5)
    full = ours_logits(model, ids)
    assert_close(full, hf_logits(hf, ids), TOL)
    with torch.inference_mode():
        steps = [model(ids[:, :4], torch.arange(4).expand(2, 4))]
        for t in range(4, 16):
            steps.append(model(ids[:, t:t + 1], torch.full((2, 1), t)))
    assert_close(torch.cat(steps, dim=1), full, TOL, "incremental vs full forward")


# ============================================== 3. Qwen2 / Mistral (and LLaMA config variants)

FOLDER_CASES = {
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "mistral-head_dim32": ("mistral", {"head_dim": 32}),  # q width 128 != hidden 64 (Nemo-style)
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-rope-theta": ("llama", {"rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 500.0}}),
    "llama3-rope-scaling": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
}


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_hf_folder_llama_family_configs_match_transformers(tmp_path, case):
    model_type, overrides = FOLDER_CASES[case]
    cfg = C.llama_family_config(model_type, eos_token_id=None, **overrides)
    hf = C.build_hf_model(cfg, seed=21)
    folder = C.save_hf(hf, tmp_path / "hf", tokenizer=False)
    if model_type == "qwen2":
        assert load_checkpoint(folder).args.qkv_bias
    ids = random_ids(2, 40, seed=6)
    ref = hf_logits(hf, ids)
    assert ref.std() > 1.0
    assert_close(ours_logits(load_ours(folder), ids), ref, TOL)


def test_hf_folder_bf16_sharded_checkpoint_matches_transformers(tmp_path):
    """bfloat16 safetensors split over several shards (model.safetensors.index.json)."""
    hf = C.build_hf_model(C.llama_family_config("llama", eos_token_id=None), seed=23)
    folder = tmp_path / "hf"
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(folder, max_shard_size="60KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    # the oracle: transformers in fp32 on the bf16-rounded weights (rounding only the
    # parameters: .to(bfloat16) would also round transformers' RoPE inv_freq buffer)
    hf.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in hf.state_dict().items()})
    ids = random_ids(2, 20, seed=9)
    assert_close(ours_logits(load_ours(folder), ids), hf_logits(hf, ids), TOL)


@pytest.mark.parametrize("case", ["llama-attention_bias", "mistral-sliding_window"])
def test_hf_folder_features_off_the_common_path_are_exact(tmp_path, case):
    """Features outside the common path, both supported: q/k/v and o biases in transformers'
    LLaMA, and a sliding window shorter than the input. They load, and give transformers'
    logits (a refusal fails too: the loader supports them)."""
    if case == "llama-attention_bias":  # biases on q, k, v AND o_proj in transformers' LLaMA
        cfg = C.llama_family_config("llama", eos_token_id=None, attention_bias=True)
    else:  # a window shorter than the input: transformers masks keys older than 8 positions
        cfg = C.llama_family_config("mistral", eos_token_id=None, sliding_window=8)
    hf = C.build_hf_model(cfg, seed=31)
    folder = C.save_hf(hf, tmp_path / "hf", tokenizer=False)
    model = load_ours(folder)
    ids = random_ids(1, 24, seed=7)
    assert_close(ours_logits(model, ids), hf_logits(hf, ids), TOL,
                 f"{case}: loaded without error but")


# ========================================================================================= 4. OPT

@pytest.fixture(scope="module")
def opt_model(tmp_path_factory):
    hf = C.build_hf_model(C.opt_config(eos_token_id=None), seed=41)
    folder = C.save_hf(hf, tmp_path_factory.mktemp("opt") / "hf")
    return hf, folder


def test_opt_logits_match_transformers(opt_model):
    hf, folder = opt_model
    args = load_checkpoint(folder).args
    assert args.arch == "opt" and args.learned_pos and args.tie_embeddings
    ids = random_ids(2, 30, seed=8)
    ref = hf_logits(hf, ids)
    assert ref.std() > 1.0
    assert_close(ours_logits(load_ours(folder), ids), ref, TOL)


def test_opt_greedy_matches_transformers(opt_model):
    hf, folder = opt_model
    pi = PowerInfer.from_pretrained(folder, Config(dtype="float32", max_seq_len=64, max_batch=2))
    prompt = pi.tokenize("the world and the end of it")
    assert len(prompt) > 3
    theirs, logits = hf_greedy(hf, prompt, 16)
    (ours,) = engine_greedy(pi, [prompt], 16)
    assert_same_greedy(ours, theirs, logits, tie_tol=1e-3, what="OPT")


# ============================================================= 5. batched prefill, right padding

@pytest.fixture(scope="module", params=["llama-gqa", "opt"])
def batch_model(request, tmp_path_factory):
    if request.param == "opt":
        hf = C.build_hf_model(C.opt_config(eos_token_id=None), seed=51)
    else:
        hf = llama_variant("swiglu", seed=52)
    folder = C.save_hf(hf, tmp_path_factory.mktemp(request.param) / "hf")
    return hf, folder


BATCH_LENS = [5, 17, 9, 1]


def test_batched_prefill_logits_match_each_alone(batch_model):
    hf, folder = batch_model
    model = load_ours(folder, max_seq=64, max_batch=4)
    prompts = [random_ids(1, n, seed=60 + i)[0] for i, n in enumerate(BATCH_LENS)]
    T = max(BATCH_LENS)
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    last = torch.arange(len(prompts)) * T + torch.tensor(BATCH_LENS) - 1  # flat token indices
    with torch.inference_mode():
        batched = model(tokens, torch.arange(T).expand(len(prompts), T), last=last)
    assert batched.shape == (len(prompts), 1, C.VOCAB_SIZE)
    for i, p in enumerate(prompts):
        ref = hf_logits(hf, p[None])[0, -1]
        assert_close(batched[i, 0], ref, TOL, f"row {i} (length {len(p)}) vs transformers")
        alone = ours_logits(model, p[None])[0, -1]
        assert_close(batched[i, 0], alone, TOL, f"row {i} vs alone")


def test_batched_generation_matches_each_alone(batch_model):
    """Engine: different prompt lengths and different max_tokens (rows finish at different
    steps, so the decode batch shrinks and uses cache slots out of order)."""
    hf, folder = batch_model
    pi = PowerInfer.from_pretrained(folder, Config(dtype="float32", max_seq_len=64, max_batch=4))
    prompts = [random_ids(1, n, seed=70 + i)[0].tolist() for i, n in enumerate(BATCH_LENS)]
    max_tokens = [12, 4, 16, 7]
    batched = engine_greedy(pi, prompts, max_tokens)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        theirs, logits = hf_greedy(hf, p, m)
        assert_same_greedy(batched[i], theirs, logits, tie_tol=1e-3, what=f"row {i} batched")
        (alone,) = engine_greedy(pi, [p], m)
        assert batched[i] == alone, f"row {i}: batched {batched[i]} vs alone {alone}"
