"""The actor runtime on real Ray: its greedy output equals the in-process engine's (dense, and
sparse with the same predictors and placement, for 1, 2 and 4 cold executors, lookahead and
same-layer), batched concurrent requests, admission control, cancellation, health, and faults
(every actor role killed mid-generation).

The default model (SmolLM2, 30 layers) runs the dense group, the fast configuration's groups
(4-bit, bf16, native loops) and the placements. The float32 sparse groups, whose point is the
runtime's own arithmetic (every neuron computed once, in shards, the same sums as in process)
and its faults, run on a synthetic model of the tiny preset with planted, predictable firing
(4 layers of 1,024 neurons): the same code paths at a few percent of the default model's cost
a token and a load, so that a rebuilt group costs its processes' start and little more."""
import asyncio
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
import torch

from conftest import CPU_CLASSES
from powerinfer import Config, PowerInfer
from powerinfer.errors import OverloadedError
from powerinfer.sparsity.train import train_predictors
from powerinfer.sparsity.profile import ProfileOptions, profile
from powerinfer.sparsity.solver import solve_bundle

from greedy import (SPLIT_8BIT_TOL, assert_same_or_near_tie, assert_same_until_a_close_call,
                    chosen_logits, greedy_tokens)

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = dict(max_new_tokens=20, temperature=0, ignore_eos=True)
# one thread per process on both sides: a sum's order depends on how many threads share it,
# and greedy decoding of a model this small with a quick bundle's predictors flips on such ties
BASE = dict(dtype="float32", weights="dense", max_seq_len=256, max_batch=4, cpu_threads=1)


def shm_segments():
    return sorted(p.name for p in Path("/dev/shm").glob("powerinfer-*"))


THREADS = torch.get_num_threads()  # before any engine here sets it to 1


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield
    ray.shutdown()
    torch.set_num_threads(THREADS)


@contextmanager
def all_threads():
    """Offline work (profiling, training, evaluation) on every thread, then back to the engines'
    one: run after an engine here, it would otherwise run on one core (half the bundle's 50 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A synthetic model of the tiny preset (float32 sums, gate rows in a rank-16 subspace: its
    neurons' firing is predictable, as a trained model's is)."""
    from powerinfer.sparsity.synthetic import write_synthetic
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return str(write_synthetic(path, "tiny", subspace=16, seed=0, progress=False).path)


@pytest.fixture(scope="module")
def tiny_bundle(tiny, tmp_path_factory) -> str:
    """Its bundle: profile, both predictors, a placement (a few seconds in all)."""
    with all_threads():
        b = profile(tiny, "lee", tmp_path_factory.mktemp("tiny-rt") / "bundle",
                    ProfileOptions(tokens=2048, window=256, samples=2000), progress=False)
        for inp in ("layer", "ffn"):
            train_predictors(b, inp, ranks=[32], epochs=6, progress=False)
        solve_bundle(b, 0.005, context=256)
    return str(b.path)


def n_neurons(pi: PowerInfer) -> int:
    return pi.args.n_layers * pi.args.ffn_dim


def local(config: Config) -> list[str]:
    pi = PowerInfer.from_pretrained(MODEL, config)
    return [pi.generate(p, **GREEDY) for p in PROMPTS]  # one at a time


def assert_same_greedy(ref: PowerInfer, other: PowerInfer):
    """Token for token, but for a near-tie (0.05 in the fp32 logits the reference chose from):
    the two sum the FFN's neurons in another order once they are split over several executors
    (3e-5 apart in the logits), and the predictor, seeing inputs that differ by that rounding,
    may choose a neuron near its threshold on one side only (the in-process engine against
    itself with 1 and 2 threads: one such step in 60, moving the next logits by up to about 1).
    0.05 is headroom over the one parting seen (0.0020 apart, 4 executors): a parting on a clear
    choice, or one a flipped neuron caused there, still fails."""
    for p in PROMPTS:
        want, got = (greedy_tokens(m, p, GREEDY["max_new_tokens"]) for m in (ref, other))
        assert_same_or_near_tie(ref, ref.tokenize(p), want, got, 0.05)


