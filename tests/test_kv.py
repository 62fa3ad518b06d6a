"""The paged KV cache's bookkeeping (`powerinfer.kv`) under random admissions, growth,
preemptions, finishes and evictions: blocks are never lost, never shared wrongly, and a reused
block holds the tokens its new holder expects. Plain Python: no model."""
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from powerinfer.engine.kv import BlockManager, Blocks, block_key, pool_blocks

BS = 16


class Seq:
    """A sequence as the batching core drives one: its tokens, and how many are computed."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.blocks, self.computed = tokens, Blocks(), 0


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(24, BS)
        self.running: list[Seq] = []
        self.written: dict[int, list[int]] = {}  # block -> the tokens its positions hold

    @rule(prefix=st.sampled_from([[], [1] * 16, [1] * 16 + [2] * 16, [3] * 40]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=40))
    def admit(self, prefix, tail):
        # prompts sharing prefixes (a system prompt), each prefilled whole if it fits
        s = Seq(prefix + tail)
        hit = self.bm.match(s.tokens)
        for i, b in enumerate(hit):  # a reused block holds exactly these tokens
            assert self.written[b] == s.tokens[i * BS:(i + 1) * BS]
        if not self.bm.can_admit(hit, len(s.tokens)):
            return
        s.computed = self.bm.admit(s.blocks, hit, s.tokens, first=True)
        assert s.computed == len(hit) * BS < len(s.tokens)
        assert self.bm.grow(s.blocks, len(s.tokens))
        self._compute(s, len(s.tokens))
        self.running.append(s)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), n=st.integers(1, 20), token=st.integers(0, 3))
    def decode(self, i, n, token):
        # n more tokens; preempt the newest until they fit (as the batching core does)
        s = self.running[i % len(self.running)]
        s.tokens = s.tokens + [token] * n
        while not self.bm.grow(s.blocks, len(s.tokens)):
            victim = self.running[-1]
            self._release(victim)
            if victim is s:
                return
        self._compute(s, len(s.tokens))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self._release(self.running[i % len(self.running)])

    @rule()
    def drop_cache(self):
        self.bm.reset_cache()

    def _compute(self, s: Seq, upto: int):
        for p in range(s.computed, upto):  # the positions this sequence writes
            b = s.blocks.table[p // BS]
            assert self.bm.refs[b] == 1, "a sequence writes into a block another holds"
            self.written.setdefault(b, [None] * BS)[p % BS] = s.tokens[p]
        s.computed = upto
        self.bm.commit(s.blocks, s.tokens, s.computed)

    def _release(self, s: Seq):
        self.bm.release(s.blocks)
        self.running.remove(s)

    @invariant()
    def every_block_is_held_cached_or_free_once(self):
        bm = self.bm
        held = [b for s in self.running for b in s.blocks.table]
        counts = {b: held.count(b) for b in set(held)}
        assert all(bm.refs[b] == counts.get(b, 0) for b in range(bm.num_blocks))
        for s in self.running:
            assert len(set(s.blocks.table)) == len(s.blocks.table)
        idle, free = set(bm.idle), set(bm.free)
        assert len(free) == len(bm.free) and not idle & free and not idle & counts.keys()
        assert not free & counts.keys() and len(idle) + len(free) + len(counts) == bm.num_blocks
        assert bm.available == len(idle) + len(free)

    @invariant()
    def keys_name_the_tokens_they_hold(self):
        bm = self.bm
        for key, b in bm.by_key.items():
            assert bm.key_of[b] == key and b not in bm.free
        for s in self.running:  # a sequence's keyed blocks: its own tokens, chained
            parent = b""
            for i, key in enumerate(s.blocks.keys):
                parent = block_key(parent, s.tokens[i * BS:(i + 1) * BS])
                assert key == parent
                b = s.blocks.table[i]
                assert self.written[b] == s.tokens[i * BS:(i + 1) * BS]


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPool = PoolMachine.TestCase


def test_a_shared_prefix_is_reused_and_the_last_token_always_computed():
    bm = BlockManager(10, BS)
    first = Blocks()
    prompt = list(range(40))  # two full blocks and 8 positions
    assert bm.match(prompt) == []
    bm.admit(first, [], prompt, first=True)
    bm.grow(first, 40)
    bm.commit(first, prompt, 40)
    assert len(first.keys) == 2
    bm.release(first)  # its full blocks stay cached, the partial one is free
    assert len(bm.idle) == 2 and bm.available == 10
    hit = bm.match(prompt + [99])
    assert len(hit) == 2
    again = Blocks()
    assert bm.admit(again, hit, prompt + [99], first=True) == 32
    assert bm.hits == 32 and bm.queries == 40 + 41
    # a prompt of exactly two blocks reuses one: its last token must be computed for its logits
    assert len(bm.match(prompt[:32])) == 1
    # a different token in the first block: nothing in common
    assert bm.match([7] + prompt[1:]) == []


def test_eviction_takes_the_least_recently_used_cached_block():
    bm = BlockManager(3, BS)
    seqs = []
    for t in range(3):  # three one-block prompts of 16 tokens plus one
        s = Blocks()
        tokens = [t] * 17
        bm.grow(s, 16)
        bm.commit(s, tokens, 16)
        bm.release(s)
        seqs.append(tokens)
    assert len(bm.idle) == 3 and not bm.free
    s = Blocks()
    assert bm.grow(s, 16)  # evicts the oldest: prompt 0's block
    assert bm.match(seqs[0]) == [] and len(bm.match(seqs[1])) == 1 and len(bm.match(seqs[2])) == 1
    assert not bm.grow(s, 64)  # more than the pool holds: nothing taken
    assert len(s.table) == 1


def test_caching_off_keeps_nothing():
    bm = BlockManager(4, BS, caching=False)
    s = Blocks()
    tokens = list(range(33))
    bm.grow(s, 33)
    bm.commit(s, tokens, 33)
    bm.release(s)
    assert bm.match(tokens) == [] and len(bm.free) == 4


def test_pool_size_from_a_setting_or_from_memory():
    from powerinfer.config import Config
    from powerinfer.formats.args import ModelArgs

    a = ModelArgs("llama", 100, 64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                  max_seq_len=512)
    per_block = 2 * 2 * 2 * 16 * 2 * 16  # K and V, layers, KV heads, head size, bf16, positions
    n, why = pool_blocks(a, Config(kv_cache_gb=1.0), 512, 2)
    assert n == 2**30 // per_block and "kv_cache_gb" in why
    n, why = pool_blocks(a, Config(max_batch=4), 512, 2)  # auto: 4 whole contexts fit here
    assert BlockManager(n, BS).capacity >= 512 and n <= 4 * 512 // 16 + 3 and "max_batch" in why
    # a pool on a GPU: at most a quarter of the VRAM budget (one sized by the host's memory took
    # more than the whole budget, leaving nothing for the hot neurons)
    big = ModelArgs("llama", 100, 4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=128,
                    max_seq_len=8192)
    n, why = pool_blocks(big, Config(vram_budget_gb=4), 8192, 2, gpu=True)
    per_block = 2 * 32 * 4096 * 2 * 16
    assert n * per_block <= 2**30 < (n + 1) * per_block and "25% of the VRAM budget" in why
    assert pool_blocks(big, Config(vram_budget_gb=4), 8192, 2)[0] != n  # (the host's, on a CPU)
    with pytest.raises(ValueError):
        Config(block_size=8)


@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=64))
def test_block_keys_chain_their_prefix(tokens):
    a = block_key(b"", tokens)
    assert len(a) == 16 and block_key(b"", tokens) == a
    assert block_key(a, tokens) != a and block_key(b"x", tokens) != a
