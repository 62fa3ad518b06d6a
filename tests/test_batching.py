"""The batching core both runtimes run (schedule, run, postprocess), as bookkeeping alone: no
model, logits made up to steer the sampler."""
import pytest
import numpy as np
import torch

from powerinfer.engine.batching import Batcher, new_sequence
from powerinfer.engine.params import SamplingParams
from powerinfer.engine.kv import BlockManager, Blocks
from powerinfer.formats.loader import load_checkpoint
from powerinfer.formats.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_path):
    return Tokenizer.from_source(load_checkpoint(default_model_path, with_weights=False).tokenizer_source)


def seq(tok, prompt, max_seq=256, **kw):
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw})
    return new_sequence(prompt, params, tok, tok.vocab_size, max_seq)


def greedy(step, token: int):
    logits = torch.zeros(len(step.sampled), 49152)
    logits[:, token] = 10.0
    return logits


def batcher(blocks=64, max_batch=8, max_seq=256, chunk=0, caching=True):
    return Batcher(BlockManager(blocks, 16, caching), max_batch, max_seq, chunk)


def test_a_probe_is_admitted_over_max_batch_and_counted_apart(tok):
    # a health probe (a block its owner reserved outside the pool) runs beside max_batch
    # requests, is not a request in the counts, and never makes a request wait or be refused
    b = batcher(blocks=7, max_batch=1)  # the probe's block 7 outside the pool
    r1, r2, probe = seq(tok, [1, 2, 3]), seq(tok, [4, 5]), seq(tok, [6])
    probe.blocks = Blocks([7], reserved=True)
    b.add(r1)
    b.add(r2)
    b.add(probe, front=True)
    assert (b.running_requests, b.waiting_requests, b.probes, b.queued) == (0, 2, 1, 1)
    step = b.schedule()
    assert step.seqs == [probe, r1]  # the probe over max_batch, r2 waits
    assert (b.running_requests, b.waiting_requests, b.probes, b.queued) == (1, 1, 1, 1)
    b.remove(r1)
    assert b.queued == 0  # r2 is next, whatever the probe does
    step = b.schedule()
    assert r2 in step.seqs and (b.running_requests, b.probes) == (1, 1)


def test_admission_by_max_batch_then_decode_steps(tok):
    b = batcher(max_batch=2)
    a, c, d = seq(tok, [1, 2, 3]), seq(tok, [4, 5]), seq(tok, [6])
    for s in (a, c, d):
        b.add(s)
    assert b.queued == 1  # two of three run at the next step
    step = b.schedule()
    assert not step.decode and step.seqs == [a, c] and step.counts == [3, 2]
    assert step.tokens.tolist() == [[1, 2, 3, 4, 5]] and step.positions.tolist() == [[0, 1, 2, 0, 1]]
    assert step.starts.tolist() == [0, 3, 5] and step.last.tolist() == [2, 4]
    assert step.sampled == [a, c]
    assert a.blocks.table != c.blocks.table and step.tables.dtype == np.int32
    outs = b.postprocess(step, greedy(step, 42))
    assert [(o.token, o.first) for o in outs] == [(42, True), (42, True)]
    step = b.schedule()  # d waits: max_batch runs; one decode step over the two
    assert step.decode and step.positions.tolist() == [[3], [2]] and step.tokens.tolist() == [[42], [42]]
    b.postprocess(step, greedy(step, 7))
    b.remove(a)  # cancelled: its blocks go back, and d is admitted beside c's decode row
    step = b.schedule()
    assert step.seqs == [c, d] and step.counts == [1, 1] and step.sampled == [c, d]


def test_chunked_prefill_shares_steps_with_decoding(tok):
    b = batcher(chunk=16)
    short = seq(tok, [5, 6], max_tokens=20)
    b.add(short)
    b.postprocess(s := b.schedule(), greedy(s, 9))
    long = seq(tok, list(range(100, 150)))  # 50 tokens: chunks of 16, 16, 16, 2
    b.add(long)
    counts = []
    while not long.output:
        step = b.schedule()
        assert step.seqs[0] is short and step.counts[0] == 1  # the stream keeps decoding
        counts.append(step.counts[1])
        assert (long in step.sampled) == (long.computed + step.counts[1] == 50)
        b.postprocess(step, greedy(step, 9))
    assert counts == [16, 16, 16, 2] and len(short.output) == 5


