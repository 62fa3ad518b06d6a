"""The batching core both runtimes run (schedule, run, postprocess), as bookkeeping alone: no
model, logits made up to steer the sampler."""
import pytest
import torch

from powerinfer.batching import Batcher, new_sequence
from powerinfer.config import SamplingParams
from powerinfer.loader import load_checkpoint
from powerinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_path):
    return Tokenizer.from_source(load_checkpoint(default_model_path, with_weights=False).tokenizer_source)


def seq(tok, prompt, max_seq=64, **kw):
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw})
    return new_sequence(prompt, params, tok, tok.vocab_size, max_seq)


def greedy(step, token: int):
    logits = torch.zeros(len(step.seqs), 49152)
    logits[:, token] = 10.0
    return logits


def test_prefill_then_decode_with_slots_and_continuous_admission(tok):
    b = Batcher(max_batch=2, max_seq=64)
    a, c, d = seq(tok, [1, 2, 3]), seq(tok, [4, 5]), seq(tok, [6])
    for s in (a, c, d):
        b.add(s)
    assert b.queued == 1  # two of three get a slot at the next step
    step = b.schedule()
    assert step.prefill and step.seqs == [a, c] and step.slots.tolist() == [0, 1]
    assert step.tokens.tolist() == [[1, 2, 3], [4, 5, 0]] and step.last.tolist() == [2, 1]
    outs = b.postprocess(step, greedy(step, 42))
    assert [(o.token, o.first) for o in outs] == [(42, True), (42, True)]
    step = b.schedule()  # d waits: no slot free, so one decode step over the running two
    assert not step.prefill and step.positions.tolist() == [[3], [2]] and step.kv_len == 4
    b.remove(a)  # cancelled: its slot goes to the waiting one at the next step
    step = b.schedule()
    assert step.prefill and step.seqs == [d] and step.slots.tolist() == [0]


def test_reserved_slots_stay_reserved_and_stop_rules_finish(tok):
    b = Batcher(max_batch=1, max_seq=6)
    probe = seq(tok, [1], max_tokens=1)
    probe.slot = 1  # the caller's reserved slot (the actor runtime's health probe)
    long = seq(tok, [1, 2, 3, 4], max_tokens=50)
    b.add(long)
    b.add(probe, front=True)
    step = b.schedule()
    assert step.seqs == [probe, long] and step.slots.tolist() == [1, 0]
    outs = b.postprocess(step, greedy(step, 7))
    assert probe.finish_reason == "length" and b.free == []  # the reserved slot is not handed out
    while not long.finished:
        step = b.schedule()
        outs = b.postprocess(step, greedy(step, 7))
    # the context holds 6 positions: the last token sampled ends it without a cache row
    assert outs[-1].token == -1 and outs[-1].finish_reason == "length" and long.num_tokens == 7
    assert b.idle and b.free == [0]


def test_a_broken_distribution_fails_only_its_own_row(tok):
    b = Batcher(max_batch=2, max_seq=64)
    ok, bad = seq(tok, [1]), seq(tok, [2], temperature=1.0, top_k=0)
    b.add(ok)
    b.add(bad)
    step = b.schedule()
    logits = greedy(step, 5)
    logits[1] = float("nan")
    outs = b.postprocess(step, logits)
    assert outs[0].token == 5 and outs[0].error is None
    assert outs[1].error and "sampling failed" in outs[1].error and bad.finish_reason == "error"
    assert b.running == [ok] and b.free == [1]