def test_dense_plan_equals_local_engine(ray_cluster, tiny):
    # without a bundle every neuron is computed, in two shares (the hot executor's, the cold
    # executor's): float32 sums equal to the in-process engine's, token for token (on the small
    # synthetic model: the real model's groups are the 4-bit ones below)
    ref = PowerInfer.from_pretrained(tiny, Config(**BASE))
    want = [greedy_tokens(ref, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    pi = PowerInfer.from_pretrained(tiny, Config(runtime="actors", **BASE))
    try:
        assert [greedy_tokens(pi, p, GREEDY["max_new_tokens"]) for p in PROMPTS] == want
        assert [pi.generate(p, **GREEDY) for p in PROMPTS[:1]] == \
            [ref.generate(p, **GREEDY) for p in PROMPTS[:1]]  # (and as text)
        h = pi.engine.health()
        assert h["ok"] and h["restarts"] == 0, h
        # its decode steps' layer loop in C++ where the kernel library runs (the same sums as its
        # Python modules: the greedy strings above are equal in float32)
        from powerinfer import kernels
        assert pi.engine.group.info["hot"]["native"] == kernels.available()
        st = pi.engine.stats()["actors"]
        assert st["scheduler"]["finished"] == len(PROMPTS) + 2  # the text's and the probe too
        assert st["cold.0"]["messages"] > 0 and st["hot"]["steps"] > 0
        assert "predictor" not in st  # no bundle: every neuron computed, nothing to predict
    finally:
        pi.close()
    assert not shm_segments()


def test_one_executor_runs_the_whole_model_as_the_in_process_engine(ray_cluster, tiny):
    """Config(cold_executors=0): the group's one executor holds the whole model as the
    in-process engine builds it (its layer loop in C++) over the group's shared-memory plane,
    a process and its torch fewer; float32 tokens equal the in-process engine's. A stream whose
    executor is killed under it resumes on the rebuilt group with the tokens it had coming,
    but for a close call. A bundle or a GPU with it is refused by name."""
    from powerinfer.engine.params import SamplingParams
    from powerinfer.errors import ConfigError

    ref = PowerInfer.from_pretrained(tiny, Config(**BASE))
    want = [greedy_tokens(ref, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    pi = PowerInfer.from_pretrained(tiny, Config(runtime="actors", cold_executors=0, **BASE))
    try:
        assert [greedy_tokens(pi, p, GREEDY["max_new_tokens"]) for p in PROMPTS] == want
        e = pi.engine
        assert set(e.group.actors) == {"hot", "scheduler"}
        # its decode step where the in-process engine's runs (the C++ loop, or the modules)
        assert e.group.info["hot"]["native"] == (ref.engine.native is not None)
        st = e.stats()["actors"]["hot"]
        assert st["hot_neurons"] == n_neurons(pi) and st["part_wait_s"] == 0 and st["steps"] > 0
        # loaded and looping on one thread: one OpenMP team, whatever thread Ray calls it on
        assert st["threads"]["load"] == st["threads"]["loop"], st["threads"]

        N = 120
        sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=20)
        ids = pi.tokenize("Once upon a time")
        calm = [ev for ev in e.generate(ids, sp) if ev["token"] >= 0]
        got, restarts = [], e.restarts
        for ev in e.generate(ids, sp):
            if ev["token"] >= 0:
                got.append(ev)
            if len(got) == 10 and e.restarts == restarts:
                ray.kill(e.group.actors["hot"], no_restart=True)
        assert e.restarts == restarts + 1, e.last_failure
        assert len(got) == N
        assert_same_until_a_close_call(calm, got, 1.0)
        assert e.health()["ok"]
    finally:
        pi.close()
    assert not shm_segments()
    with pytest.raises(ConfigError, match="cold_executors=0"):
        Config(runtime="actors", cold_executors=0, bundle="some.bundle")
    with pytest.raises(ConfigError, match="VRAM budget"):
        Config(runtime="actors", cold_executors=0, vram_budget_gb=4)


def test_one_executor_decodes_the_real_model_natively_as_in_process(ray_cluster):
    """The same on the real model with the defaults (its 4-bit blocks, the native loop), one
    thread each side: the same computation, so the same tokens."""
    cfg = dict(max_seq_len=256, max_batch=2, cpu_threads=1)
    ref = PowerInfer.from_pretrained(MODEL, Config(**cfg))
    want = greedy_tokens(ref, PROMPTS[0], 24)
    pi = PowerInfer.from_pretrained(MODEL, Config(runtime="actors", cold_executors=0, **cfg))
    try:
        assert pi.engine.group.info["hot"]["native"] and ref.engine.native is not None
        assert greedy_tokens(pi, PROMPTS[0], 24) == want
    finally:
        pi.close()


def test_a_group_on_one_core_computes_the_in_process_floats_in_float32(ray_cluster):
    """A served model's layout (a hot and a cold executor sharing one core: the hot one holds
    every neuron and head) with float32 activations over the file's 4-bit blocks: every step's
    log-probabilities, the prompt's first token included, are the in-process engine's. The
    8-bit activations turn any last-bit difference into 0.1-0.3 (the in-process engine's
    prompt step in the Python modules gave that, where the group runs its prompts in the
    native loop: benchmarks/logit_spread.py), so this holds only with the same arithmetic."""
    from powerinfer.engine.params import SamplingParams
    cfg = dict(dtype="float32", weights="int4", max_seq_len=256, max_batch=2, cpu_threads=1)
    ref = PowerInfer.from_pretrained(MODEL, Config(**cfg))
    core = str(min(os.sched_getaffinity(0)))
    pi = PowerInfer.from_pretrained(MODEL, Config(runtime="actors", cold_executors=1, cores=core,
                                                  **cfg))
    try:
        assert pi.engine.stats()["actors"]["cold.0"]["neurons"] == 0  # the hot one holds them
        chat = ref.tokenizer.apply_chat_template([{"role": "user",
                                                   "content": "Why is the sky blue?"}])
        for ids in [ref.tokenize(p) for p in PROMPTS] + [ref.tokenize(chat)]:
            logits, want = chosen_logits(ref, ids, 12)
            lps = torch.log_softmax(logits.float(), -1)
            events = [ev for ev in pi.engine.generate(ids, SamplingParams(
                max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)) if ev["token"] >= 0]
            assert [ev["token"] for ev in events] == want
            for k, ev in enumerate(events):
                for t, lp in [*ev["top_logprobs"], (ev["token"], ev["logprob"])]:
                    assert abs(lp - float(lps[k, t])) < 1e-4, (k, t, lp, float(lps[k, t]))
    finally:
        pi.close()


def test_a_prompt_past_the_first_rope_chunk_decodes_as_in_process(ray_cluster, tmp_path):
    """The RoPE tables are one segment a group: the hot executor fills their rows as steps reach
    them, before it sends a step on, and a cold executor attending with its share of the heads
    reads the same rows. A prompt past the first chunk of rows (a small synthetic model of a
    longer context, its KV heads split between the hot and the cold executor) decodes as the
    in-process engine does."""
    from dataclasses import replace

    from greedy import greedy_ids
    from powerinfer.formats.rope import ROPE_CHUNK
    from powerinfer.sparsity.synthetic import PRESETS, write_synthetic

    shape = replace(PRESETS["tiny"], context=ROPE_CHUNK + 1024)
    path = str(write_synthetic(tmp_path / "long.gguf", shape, seed=3, progress=False).path)
    cfg = dict(BASE, max_seq_len=ROPE_CHUNK + 512)
    ref = PowerInfer.from_pretrained(path, Config(**cfg))
    ids = torch.randint(3, ref.args.vocab_size, (ROPE_CHUNK + 200,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    want = greedy_ids(ref, ids, 8)
    pi = PowerInfer.from_pretrained(path, Config(runtime="actors", **cfg))
    try:
        info = pi.engine.group.info
        assert info["cold.0"]["kv_heads"][1] > info["cold.0"]["kv_heads"][0], info["cold.0"]
        assert pi.engine.group.spec.ropes == 1  # (the shared segment, not each one's own)
        assert_same_or_near_tie(ref, ids, want, greedy_ids(pi, ids, 8), 0.05)
    finally:
        pi.close()
    assert not shm_segments()


def split_as_the_group(ref: PowerInfer, group) -> PowerInfer:
    """The in-process sparse engine with each layer's neurons in two sets as an actor group holds
    them (the hot executor's share, the rest: with one cold executor, its set): it computes every
    layer's neurons in one set, and a predictor reading a residual one rounding apart picks
    another neuron near its threshold now and then (in bf16 here from the second token on), where
    the same two sets decode as the actors do, token for token."""
    from powerinfer.model.sparse import NeuronSet, hybrid_layers
    for i, f in enumerate(hybrid_layers(ref.model)):
        s, hot = f.cold, group.plan.hot_mask(i, group.hot_share)
        f.hot, f.cold = (NeuronSet.from_rows(s.act, idx, s.fmt, s.dtype, s.dim, records=s.records[idx])
                         for idx in (hot.nonzero().squeeze(-1), (~hot).nonzero().squeeze(-1)))
    return ref


@pytest.mark.slow
# lookahead with two cold executors (the module's shared group); the same-layer predictor with
# four (one cold executor: the int4 groups below)
@pytest.mark.parametrize("n_cold,predictor", [(2, "layer"), (4, "ffn")])
def test_sparse_equals_local_sparse_engine(request, ray_cluster, tiny, tiny_bundle, n_cold,
                                           predictor):
    # the in-process engine with each layer's neurons in the group's hot set and the rest (its
    # cold executors' shards in one set): the same sums in the same order but for the shards'
    # partial sums (the near-tie tolerance); in one set, another order of the same sums makes
    # the predictors flip a near-threshold neuron now and then, past any near-tie
    cfg = dict(BASE, bundle=tiny_bundle, predictor=predictor)
    shared = n_cold == 2  # sparse_actors: BASE with the bundle, lookahead (the default)
    pi = request.getfixturevalue("sparse_actors") if shared else \
        PowerInfer.from_pretrained(tiny, Config(runtime="actors", cold_executors=n_cold, **cfg))
    group = pi.engine.group
    colds = [a for name, a in sorted(group.actors.items()) if name.startswith("cold")]
    # lookahead masks come out before attention: the cold executors' native loops warm the
    # records they select while they wait for the layer's FFN input (`cold_serve`'s `ahead`)
    warms = predictor == "layer" and group.spec.warm_ahead and group.info["cold.0"]["native"]
    # the predictor's every step in its native loop, in a process without torch (`pred_native`)
    from powerinfer import kernels
    assert group.info["predictor"]["torch"] is not kernels.available(), group.info["predictor"]
    try:
        ref = split_as_the_group(PowerInfer.from_pretrained(tiny, Config(**cfg)), group)
        ray.get([a.loop_profile.remote("start") for a in colds])
        assert_same_greedy(ref, pi)  # (the warmed answers are the same sums)
        warmed = [p.get("cold: records warmed", 0) for p in
                  ray.get([a.loop_profile.remote("stop") for a in colds])]
        assert all(w > 0 for w in warmed) if warms else not any(warmed), warmed
        st = pi.engine.stats()["actors"]
        assert st["predictor"]["input"] == predictor and st["predictor"]["calls"] > 0
        assert sum(st[f"cold.{k}"]["neurons"] for k in range(n_cold)) + st["hot"]["hot_neurons"] \
            == n_neurons(ref)  # every neuron in exactly one place
    finally:
        if not shared:
            pi.close()
    if not shared:
        assert not shm_segments()


def test_the_in_process_sparse_engine_decodes_in_the_native_loop(bundle):
    # the fast configuration with a bundle (bf16, 4-bit neurons on the CPU kernel, each layer's
    # predictor on the kernel's GEMV): its decode steps run every layer's predictor and neurons
    # inside the C++ layer loop, and decode what the model's modules decode
    from powerinfer import kernels
    from powerinfer.engine.native import NativeDecode
    if not kernels.available():
        pytest.skip("the kernel library does not run here (needs g++ and AVX2)")
    # (two threads: the kernel's work split between them, below)
    pi = PowerInfer.from_pretrained(MODEL, Config(**dict(BASE, dtype="bfloat16", weights="int4", bundle=bundle,
                                                         predictor="ffn", cpu_threads=2)))
    native = pi.engine.native
    assert isinstance(native, NativeDecode) and native.sparse and len(native.sparse) == 30
    got = [greedy_tokens(pi, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    decode, pi.engine._decode = pi.engine._decode, pi.engine._forward  # the modules' loop
    for p, ids in zip(PROMPTS, got):
        want = greedy_tokens(pi, p, GREEDY["max_new_tokens"])
        assert_same_or_near_tie(pi, pi.tokenize(p), want, ids, 0.05)
    assert "Paris" in pi.detokenize(got[0])
    # batched, each sequence decodes what it decodes alone, to the last bit: a row keeps its own
    # predicted neurons, and the kernel's split of the work does not move with the batch's union
    pi.engine._decode = decode
    assert_at_once_as_alone(pi, got)


def assert_at_once_as_alone(pi: PowerInfer, alone: list[list[int]]):
    # PROMPTS decoded greedily at once: each sequence's tokens are `alone[i]`, what it decodes
    # alone, to the last bit
    events = list(pi._run([pi.tokenize(p) for p in PROMPTS], GREEDY["max_new_tokens"],
                          dict(temperature=0, ignore_eos=True)))
    for i, want in enumerate(alone):
        assert [ev.token for ev in events if ev.index == i and ev.token >= 0] == want, i


def assert_bf16_greedy_tracks(ref: PowerInfer, pi: PowerInfer):
    # a split group's 8-bit activations part from the in-process engine's at near-ties
    for p in PROMPTS:
        want, got = (greedy_tokens(m, p, GREEDY["max_new_tokens"]) for m in (ref, pi))
        assert_same_or_near_tie(ref, ref.tokenize(p), want, got, SPLIT_8BIT_TOL)
    assert "Paris" in pi.generate("The capital of France is", **GREEDY)


@pytest.mark.slow
@pytest.mark.parametrize("predictor", ["layer", "ffn"])
def test_int4_actors_equal_the_int4_sparse_engine(ray_cluster, bundle, predictor):
    # the fast configuration: 4-bit attention, neurons in the file's 4-bit blocks on the CPU
    # kernel (down rows 8-bit), an 8-bit output head, in bf16 on both sides; bf16 sums in
    # another order tie-break differently, hence the bf16 near-tie tolerance. Every process's
    # decode step runs in the kernel library's native loops (the predictor's too), which send
    # the predictor the layer's input before attention (lookahead) or the FFN's after it.
    # With the lookahead predictor, the same group then loses its predictor mid-stream (one
    # group start less than a test of its own)
    cfg = dict(BASE, dtype="bfloat16", weights="int4", bundle=bundle, predictor=predictor)
    pi = PowerInfer.from_pretrained(MODEL, Config(runtime="actors", **cfg))
    try:
        group = pi.engine.group
        ref = split_as_the_group(PowerInfer.from_pretrained(MODEL, Config(**cfg)), group)
        info = group.info
        assert info["cold.0"]["format"] == "q4_1"  # the file's blocks, not a wider copy
        from powerinfer import kernels
        if kernels.available():
            assert info["hot"]["native"] and info["cold.0"]["native"] and info["predictor"]["native"]
            # the cold executor without torch: a prompt over its records in the kernel library
            assert info["cold.0"]["torch"] is False and info["cold.0"]["torch_why"] == "", info["cold.0"]
            # and the hot one: the predictor's input and masks, its records, the head in one C
            # call a step (a prompt's step over every record, `records_rows`)
            assert info["hot"]["torch"] is False and info["hot"]["torch_why"] == "", info["hot"]
        # on a CPU the placement places nothing: the hot executor holds its cores' share of
        # each layer's neurons, dealt by activation mass (`SparsePlan.dealt`)
        assert abs(info["hot"]["hot_neurons"] - group.hot_share * 30 * 1536) <= 30
        assert_bf16_greedy_tracks(ref, pi)
        st = pi.engine.stats()["actors"]
        assert st["predictor"]["calls"] > 0 and st["predictor"]["busy_s"] > 0
        if predictor == "layer" and kernels.available():
            assert_a_stream_survives_the_predictor_dying(pi)
        else:  # streams at once: each decodes, to the last bit, what it decodes alone
            assert_at_once_as_alone(pi, [greedy_tokens(pi, p, GREEDY["max_new_tokens"])
                                         for p in PROMPTS])
    finally:
        pi.close()
    assert not shm_segments()


def assert_a_stream_survives_the_predictor_dying(pi: PowerInfer):
    # the fast configuration, where the hot executor's native loop waits for the predictor's
    # masks in C++: a predictor killed mid-stream is named as the cause, the group is rebuilt,
    # and the stream goes on to its last token
    from powerinfer.engine.params import SamplingParams
    e = pi.engine
    assert e.group.info["hot"]["native"] and e.group.info["predictor"]["native"]
    got, failures = [], []

    def consume():
        try:
            for ev in e.generate(pi.tokenize("Tell me a long story"),
                                 SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)):
                got.append(ev["token"])
        except Exception as ex:  # noqa: BLE001 - asserted below
            failures.append(ex)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.time() + 60
    while len(got) < 4 and time.time() < deadline:
        time.sleep(0.01)
    restarts = e.restarts
    ray.kill(e.group.actors["predictor"], no_restart=True)
    t.join(timeout=120)
    assert not t.is_alive() and not failures, failures
    assert len([x for x in got if x >= 0]) == 32
    # named as the cause: by the group's watchdog, by the call that met the dead actor first
    # (Ray's "... is dead ..."), or by a native loop that found its process gone (by pid)
    why = str(e.last_failure)
    assert e.restarts == restarts + 1 and why.startswith("predictor:") and \
        ("died" in why or "dead" in why), why
    assert "Paris" in pi.generate("The capital of France is", **GREEDY)


@pytest.mark.slow
def test_cold_executors_keep_the_files_blocks_beside_a_dense_hot_executor(ray_cluster, bundle):
    # what a group beside a GPU runs (the hot executor widens the file to bf16, the cold
    # executors keep its 4-bit blocks: `Config.cold_weights`), here with both sides on the CPU.
    # Each side's numerics are the ones the int4 and dense groups' equality tests check; mixed,
    # a decode follows the dense engine only to its first close call (this model and bundle
    # flip on small differences), so what is checked is what would break: the cold neurons held
    # and read as the file's Q4_1 blocks with their Q8_0 down rows (0.385 of the bytes of bf16
    # records: 20 + 20 + 34 bytes a block of 32 weights against 3 x 64), every prompt's first
    # token (a prefill, every neuron) that of the dense bf16 engine, and an answer that still
    # knows its facts
    cfg = dict(BASE, dtype="bfloat16", bundle=bundle)
    ref = PowerInfer.from_pretrained(MODEL, Config(**cfg))
    pi = PowerInfer.from_pretrained(MODEL, Config(runtime="actors", cold_weights="int4", **cfg))
    try:
        assert (pi.config.weights, pi.config.cold_weights) == ("dense", "int4")
        cold = pi.engine.group.info["cold.0"]
        assert cold["format"] == "q4_1" and cold["neurons"] > 0
        bf16_records = cold["neurons"] * 3 * pi.engine.group.args.dim * 2
        assert 0.37 < cold["neuron_bytes"] / bf16_records < 0.40, (cold, bf16_records)
        for p in PROMPTS:
            assert greedy_tokens(pi, p, 1) == greedy_tokens(ref, p, 1), p
        assert "Paris" in pi.generate("The capital of France is", **GREEDY)
    finally:
        pi.close()
    assert not shm_segments()


def test_cold_weights_follow_the_host(monkeypatch, tmp_path):
    # the cold executors' weights: as `weights` on a CPU; beside a GPU, the file's 4-bit blocks
    # wherever the host's kernel runs, on every class, unless dense was asked for; the in-process
    # engine has no cold executors. The hot executor on a GPU keeps a 4-bit file's blocks where
    # the Triton kernels are installed (else it widens them to bf16); a whole model in one
    # process on a GPU stays bf16
    from powerinfer import config as config_module
    from powerinfer import kernels
    from powerinfer.errors import ConfigError
    for triton, hot in ((True, "int4"), (False, "dense")):
        monkeypatch.setattr(config_module, "_triton_installed", lambda: triton)
        for isa in kernels.ISAS[:kernels.ISAS.index(kernels.best_isa()) + 1]:
            gpu = Config(runtime="actors", device="cuda", cpu_isa=isa).resolve(has_q4=True)
            assert (gpu.dtype, gpu.weights, gpu.cold_weights) == ("bfloat16", hot, "int4")
        assert Config(device="cuda").resolve(has_q4=True).weights == "dense"  # in process
    monkeypatch.setattr(config_module, "_triton_installed", lambda: True)
    assert Config(runtime="actors", device="cuda", dtype="float32").resolve(True).weights == "dense"
    assert Config(runtime="actors", device="cuda").resolve(has_q4=False).weights == "dense"
    monkeypatch.setattr(kernels, "best_isa", lambda: "none")  # a host the kernel cannot run on
    gpu = Config(runtime="actors", device="cuda").resolve(has_q4=True)
    assert (gpu.dtype, gpu.weights, gpu.cold_weights) == ("bfloat16", "int4", "dense")
    monkeypatch.undo()
    assert Config(runtime="actors", device="cuda").resolve(has_q4=False).cold_weights == "dense"
    assert Config(runtime="actors", device="cuda", weights="dense").resolve(True).cold_weights == "dense"
    assert Config(device="cuda").resolve(has_q4=True).cold_weights == "dense"  # in process
    cpu = Config(runtime="actors").resolve(has_q4=True)
    assert cpu.cold_weights == cpu.weights
    assert Config(runtime="actors", weights="dense", cold_weights="int4",
                  dtype="bfloat16").resolve(True).cold_weights == "int4"
    with pytest.raises(ConfigError, match="cold_weights='int4' runs in bfloat16 or float32"):
        Config(cold_weights="int4", dtype="float16")
    with pytest.raises(ConfigError, match="cold_weights must be"):
        Config(cold_weights="int8")
    # asked for on a file with nothing 4-bit: named at load, before any actor starts
    from powerinfer.errors import ModelLoadError
    from powerinfer.sparsity.synthetic import write_synthetic
    path = tmp_path / "bf16.gguf"
    write_synthetic(path, "tiny", n_layers=1, progress=False)
    with pytest.raises(ModelLoadError, match="cold_weights='int4' needs a GGUF file with Q4_0/Q4_1"):
        PowerInfer.from_pretrained(str(path), Config(runtime="actors", dtype="bfloat16",
                                                     cold_weights="int4"))


def assert_native_prompt_steps_equal_the_modules(pi: PowerInfer):
    """The hot executor's prompt steps through its C++ layer loop (every layer in 16-row group
    layouts): a prompt alone, then one that arrives while the first decodes (its chunk beside that
    decode row). Every sampled token's log-probabilities, prompt steps and the decode steps after
    them (over the KV cache the prompt steps wrote), equal those of the same requests with the hot
    executor's prompt steps through its Python modules (`prompts_natively(False)`), bit for bit.
    (The cold executors answer a prompt's rows in their native loop either way, with the C++ a
    prompt step runs in process: test_native.py checks that against the modules.)"""
    hot = pi.engine.group.actors["hot"]
    runs = {}
    try:
        for native in (True, False):
            ray.get(hot.prompts_natively.remote(native))
            before = pi.engine.stats()["actors"]["hot"]["native_prompt_steps"]
            runs[native] = prompt_beside_decode(pi), \
                pi.engine.stats()["actors"]["hot"]["native_prompt_steps"] - before
    finally:
        ray.get(hot.prompts_natively.remote(True))
    assert runs[True][1] >= 2 and runs[False][1] == 0, (runs[True][1], runs[False][1])
    assert [len(r) for r in runs[True][0]] == [12, 12]
    assert runs[True][0] == runs[False][0]


@pytest.mark.slow
def test_int4_dense_split_equals_the_in_process_engine(ray_cluster):
    # the shipped configuration without a bundle: each executor's neurons are whole 4-bit blocks
    # of the file (BlockSlice: the int4 GEMV), its attention its KV heads' share, and the output
    # head is split by vocabulary rows between the hot executor and the two cold executors; held
    # to the lowest class the kernel builds for (AVX2), which every actor of the group runs.
    # Each cold executor holds its shard without torch (`cold_native`: loaded by a child
    # process, answered by the native loop through the library's C entry points) and answers
    # every step there, prompts and a decode step wider than a GEMV's batch (65 rows and up)
    # included: 66 copies of a prompt decoded together give each the tokens it gives alone, and
    # those track the in-process engine's
    from powerinfer import kernels
    low = CPU_CLASSES[0] if CPU_CLASSES else "auto"
    cfg = dict(BASE, dtype="bfloat16", weights="int4", cpu_isa=low, max_batch=66)
    ref = PowerInfer.from_pretrained(MODEL, Config(**cfg))
    pi = PowerInfer.from_pretrained(MODEL, Config(runtime="actors", cold_executors=2, **cfg))
    try:
        info = pi.engine.group.info
        if kernels.available():
            assert pi.engine.stats()["isa"] == {"hot": low, "cold.0": low, "cold.1": low}
            assert [info[f"cold.{k}"]["block_slices"] for k in range(2)] == [30, 30]
            # attention split by KV heads too (3 of them: one each), answered natively
            kv = [info[r]["kv_heads"] for r in ("hot", "cold.0", "cold.1")]
            assert kv == [[0, 1], [1, 2], [2, 3]], kv
            for k in range(2):
                cold = info[f"cold.{k}"]
                assert cold["native"] and cold["native_attention"] == 30
                assert cold["torch"] is False and cold["torch_why"] == "", cold
            assert info["hot"]["native"]  # its decode step's layer loop in C++ (`hot_layers`)
            # and its whole step, embeddings and head too, in a process without torch
            assert info["hot"]["torch"] is False and info["hot"]["torch_why"] == "", info["hot"]
            # the tied 8-bit head's rows regrouped 16 at a time (q8x16) on every executor
            assert info["cold.0"]["head"] == info["cold.1"]["head"] == "KQuantLinear"
        rows = [info["hot"]["head_rows"], *(info[f"cold.{k}"]["head_rows"] for k in range(2))]
        assert sum(rows) == 49152 and min(rows) > 0  # every row of the head in one place
        assert_bf16_greedy_tracks(ref, pi)
        if kernels.available():  # its prompt steps in the native loops too
            assert_each_loop_profiles_its_phases(pi)
            ids = pi.tokenize(PROMPTS[0])
            alone = decode(pi, [ids], 24)[0]
            together = decode(pi, [ids] * 66, 24)
            assert all(t == alone for t in together)
            sched = ray.get(pi.engine.group.actors["scheduler"].stats.remote())
            assert sched["widest_decode"] > 64, sched
            assert_steps_keep_their_blocks(pi)
            # a torch-free executor's memory is counted as the torch one's: its shard's
            # weights, its KV blocks as written
            mem = pi.engine.memory()["cold.0"]
            assert 0 < mem["weight_resident"] <= mem["weight"]
            assert 0 < mem["kv_resident"] < mem["kv"]
            # and so is the torch-free hot executor's: its weights, KV blocks and RoPE rows
            hot = pi.engine.memory()["hot"]
            assert 0 < hot["weight_resident"] <= hot["weight"] and 0 < hot["kv_resident"] < hot["kv"]
    finally:
        pi.close()
    assert not shm_segments()


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "bundle"])
def test_the_torch_free_hot_executor_steps_as_the_torch_one(ray_cluster, monkeypatch, request, sparse):
    """The shipped configuration's hot executor runs without torch (`actors.hot_native`: the
    tokens' embeddings, the layer loop, the final norm and its share of the head in one C call a
    step), with SmolLM2's bundle too (the predictor's input and masks exchanged in the loop, a
    prompt's step over every hot record): two requests, the second's prompt step beside the
    first's decode rows, give every token and log-probability of the torch executor's native
    step bit for bit (which is checked against the torch executor's Python modules here too); the
    torch-free process maps no torch. `POWERINFER_HOT_EXECUTOR=torch` asks for the torch one,
    and its group says why."""
    from powerinfer import kernels
    if not kernels.available():
        pytest.skip("the kernel library does not run on this CPU: no native step")
    cfg = dict(BASE, dtype="bfloat16", weights="int4", max_seq_len=256)
    if sparse:
        cfg["bundle"] = request.getfixturevalue("bundle")
    runs = {}
    for mode in ("auto", "torch"):
        monkeypatch.setenv("POWERINFER_HOT_EXECUTOR", mode)
        pi = PowerInfer.from_pretrained(MODEL, Config(runtime="actors", **cfg))
        try:
            hot = pi.engine.group.info["hot"]
            assert hot["torch"] is (mode == "torch") and hot["native"], hot
            assert hot["torch_why"] == ("POWERINFER_HOT_EXECUTOR=torch" if mode == "torch" else "")
            runs[mode] = prompt_beside_decode(pi)
            st = pi.engine.stats()["actors"]["hot"]
            assert st["native_prompt_steps"] >= 2 and st["steps"] >= 12, st
            if mode == "torch":
                assert_native_prompt_steps_equal_the_modules(pi)
            else:  # (a diagnostic the torch-free executor has no modules for, said plainly)
                with pytest.raises(ray.exceptions.RayTaskError, match="without torch"):
                    ray.get(pi.engine.group.actors["hot"].prompts_natively.remote(False))
        finally:
            pi.close()
    assert [len(r) for r in runs["auto"]] == [12, 12]
    assert runs["auto"] == runs["torch"]
    assert not shm_segments()


def prompt_beside_decode(pi: PowerInfer) -> list[list[tuple]]:
    """Two greedy requests of 12 tokens with their 3 likeliest log-probabilities, the second's
    prompt step beside the first's decode rows: each token as (token, log-probability, top)."""
    from powerinfer.engine.params import SamplingParams
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    first, second = (pi.tokenize(p) for p in PROMPTS[:2])
    out = [[], []]

    def run(i, ids, then=None):
        for ev in pi.engine.generate(ids, params):
            out[i].append((ev["token"], ev["logprob"], tuple(ev["top_logprobs"])))
            if then is not None and len(out[i]) == 2:
                then.start()  # its prompt step beside this request's decode rows
    later = threading.Thread(target=run, args=(1, second))
    run(0, first, later)
    later.join()
    return out


def assert_each_loop_profiles_its_phases(pi: PowerInfer):
    # each executor's native loop by phase (benchmarks/runtime.py's `hot_phases`), counted only
    # while asked for: the hot executor's own work and its waits for the cold executors, and
    # each cold executor's answers (its attention's projections inside them) and waits
    actors = pi.engine.group.actors
    execs = [actors["hot"], *(actors[f"cold.{k}"] for k in range(pi.config.cold_executors))]
    ray.get([a.loop_profile.remote("start") for a in execs])
    pi.generate("The capital of France is", max_new_tokens=6, temperature=0, ignore_eos=True)
    hot, *cold = ray.get([a.loop_profile.remote("stop") for a in execs])
    assert hot["calls"] >= 5
    for phase in ("q/k/v projection", "FFN", "waits for the executors' attention",
                  "waits for the executors' FFN", "sends to the executors"):
        assert hot[phase] > 0, phase
    assert hot["cold: FFN answered"] == 0
    for c in cold:
        assert c["calls"] == 0 and c["FFN"] == 0  # (no hot_layers there)
        for phase in ("cold: waits for messages", "cold: FFN answered", "cold: head rows answered"):
            assert c[phase] > 0, phase
        assert c["cold: attention answered"] >= c["q/k/v projection"] > 0
    # stopped: nothing more is counted
    assert ray.get(actors["hot"].loop_profile.remote("read")) == hot


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def assert_steps_keep_their_blocks(pi: PowerInfer):
    # a torch-free executor's steps keep their tensors' large blocks for the next layer's
    # (`pilite::BlockCache`), where glibc could give each layer's back to the system and fault
    # them in again at the next (a 240-token prompt: about 25,000 page faults of the hot
    # executor's; kept, its KV blocks' first writes at most, about 500)
    actors, info = pi.engine.group.actors, pi.engine.group.info
    for role in ("hot", *(f"cold.{k}" for k in range(pi.config.cold_executors))):
        b = ray.get(actors[role].stats.remote())["blocks"]
        assert b["reused"] > 5 * b["made"] > 0 and 0 < b["kept_bytes"] <= b["cap_bytes"], (role, b)
    ids = torch.randint(3, pi.args.vocab_size, (240,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    decode(pi, [ids], 1)  # (its KV blocks written once)
    before = minor_faults(info["hot"]["pid"])
    decode(pi, [[ids[0] + 1, *ids[1:]]], 1)  # (no cached prefix)
    assert minor_faults(info["hot"]["pid"]) - before < 5000


def decode(m: PowerInfer, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy ids of `prompts` decoded together (one batch in the in-process engine, concurrent
    requests in the actor runtime's)."""
    out = [[] for _ in prompts]
    for ev in m._run(prompts, n, dict(temperature=0, ignore_eos=True)):
        if ev.token >= 0:
            out[ev.index].append(ev.token)
    return out


@pytest.mark.slow
def test_compiled_split_attention_equals_the_in_process_engine(ray_cluster, tmp_path):
    # The fast path's exchanges, on a small random model in float32 (it compiles in seconds and
    # its sums agree to fp32 rounding): without a predictor on a CPU the hot executor compiles
    # its decode step (Inductor's C++ calling the channel ops), attention is split by KV heads,
    # and the cold executors answer decode steps in their native loop.
    from checkpoints import build_hf_model, llama_family_config, write_llama_gguf
    from powerinfer import kernels
    if not kernels.available():
        pytest.skip("the kernel library does not run here: no native exchanges")
    cfg = llama_family_config(hidden_size=128, intermediate_size=256, num_attention_heads=8,
                              num_key_value_heads=4)
    model = tmp_path / "small.gguf"
    write_llama_gguf(model, build_hf_model(cfg, seed=5))
    kw = dict(dtype="float32", weights="dense", max_seq_len=128, max_batch=2, cpu_threads=1)
    ref = PowerInfer.from_pretrained(model, config=Config(**kw))
    pi = PowerInfer.from_pretrained(model, config=Config(runtime="actors", cold_executors=1,
                                                              compile=True, **kw))
    prompts = [[5, 17, 99, 150, 33, 2, 250, 7], [9, 8, 7]]
    try:
        info = pi.engine.group.info
        assert info["hot"]["compiled"] and info["cold.0"]["native"]
        assert info["hot"]["kv_heads"][0] == 0 and info["cold.0"]["kv_heads"][1] == 4
        assert info["hot"]["kv_heads"][1] == info["cold.0"]["kv_heads"][0] > 0  # both hold heads
        # two rows at two positions as their block tables widen from two blocks to three (a
        # batch of one on its own is tests/test_generation.py's in-process compiled step)
        for p, want, got in zip(prompts, decode(ref, prompts, 40), decode(pi, prompts, 40)):
            assert_same_or_near_tie(ref, p, want, got, 1e-3)
        st = pi.engine.stats()["actors"]
        # one graph for steps of several rows and at most one for a step of one (the two
        # requests may reach the scheduler a step apart); before, the tables' widening from
        # one block to two and then three compiled more
        assert st["hot"]["compiled_graphs"] <= 2, st["hot"]
        # attention and FFN of 2 layers in each of 40 steps (the prompt's and 39 decode steps)
        assert st["cold.0"]["messages"] >= 2 * 2 * 40
    finally:
        pi.close()
    assert not shm_segments()


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_m", "q8_0"])
def test_int4_dense_split_of_a_k_quant_file(ray_cluster, tmp_path, quant):
    # a Q4_K_M file (llama.cpp's choice of type per tensor; its more-bits layers keep v and down
    # in Q6_K), a Q5_K_M file the same over Q5_K, and a Q8_0 file (its blocks 16 rows at a
    # time, q8x16): each executor's share of the FFN is a block slice cut at 256 neurons,
    # gate+up and down's columns in the file's own blocks, and so are attention and the head;
    # the cold executor answers its slices, its KV heads (a K-quant file's q and k in Q4_K, v
    # in Q6_K: two runs) and its head rows in its native loop; greedy tokens as the in-process
    # engine's
    from powerinfer import kernels
    from powerinfer.model.quant import KQuantLinear
    from powerinfer.sparsity.synthetic import write_synthetic
    if not kernels.available():
        pytest.skip("the kernel library does not run here: no block slices")
    model = write_synthetic(tmp_path / "m.gguf", preset="tiny", quant=quant, progress=False).path
    kw = dict(dtype="bfloat16", weights="int4", max_seq_len=128, max_batch=2, cpu_threads=1)
    ref = PowerInfer.from_pretrained(model, config=Config(**kw))
    assert isinstance(ref.model.layers[3].attn.wqkv, KQuantLinear)
    pi = PowerInfer.from_pretrained(model, config=Config(runtime="actors", cold_executors=1, **kw))
    prompts = [list(range(3, 40)), [9, 8, 7], [5, 17, 99, 150, 33, 2, 250, 7, 1, 60, 61, 4]]
    try:
        info = pi.engine.group.info
        assert info["cold.0"]["block_slices"] == ref.args.n_layers and info["cold.0"]["native"]
        assert info["cold.0"]["head_rows"] > 0 and info["cold.0"]["head"] == "KQuantLinear"
        # its block slices' gate+up and down in the file's own blocks too (cut at 256 neurons)
        assert info["cold.0"]["kquant_matrices"] >= 2 * ref.args.n_layers + 1
        # its attention heads in every layer answered natively, q and k in Q4_K and v in Q6_K too
        assert info["cold.0"]["kv_heads"][1] > info["cold.0"]["kv_heads"][0]
        assert info["cold.0"]["native_attention"] == ref.args.n_layers and info["cold.0"]["native_head"]
        assert info["hot"]["native"]  # and the hot executor's own heads and slices in C++ too
        for batch in ([prompts[0]], prompts[1:]):
            for p, want, got in zip(batch, decode(ref, batch, 16), decode(pi, batch, 16)):
                assert_same_or_near_tie(ref, p, want, got, 0.25)  # bf16 sums in another order
    finally:
        pi.close()
    assert not shm_segments()


@pytest.fixture(scope="module")
def sparse_actors(ray_cluster, tiny, tiny_bundle):
    pi = PowerInfer.from_pretrained(tiny, Config(runtime="actors", cold_executors=2, max_queue=2,
                                                 bundle=tiny_bundle, **BASE))
    yield pi
    pi.close()
    assert not shm_segments()


@pytest.fixture(scope="module")
def sparse_alone(tiny, tiny_bundle) -> tuple[PowerInfer, list[list[int]]]:
    """The in-process engine of sparse_actors' configuration, and PROMPTS' greedy tokens from it,
    each request alone."""
    ref = PowerInfer.from_pretrained(tiny, Config(bundle=tiny_bundle, **BASE))
    return ref, [greedy_tokens(ref, p, GREEDY["max_new_tokens"]) for p in PROMPTS]


def concurrent_greedy(pi: PowerInfer, n: int, timeout: float) -> list[list[int]]:
    """PROMPTS' greedy tokens, the requests sent together (continuously batched), each thread
    waited for `timeout` seconds at most."""
    from powerinfer.engine.params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    got = [[] for _ in PROMPTS]

    def run(i):
        got[i] = [ev["token"] for ev in pi.engine.generate(pi.tokenize(PROMPTS[i]), params)
                  if ev["token"] >= 0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return got


def test_batched_concurrent_requests_equal_each_alone(sparse_alone, sparse_actors):
    # concurrent requests, continuously batched, against each alone in process: token for token
    # but for a near-tie. Which steps the requests share depends on when each arrives, and a
    # prompt prefilled beside another goes through matrix products of another height, which
    # round otherwise (float32; about one run in four parted on a near-tie before this rule).
    # The predictors' rule is a threshold: a neuron whose logit sits on it can be picked in one
    # run and not the other, and that moves the later logits by more than float32 rounding
    # would (one run in eleven parted with a margin of 0.22), hence the bf16 tests' 0.25
    ref, want = sparse_alone  # each request alone
    n = GREEDY["max_new_tokens"]
    e = sparse_actors.engine
    before = e.stats()["actors"]["scheduler"]
    got = concurrent_greedy(sparse_actors, n, timeout=120)
    for p, w, g in zip(PROMPTS, want, got):
        assert len(g) == n
        assert_same_or_near_tie(ref, ref.tokenize(p), w, g, 0.25)
    after = e.stats()["actors"]["scheduler"]
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    assert rows / steps > 1.5, (rows, steps)  # they really shared decode steps
    st = sparse_actors.engine.stats()["actors"]  # (2 cold executors; 4 above, 1 in the int4 groups)
    assert st["predictor"]["input"] == "layer" and \
        st["cold.0"]["neurons"] + st["cold.1"]["neurons"] + st["hot"]["hot_neurons"] == \
        n_neurons(ref)


@pytest.mark.slow
def test_decode_steps_in_the_gpus_segments_equal_the_modules(sparse_alone, sparse_actors):
    """The decode step as the GPU's CUDA graphs replay it (`actors.graphs`: segments between the
    host exchanges, inputs in tensors that stay put, block tables padded to a width bucket),
    launched op by op on the CPU: alone and batched, it decodes as the in-process engine does
    (the lookahead predictor's input published from the segments, the masks read in them)."""
    ref, want = sparse_alone
    n = GREEDY["max_new_tokens"]
    hot = sparse_actors.engine.group.actors["hot"]
    assert ray.get(hot.steps_in_segments.remote(True))
    try:
        alone = [greedy_tokens(sparse_actors, p, n) for p in PROMPTS]
        together = concurrent_greedy(sparse_actors, n, timeout=180)
        st = sparse_actors.engine.stats()["actors"]["hot"]["graphs"]
    finally:
        ray.get(hot.steps_in_segments.remote(False))
    for p, w, a, t in zip(PROMPTS, want, alone, together):
        assert len(a) == len(t) == n
        assert_same_or_near_tie(ref, ref.tokenize(p), w, a, 0.25)  # (see the test above)
        assert_same_or_near_tie(ref, ref.tokenize(p), w, t, 0.25)
    # every decode step ran the segments, none captured on a CPU; heights 1 and 2 or 3
    assert st["eager"] >= 2 * len(PROMPTS) * (n - 1) // 2 and st["fallback"] == 0, st
    assert st["replayed"] == 0 and st["captured"] == [] and st["off"] is None, st


def test_a_caller_on_the_schedulers_node_reads_its_events_from_a_token_ring(sparse_actors,
                                                                            monkeypatch):
    # the same requests through Ray's stream alone (a caller on another node) and through the
    # ring, whole and with a log too small for them: the same events, logprobs and all (to
    # float32 rounding: each request's steps may batch and sum otherwise); the scheduler
    # counted the ring's requests, and no segment is left behind
    import actors.follow as follow
    import actors.tokens as tokens
    from powerinfer.engine.params import SamplingParams

    e = sparse_actors.engine
    ids = sparse_actors.tokenize("Once upon a time")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)

    def counted(read, capacity):  # the events, and how many requests the ring carried
        monkeypatch.setattr(tokens, "CAPACITY", capacity or tokens.CAPACITY)
        before = e.stats()["actors"]["scheduler"]["ring_requests"]
        got = read()
        return got, e.stats()["actors"]["scheduler"]["ring_requests"] - before

    def events(capacity=None):
        return counted(lambda: list(e.generate(ids, params)), capacity)

    def async_events(capacity=None):  # the event loop's reader (the Serve ingress's)
        async def run():
            return [ev async for evs in e.agenerate(ids, params) for ev in evs]
        return counted(lambda: asyncio.run(run()), capacity)

    ring, n_ring = events()
    spilled, n_spilled = events(capacity=700)  # a few events: the rest over Ray
    async_ring, n_async = async_events()
    async_spilled, n_async_spilled = async_events(capacity=700)
    with monkeypatch.context() as m:
        m.setattr(follow, "_node", lambda: "another node")
        over_ray, n_ray = events()
    with monkeypatch.context() as m:  # POWERINFER_TOKEN_RING=0
        m.setattr(follow, "TOKEN_RING", False)
        asked_off, n_off = events()
    assert (n_ring, n_spilled, n_async, n_async_spilled, n_ray, n_off) == (1, 1, 1, 1, 0, 0)
    assert [ev["token"] for ev in asked_off] == [ev["token"] for ev in over_ray]
    assert len(over_ray) == 12 and over_ray[-1]["finish_reason"] == "length"
    assert all(len(ev["top_logprobs"]) == 5 for ev in over_ray)
    for got in (ring, spilled, async_ring, async_spilled):
        assert [(ev["token"], ev["text"], ev["finish_reason"]) for ev in got] == \
            [(ev["token"], ev["text"], ev["finish_reason"]) for ev in over_ray]
        for a, b in zip(got, over_ray):
            assert [t for t, _ in a["top_logprobs"]] == [t for t, _ in b["top_logprobs"]]
            lps = [torch.tensor([lp for _, lp in ev["top_logprobs"]] + [ev["logprob"]])
                   for ev in (a, b)]
            assert torch.allclose(*lps, atol=1e-3)
            assert all(isinstance(p, tuple) for p in a["top_logprobs"])
    assert not [s for s in shm_segments() if "-ring-" in s]


def test_tokens_read_with_the_groups_failure_reach_the_caller_before_it_resumes(monkeypatch):
    # a scheduler whose group fails reports it as an error event, which its ring's reader (or
    # Ray's stream) may join to the tokens it sampled just before, in one list: the caller gets
    # those tokens, and the request resumes after them on the next group, none lost or repeated.
    # (Lost, a stream came short by a token, and a greedy one's text without it, in the soak.)
    # Two schedulers by script, each a real actor writing the real ring or stream; the sync and
    # async readers (the engine handle's and the Serve ingress's), with and without the ring
    import actors.follow as follow
    from powerinfer.compat import ray_init
    from powerinfer.engine.params import SamplingParams

    @ray.remote(num_cpus=0)
    class Scripted:
        """Each call's events, as lists: through the caller's ring where it names one (its
        lists then as the reader finds them), else each list as one item of Ray's stream."""

        def __init__(self, lists):
            self.lists, self.resumed = lists, []

        async def generate(self, rid, prompt, params, resume=None, ring=None):
            from actors.tokens import TokenRing
            self.resumed.append(resume)
            out = TokenRing.open(ring) if ring else None
            for events in self.lists:
                if out is None:
                    yield events
                else:
                    for ev in events:
                        assert out.append(ev)

        async def cancel(self, rid):
            return False

        def calls(self):
            return self.resumed

    def tok(t, finish=None):
        return {"text": f"<{t}>", "token": t, "finish_reason": finish}

    failed = {"error": "engine_failed", "retryable": True,
              "message": "the model's actor group failed (an executor died); it is being rebuilt"}
    ray_init()
    first = Scripted.remote([[tok(1)], [tok(2), tok(3), failed]])
    second = Scripted.remote([[tok(4), tok(5, "length")]])
    node = ray.get_runtime_context().get_node_id()
    at = [{"scheduler": s, "id": s._actor_id.hex(), "node": node} for s in (first, second)]
    for reader in ("ring", "ray", "ring async", "ray async"):
        with monkeypatch.context() as m:
            if "ray" in reader:  # a caller on another node reads Ray's stream
                m.setattr(follow, "_node", lambda: "another node")
            f = follow.Flight("r", [7, 8], SamplingParams(max_tokens=5, temperature=0,
                                                          ignore_eos=True))
            asked = []

            def replace(failed_at, why):
                asked.append((failed_at["id"], why))
                return at[1]

            async def areplace(failed_at, why):
                return replace(failed_at, why)

            async def read():
                return [ev async for evs in follow.follow(f, at[0], areplace) for ev in evs]

            if "async" in reader:
                events = asyncio.run(read())
            else:
                events = [ev for evs in follow.follow_sync(f, at[0], replace) for ev in evs]
        assert [ev["token"] for ev in events] == [1, 2, 3, 4, 5], (reader, events)
        assert events[-1]["finish_reason"] == "length"
        assert f.sent == [1, 2, 3, 4, 5] and f.resumes == 1, reader
        assert asked == [(at[0]["id"], failed["message"])], reader
        assert ray.get(second.calls.remote())[-1] == [1, 2, 3], reader
    assert not [s for s in shm_segments() if "-ring-" in s]
    for s in (first, second):
        ray.kill(s)


def assert_it_answers_as_before(sparse_alone, pi: PowerInfer):
    """The group still serves: the first prompt's greedy tokens, as the in-process engine's."""
    ref, want = sparse_alone
    got = greedy_tokens(pi, PROMPTS[0], GREEDY["max_new_tokens"])
    assert_same_or_near_tie(ref, ref.tokenize(PROMPTS[0]), want[0], got, 0.25)


def test_the_scheduler_opens_no_file_but_a_token_ring(sparse_actors, sparse_alone):
    # a caller names the ring; anything else (another file, a path out of shared memory) ends
    # the request with an invalid_request error on the Ray stream, and the scheduler serves on
    from powerinfer.engine.params import SamplingParams

    scheduler = sparse_actors.engine.group.actors["scheduler"]
    params = SamplingParams(max_tokens=2, temperature=0)
    for name in ("/etc/hostname", "/dev/shm/../etc/hostname", "/dev/shm/powerinfer-1-ring-gone"):
        items = [ray.get(ref) for ref in scheduler.generate.remote("r", [1, 2], params, ring=name)]
        assert items[0][0]["error"] == "invalid_request" and "token ring" in items[0][0]["message"]
    assert_it_answers_as_before(sparse_alone, sparse_actors)


def test_overloaded_queue_and_cancellation(sparse_actors, sparse_alone):
    e = sparse_actors.engine
    ids = sparse_actors.tokenize("Tell me a long story")
    from powerinfer.engine.params import SamplingParams
    # as long as the context allows: on this small model they could otherwise end (and admit
    # the queued ones) before the request that finds the queue full is sent
    long = SamplingParams(max_tokens=BASE["max_seq_len"] - len(ids) - 1, temperature=0,
                          ignore_eos=True)
    streams = [e.generate(ids, long) for _ in range(4)]  # max_batch=4: they all run
    for s in streams:
        next(s)
    queued = [e.generate(ids, long) for _ in range(2)]  # max_queue=2
    threads = [threading.Thread(target=lambda s=s: next(s)) for s in queued]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while e.stats()["actors"]["scheduler"]["waiting"] < 2 and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(OverloadedError, match="overloaded"):
        next(e.generate(ids, long))
    for s in streams:  # cancel the running ones: the queued ones are admitted
        s.close()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    for s in queued:
        s.close()
    deadline = time.time() + 30
    while (st := e.stats()["actors"]["scheduler"])["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_free"] == st["kv_blocks"], st
    assert st["cancelled"] >= 6 and st["rejected"] >= 1
    assert_it_answers_as_before(sparse_alone, sparse_actors)  # and it keeps serving


def streamed_text(pi: PowerInfer, tokens: list[int]) -> str:
    from powerinfer.formats.tokenizer import StreamDecoder
    d = StreamDecoder(pi.tokenizer)
    return "".join(d.push(t) for t in tokens)


@pytest.fixture(scope="module")
def undisturbed() -> dict:
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("roles", [("cold.1", "hot"), ("predictor", "scheduler")])
def test_streams_survive_the_death_of_any_actor(sparse_actors, roles, undisturbed):
    # 6 streams (3 greedy, 3 sampled with seeds; 4 running, 2 waiting: max_batch 4) run while
    # an actor of the group is killed, and another once they have resumed on the new group:
    # none fails, each pauses while the group is rebuilt and resumes where it stopped (its
    # output computed again as the sparse model decoded it), and ends with the tokens the same
    # requests give undisturbed: token for token, but for a close call. In float32 a prompt's
    # keys round apart in a batch of other sizes, and the rebuilt group batches them otherwise;
    # a predictor reading residuals that far apart may choose a neuron near its threshold on
    # one side only, which moves the next logits by up to about 1 (see assert_same_greedy), and
    # greedy picks and seeded draws near a boundary fall the other way a few tokens later. So a
    # close call here is both tokens among both runs' most likely, within 1.0 of each other's
    # log-probabilities: a stream resumed from the wrong place or state parts at once and far
    from powerinfer.engine.params import SamplingParams

    pi, e = sparse_actors, sparse_actors.engine
    N = 80  # tokens a stream: still under way at the second kill, on this small model too
    prompts = [pi.tokenize(p) for p in ("Tell me a long story", "Once upon a time", "def f(x):")]
    params = [SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=20)] * 3 + \
             [SamplingParams(max_tokens=N, temperature=0.9, seed=11 + i, ignore_eos=True,
                             logprobs=20) for i in range(3)]
    work = list(zip(prompts * 2, params))
    running: list[int] = []

    def run(kills: tuple[str, ...]) -> tuple[list[list[dict]], list[str], list[Exception]]:
        got, texts, failures = [[] for _ in work], ["" for _ in work], []
        running.clear()

        def consume(i, p, sp):
            try:
                for ev in e.generate(p, sp):
                    texts[i] += ev["text"]
                    if ev["token"] >= 0:
                        got[i].append(ev)
            except Exception as ex:  # noqa: BLE001 - counted below
                failures.append(ex)

        threads = [threading.Thread(target=consume, args=(i, *w)) for i, w in enumerate(work)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while sum(len(g) >= 3 for g in got) < 4 and time.time() < deadline:  # 4 under way
            time.sleep(0.02)
        for k, role in enumerate(kills):
            if k:  # the next once the streams go on, on the group that replaced the last
                seen = sum(map(len, got))
                while (e.restarts < restarts + k or sum(map(len, got)) < seen + 4) and \
                        time.time() < deadline + 120:
                    time.sleep(0.02)
            running.append(sum(len(g) < N for g in got))  # streams the kill interrupts
            ray.kill(e.group.actors[role], no_restart=True)
        for t in threads:
            t.join(timeout=240)
            assert not t.is_alive()
        return got, texts, failures

    if "want" not in undisturbed:  # the same requests together, undisturbed (once: one group)
        undisturbed["want"] = run(())[0]
    want = undisturbed["want"]
    restarts = e.restarts
    got, texts, failures = run(roles)
    assert not failures, failures
    assert e.restarts == restarts + len(roles), e.last_failure
    assert len(running) == 2 and min(running) >= 2, running
    for w, g, text in zip(want, got, texts):
        # the text as one uninterrupted stream of these tokens gives it (this model's tokens
        # are often bytes that form no UTF-8, which a stream's decoder and a whole decode of
        # the same tokens replace otherwise)
        assert len(g) == N and text == streamed_text(pi, [ev["token"] for ev in g])
        assert_same_until_a_close_call(w, g, 1.0)
    assert e.health()["ok"]
    assert not shm_segments()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device: the hot executor's GPU path")
def test_hot_executor_on_gpu_keeps_the_vram_budget(ray_cluster, bundle, tmp_path):
    """On a GPU the hot executor holds attention, the KV cache, embeddings, lm_head and the
    solver's hot neurons, and its measured peak device memory stays within the budget."""
    import shutil

    from powerinfer.formats.bundle import Bundle
    from powerinfer.sparsity.solver import solve_bundle
    copy = shutil.copytree(bundle, tmp_path / "bundle")  # its own placement, bf16 sizes
    budget_gb = 0.25
    solve_bundle(Bundle.open(copy), budget_gb, batch=BASE["max_batch"] + 1,
                 context=BASE["max_seq_len"], dtype_bytes=2, predictor_input="layer")
    cfg = dict(BASE, bundle=str(copy), dtype="bfloat16")
    cpu = local(Config(**cfg))
    pi = PowerInfer.from_pretrained(MODEL, Config(runtime="actors", cold_executors=2,
                                                  device="cuda", **cfg))
    try:
        got = [pi.generate(p, **GREEDY) for p in PROMPTS]
        hot = pi.engine.stats()["actors"]["hot"]
    finally:
        pi.close()
    assert hot["device"].startswith("cuda"), hot
    # the placement's bytes within the budget; the peak adds activations and workspaces
    assert 0 < hot["held_bytes"] <= budget_gb * 2**30, hot
    assert hot["device_peak_bytes"] - hot["held_bytes"] < 64 << 20, hot
    # the same model and masks; the GPU sums in another order, so compare the first words only
    assert [g.split()[:2] for g in got] == [w.split()[:2] for w in cpu]
    assert not shm_segments()


def test_vram_budget_plans_the_placement_and_caches_it(bundle, default_model_path, tmp_path,
                                                       caplog):
    """Config(vram_budget_gb=...) at load: with a bundle (here found beside a copy of the model
    file) the placement is solved for the budget and kept in the bundle; the second load reads
    it; without a bundle, whole FFN layers are placed as they fit. No GPU here: it says so."""
    import logging
    import shutil

    from powerinfer.engine.budget import ffn_layers_that_fit
    from powerinfer.sparsity.solver import gpu_bytes

    model = tmp_path / default_model_path.name
    shutil.copy(default_model_path, model)
    shutil.copytree(bundle, str(model) + ".bundle")
    cfg = dict(BASE, vram_budget_gb=0.4)
    lines = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="powerinfer"):
            pi = PowerInfer.from_pretrained(str(model), Config(**cfg))
        lines += [r.getMessage() for r in caplog.records if "VRAM budget" in r.getMessage()]
    assert len(lines) == 2 and "solved" in lines[0] and "read from the cache" in lines[1], lines
    assert "no GPU" in lines[0]
    cached = list((Path(str(model) + ".bundle") / "placements").glob("*.json"))
    # the KV cache it counts: the pool's positions (auto: max_batch x the context)
    from powerinfer.engine.kv import pool_blocks
    pool = pool_blocks(pi.args, Config(**cfg), 256, 4, gpu=True)[0] * 16  # (a GPU's pool)
    assert len(cached) == 1 and f"0.4GB-ctx{pool}-batch1" in cached[0].name
    report = __import__("json").loads(cached[0].read_text())
    assert 0 < report["used_bytes"] <= 0.4 * 2**30
    share = sum(report["hot_counts"]) / (30 * 1536)
    assert 0 < share < 1 and f"{100 * share:.1f}% of FFN neurons hot" in lines[1]  # the cached placement
    # one line says what went where: neurons hot, the predicted activation mass they carry, and
    # the GPU's MiB by part against the budget, the same from the cache as when solved
    assert lines[0].split("; placement")[0] == lines[1].split("; placement")[0], lines
    assert f"({sum(report['hot_counts']):,} of {30 * 1536:,}, float32)" in lines[1]
    assert f"{100 * report['share']:.1f}% of the predicted activation mass on the GPU" in lines[1]
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    assert f"attention {mib(report['fixed_bytes']['attention'])}" in lines[1]
    assert f"hot neurons {mib(report['hot_neuron_bytes'])}; {mib(report['used_bytes'])} of " \
        f"{mib(0.4 * 2**30)}" in lines[1]
    # (in one process every neuron sits where the model does: each layer's in one set, whatever
    # the placement, which splits them between a GPU and the host in the actor runtime)
    from powerinfer.model.sparse import hybrid_layers
    assert all(not len(f.hot.idx) and len(f.cold.idx) == 1536 for f in hybrid_layers(pi.model))
    assert "Paris" in pi.generate("The capital of France is", max_new_tokens=8, temperature=0)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="powerinfer"):  # no bundle: layer offload
        PowerInfer.from_pretrained(MODEL, Config(**cfg))
    line, = [r.getMessage() for r in caplog.records if "VRAM budget" in r.getMessage()]
    args = pi.args
    k = ffn_layers_that_fit(args, int(0.4 * 2**30), 4, 1, pool)
    fixed = sum(gpu_bytes(args, dtype_bytes=4, batch=1, context=pool).values())
    assert 0 < k < args.n_layers and fixed + k * 3 * args.dim * args.ffn_dim * 4 <= 0.4 * 2**30
    assert f"layer offload, attention, embeddings, lm_head and {k} of 30 FFN layers" in line
    ffn = k * 3 * args.dim * args.ffn_dim * 4
    assert f"FFN layers {ffn / 2**20:,.1f}; {(fixed + ffn) / 2**20:,.1f} of" in line, line


def test_a_gpus_placement_counts_the_files_4bit_records_with_int4(bundle, default_model_path,
                                                                   tmp_path, monkeypatch):
    """Config(weights="int4") with the hot executor on a GPU: the placement counts each hot
    neuron at the bytes of the file's Q4_1 record that the Triton kernels read (under half of
    bf16's) and attention at its blocks' bytes, is cached under a key of its own, and holds more
    neurons and more of the activation mass in the same budget; with the hot executor on the
    CPU it is the model type's, as before. On a GPU where the Triton kernels run, both count the
    predictors at their Q8_0 rows (`predictor.device_format`; the CPU's at the model's type)."""
    import json
    import shutil

    from powerinfer.engine import budget
    from powerinfer.engine.budget import plan_for
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.engine.partial import device_fixed_bytes
    from powerinfer.model import predictor as P
    from powerinfer.sparsity.solver import gpu_bytes, neuron_bytes

    b = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    ck = load_checkpoint(default_model_path, with_weights=False)
    # (a GPU whose Triton kernels run: whatever this machine has)
    monkeypatch.setattr(budget, "device_format", lambda d: "q8_0" if str(d) == "cuda" else None)
    hot = {}
    for weights, on_gpu in (("dense", True), ("int4", True), ("int4", False), ("dense", False)):
        cfg = Config(**dict(BASE, dtype="bfloat16", weights=weights, bundle=str(b),
                            vram_budget_gb=0.13))
        plan = plan_for(cfg, ck.args, ck.path, 256, on_gpu, ck)
        hot[weights, on_gpu] = [h.copy() for h in plan.hot]
    reports = {p.name: json.loads(p.read_text()) for p in (b / "placements").glob("*.json")}
    assert len(reports) == 3, sorted(reports)  # int4 on the CPU reused the model type's
    cpu = reports.pop("0.13GB-ctx256-batch1-2B-layer.json")
    (wide_name, wide), = [(k, v) for k, v in reports.items() if "-q4_1" not in k]
    assert wide_name == "0.13GB-ctx256-batch1-2B-layer-predictors_q8_0.json"
    ranks = [r["rank"] for r in json.loads((b / "predictors.layer.json").read_text())]
    a = ck.args
    assert wide["fixed_bytes"]["predictors"] == P.held_bytes(ranks, a.dim, a.ffn_dim, 2, "q8_0") \
        < cpu["fixed_bytes"]["predictors"] == P.held_bytes(ranks, a.dim, a.ffn_dim, 2)
    assert sum(wide["hot_counts"]) > sum(cpu["hot_counts"])  # (the bytes they gave back)
    fixed = device_fixed_bytes(ck.source, ck.args, 2)  # (tied: no head or embedding of its own)
    attention = fixed["attention"]
    assert set(fixed) == {"attention"} and ck.args.tie_embeddings
    blocks = reports[wide_name[:-len(".json")].replace(
        "-predictors_q8_0", f"-q4_1-predictors_q8_0-attention{attention}.json")]
    assert wide["fixed_bytes"]["attention"] == gpu_bytes(ck.args)["attention"]
    # (q, k, v and o in Q4_1: 20 bytes a block of 32 weights, against 64 in bf16)
    assert blocks["fixed_bytes"]["attention"] == attention == wide["fixed_bytes"]["attention"] * 20 // 64
    assert wide["neuron_bytes"] == neuron_bytes(ck.args, 2) == 3 * 576 * 2
    assert blocks["neuron_bytes"] == neuron_bytes(ck.args, 2, "q4_1") < wide["neuron_bytes"] / 2
    for r in (wide, blocks):
        assert r["used_bytes"] <= 0.13 * 2**30 and r["status"] != "all fit", r
    assert sum(blocks["hot_counts"]) > 2 * sum(wide["hot_counts"]) > 0
    assert blocks["share"] > wide["share"]
    assert [h.sum() for h in hot["int4", True]] == blocks["hot_counts"]
    assert all((x == y).all() for x, y in zip(hot["dense", False], hot["int4", False]))


def test_a_bundle_that_costs_quality_warns_at_load(tiny, tiny_bundle, tmp_path, caplog):
    # (the warning's mechanism, on the small synthetic model's bundle; the real model's
    # figures are the pipeline's own tests')
    import logging
    import shutil

    from powerinfer.formats.bundle import Bundle
    from powerinfer.sparsity.evaluate import evaluate
    from powerinfer.engine.plan import check_quality

    b = Bundle.open(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    with caplog.at_level(logging.WARNING, logger="powerinfer"):
        PowerInfer.from_pretrained(tiny, Config(bundle=str(b.path), **BASE))
    assert "never evaluated" in caplog.text and "powerinfer eval" in caplog.text
    with all_threads():
        rows = evaluate(tiny, b, tokens=128, progress=False)  # recorded in the bundle
    delta = next(r["ppl_delta"] for r in rows if r["label"] == "predicted (layer input)")
    line = check_quality(b, "layer", max(delta - 0.001, 0))
    assert line and f"{delta:+.1%}" in line and "--tokens" in line
    assert check_quality(b, "layer", delta + 0.001) is None


def test_a_bundle_whose_predictors_pick_most_neurons_warns_at_load(bundle, tmp_path, caplog):
    # SmolLM2's predictors pick most of a layer's neurons (its FFN is narrow and SwiGLU with
    # calibrated thresholds): loading says so, with the share from their training record; a
    # bundle whose predictors pick few does not warn
    import json
    import logging
    import shutil

    from powerinfer.formats.bundle import Bundle
    from powerinfer.engine.plan import MOSTLY_DENSE, check_share

    b = Bundle.open(shutil.copytree(bundle, tmp_path / "bundle"))
    rows = b.load_json("predictors.ffn.json")
    share = sum(r["active_share"] for r in rows) / len(rows)
    assert share > MOSTLY_DENSE
    with caplog.at_level(logging.WARNING, logger="powerinfer"):
        PowerInfer.from_pretrained(MODEL, Config(bundle=str(b.path), predictor="ffn", **BASE))
    assert f"pick {share:.0%} of the FFN neurons" in caplog.text and "without the bundle" in caplog.text
    for r in rows:
        r["active_share"] = 0.1
    (b.path / "predictors.ffn.json").write_text(json.dumps(rows))
    assert check_share(b, "ffn") == (None, pytest.approx(0.1))