def test_a_cached_prefix_is_not_computed_again(tok):
    b = batcher()
    system = list(range(200, 240))  # 40 tokens: two full blocks to share
    first = seq(tok, system + [1, 2, 3], max_tokens=1)
    b.add(first)
    while not first.finished:
        b.postprocess(s := b.schedule(), greedy(s, 9))
    second = seq(tok, system + [4, 5], max_tokens=1)
    b.add(second)
    step = b.schedule()
    assert second.cached == 32 and step.counts == [42 - 32]
    assert step.positions[0, 0].item() == 32
    assert b.blocks.hits == 32
    off = batcher(caching=False)
    third = seq(tok, system + [4, 5], max_tokens=1)
    off.add(third)
    assert off.schedule().counts == [42] and third.cached == 0


def test_a_full_pool_preempts_the_newest_and_it_comes_back(tok):
    b = batcher(blocks=6)  # 96 positions (one kept free: the watermark)
    old = seq(tok, list(range(1, 33)), max_tokens=40)  # 2 blocks, grows to 5
    new = seq(tok, list(range(50, 80)), max_tokens=40)  # 2 blocks
    b.add(old)
    b.add(new)
    texts = {old: [], new: []}
    preempted_at = None
    while not (old.finished and new.finished):
        step = b.schedule()
        outs = b.postprocess(step, greedy(step, 9))
        for o in outs:
            texts[o.seq].append(o.token)
        if b.preemptions and preempted_at is None:
            preempted_at = len(new.output)
            assert new in b.waiting and not new.blocks.table and new.computed == 0
    assert preempted_at is not None and b.preemptions >= 1
    # nobody failed: both ran to their max_tokens, the preempted one prefilled again
    assert len(old.output) == 40 and len(new.output) == 40
    assert all(t == 9 for t in texts[old] + texts[new])
    assert b.idle and b.blocks.available == 6


def test_reserved_blocks_stay_reserved_and_stop_rules_finish(tok):
    b = batcher(blocks=8, max_batch=1, max_seq=6)
    probe = seq(tok, [1], max_tokens=1)
    probe.blocks = Blocks([8], reserved=True)  # the caller's own block (the health probe's)
    long = seq(tok, [1, 2, 3, 4], max_tokens=50, max_seq=6)
    b.add(long)
    b.add(probe, front=True)
    step = b.schedule()  # the probe is admitted over max_batch
    assert step.seqs == [probe, long] and step.tables[0, 0].item() == 8
    b.postprocess(step, greedy(step, 7))
    assert probe.finish_reason == "length" and 8 not in b.blocks.free
    while not long.finished:
        step = b.schedule()
        outs = b.postprocess(step, greedy(step, 7))
    # the context holds 6 positions: the last token sampled ends it without a cache position
    assert outs[-1].token == -1 and outs[-1].finish_reason == "length" and long.num_tokens == 7
    assert b.idle and b.blocks.available == 8


def test_a_broken_distribution_fails_only_its_own_row(tok):
    b = batcher()
    ok, bad = seq(tok, [1]), seq(tok, [2], temperature=1.0, top_k=0)
    b.add(ok)
    b.add(bad)
    step = b.schedule()
    logits = greedy(step, 5)
    logits[1] = float("nan")
    outs = b.postprocess(step, logits)
    assert outs[0].token == 5 and outs[0].error is None
    assert outs[1].error and "sampling failed" in outs[1].error and bad.finish_reason == "error"
    assert b.running == [ok] and not bad.blocks.table


def test_a_sequence_resumes_from_its_tokens(tok):
    # a request replayed after its group failed: the tokens it had sampled are recorded (not
    # sampled again), its stop rules hold the same text back, and its prefill covers them all
    prompt = tok.encode("Hello there")
    whole = seq(tok, prompt, max_tokens=6, stop=["lo w"])
    resumed = seq(tok, prompt, max_tokens=6, stop=["lo w"])
    out = [tok.encode(" hello wor")[i] for i in range(2)]
    texts = [whole.push(t) for t in out]
    assert resumed.replay(out) == "".join(texts) and resumed.pending == whole.pending
    b = batcher()
    b.add(resumed)
    step = b.schedule()
    assert step.counts == [len(prompt) + 2] and step.sampled == [resumed]


def test_a_sparse_model_computes_output_again_as_decode_rows(tok):
    # a sparse model decodes its output with predicted neurons and prefills prompts with every
    # neuron: a sequence computed again prefills its prompt, then catches up on its output one
    # decode row a step (not sampled until it has), and only its prompt's blocks are reused
    b = Batcher(BlockManager(64, 16), 8, 256, 0, sparse=True)
    prompt = list(range(300, 340))  # 40 tokens
    s = seq(tok, prompt, max_tokens=30)
    s.replay([7, 8, 9])  # resumed after 3 tokens
    b.add(s)
    step = b.schedule()
    assert step.counts == [40] and step.sampled == []
    b.postprocess(step, greedy(step, 5))
    for k in range(3):
        step = b.schedule()
        assert step.counts == [1] and step.positions.tolist() == [[40 + k]]
        assert step.sampled == ([s] if k == 2 else [])
        b.postprocess(step, greedy(step, 5))
    assert s.output == [7, 8, 9, 5] and len(s.blocks.keys) == 2  # 32 prompt positions keyed
    while not s.finished:
        b.postprocess(step := b.schedule(), greedy(step, 5))
    assert len(b.blocks.by_key) == 2  # its output's blocks were not keyed


def test_a_sparse_models_prompt_chunks_are_never_one_token(tok):
    # a prompt token alone in its step would run as a decode row (its predicted neurons), where
    # among others it runs every neuron: neither a chunk nor a cached prefix leaves a sparse
    # model's prompt one token to compute (a dense model's may: its rows are the same either way)
    for sparse in (True, False):
        b = Batcher(BlockManager(64, 16), 8, 256, 16, sparse=sparse)
        s = seq(tok, list(range(300, 317)))  # 17 tokens, chunks of 16
        b.add(s)
        got = []
        while s.computed < len(s.prompt):
            got.append((step := b.schedule()).counts)
            b.postprocess(step, greedy(step, 5))
        assert got == ([[17]] if sparse else [[16], [1]]), got
        # a second prompt whose first 16 tokens are cached: the sparse model gives a block back
        b.remove(s)
        t = seq(tok, list(range(300, 317)))
        b.add(t)
        assert b.schedule().counts == ([17] if sparse else [1]), sparse
    b = Batcher(BlockManager(64, 16), 8, 256, 1, sparse=True)  # chunks of one token asked for
    s = seq(tok, [1, 2, 3, 4, 5])
    b.add(s)
    counts = []
    while s.computed < len(s.prompt):
        counts += (step := b.schedule()).counts
        b.postprocess(step, greedy(step, 5))
    assert counts == [2, 3], counts
    # a one-token prompt computed again (resumed after two tokens): its prompt is one token,
    # then its output comes back as decode rows, not as a chunk of two
    b = Batcher(BlockManager(64, 16), 8, 256, 1, sparse=True)
    s = seq(tok, [5])
    s.replay([7, 8])
    b.add(s)
    assert b.schedule().counts == [1]


def test_paced_chunks_keep_a_step_near_a_decode_step(tok):
    # the runner's times: a decode step 30 ms, a prompt token 2 ms beyond it; pace 3 allows a
    # step of 90 ms beside decoding streams, 30 prompt tokens, raised to the 32 a step makes
    # at least; with nothing decoding a chunk is whole again
    b = Batcher(BlockManager(256, 16, True), 8, 2048, 512, pace=3.0)
    alone = seq(tok, list(range(100, 1100)), max_seq=2048, max_tokens=2)
    b.add(alone)
    step = b.schedule()
    assert step.counts == [512]  # nothing timed yet, nothing decoding: a whole chunk
    b.observe(step, 512 * 0.002)
    b.postprocess(step, greedy(step, 9))
    assert b.schedule().counts == [488]  # nobody decodes: the rest of the prompt at once
    b.remove(alone)
    short = seq(tok, [5, 6], max_tokens=50)
    b.add(short)
    b.postprocess(s := b.schedule(), greedy(s, 9))
    step = b.schedule()
    assert step.decode
    b.observe(step, 0.030)
    b.postprocess(step, greedy(step, 9))
    assert b.token_s == pytest.approx(0.002) and b.decode_s == pytest.approx(0.030)
    long = seq(tok, list(range(2000, 2400)), max_seq=2048)
    b.add(long)
    step = b.schedule()
    assert step.seqs == [short, long] and step.counts == [1, 32]
    b.observe(step, 0.030 + 32 * 0.001)  # prompt tokens came cheaper: bigger chunks follow
    b.postprocess(step, greedy(step, 9))
    assert b.schedule().counts == [1, int(2 * 0.030 / (0.002 + 0.2 * (0.001 - 0.002)))]
    unpaced = Batcher(BlockManager(256, 16, True), 8, 2048, 512, pace=0.0)
    unpaced.decode_s, unpaced.token_s = 0.030, 0.002
    a, c = seq(tok, [5, 6], max_tokens=50), seq(tok, list(range(3000, 3600)), max_seq=2048)
    unpaced.add(a)
    unpaced.postprocess(s := unpaced.schedule(), greedy(s, 9))
    unpaced.add(c)
    assert unpaced.schedule().counts == [1, 512]


def test_stop_strings_are_found_in_pieces_as_a_search_of_the_whole_text_finds_them(tok):
    # StopMatcher (each character looked at once a string) against the search it replaced:
    # random texts over a small alphabet, fed in random pieces, with overlapping stop strings;
    # the first string to end ends the text where it starts, and what is held back is the
    # longest end of the text that begins a string
    import random

    from powerinfer.engine.batching import StopMatcher

    def search(text, stops):
        for j in range(len(text)):
            for s in stops:
                if text[:j + 1].endswith(s):
                    return j + 1 - len(s), 0
        hold = max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])),
                   default=0)
        return None, hold

    rng = random.Random(0)
    for _ in range(400):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                      for _ in range(rng.randint(1, 3)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        m, seen, got = StopMatcher(stops), 0, None
        while seen < len(text) and got is None:
            n = rng.randint(1, 4)
            at = m.feed(text[seen:seen + n])
            if at is not None:
                got = min(seen + n, len(text)) - at
            seen += n
        start, hold = search(text, stops)
        assert got == start, (stops, text)
        if start is None:
            assert m.held == hold, (stops, text)
    # a sequence's text: a stop string of 1,024 characters costs a token little (its prefixes
    # were each tried against the held text, the square of its length a token)
    s = seq(tok, [1], max_tokens=64, stop=["lo" * 512])
    ids = tok.encode(" hello world" * 20 + " hello", add_bos=False)
    text = "".join(s.push(t) for t in ids)
    assert text + s.pending == tok.decode(ids) and s.pending == "lo" and not s.finished


@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_a_tokens_bytes_are_its_part_of_a_character(family, default_model_path, request):
    # OpenAI's logprobs carry each token's bytes so that a client can join the tokens of a
    # character that takes several (SmolLM2 writes an emoji as three byte-level pieces, each
    # decoded alone as U+FFFD, whose UTF-8 the bytes had been); Gemma 3's pieces carry a space
    # as U+2581 and its byte pieces as <0xNN>
    path = default_model_path if family == "smollm2" else request.getfixturevalue(
        "gemma_model_path")
    tok = Tokenizer.from_source(load_checkpoint(path, with_weights=False).tokenizer_source)
    text = "Hi \U0001F31F caf\u00e9\n<end> \u4e2d\u6587"
    ids = tok.encode(text, add_bos=False)
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts).decode() == text
    if family == "smollm2":
        assert any(tok.decode([i]) == "\ufffd" and p and p != "\ufffd".encode()
                   for i, p in zip(ids, parts))
    eos = tok.eos_id  # a control token: its text
    assert tok.token_bytes(eos) == tok.token_text(eos).encode()
