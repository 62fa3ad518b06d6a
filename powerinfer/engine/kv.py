"""The paged KV cache's bookkeeping: which blocks each sequence holds, which full blocks are kept
for reuse, which are free, and how many blocks a pool gets. Plain Python: both runtimes deal
blocks out through it (`batching.Batcher` for the in-process engine and the actor runtime's
scheduler), and every attention's `model.KVCache` holds the keys and values at the ids it gives.

A block holds `block_size` positions; a sequence's table lists its blocks by position. A block
whose positions are all computed is full, and is keyed by a hash of its tokens and of every
token before it (the key of the block before, then its own tokens: vLLM's scheme), so that a
later sequence that starts with the same tokens reuses it instead of computing it again. A full
block that no sequence holds stays cached until its room is needed, least recently used first.
Blocks never keyed are handed out lowest id first, so a pool's memory (zero pages until
written) is resident only as far as it is used.

A sequence only ever writes into blocks it holds alone: reuse stops one token short of the
prompt's end (its last token must be computed for its logits), at a whole block, and a block is
keyed only once it is full.
"""
from __future__ import annotations

import hashlib
import heapq
import logging
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from ..errors import ConfigError

log = logging.getLogger("powerinfer")


BLOCK_SIZES = (16, 32, 64)  # what the attention kernel reads (a multiple of its vector width)


WATERMARK = 0.01  # share of the pool kept free when admitting, so that running sequences grow


def block_key(parent: bytes, tokens) -> bytes:
    """A full block's key: 16 bytes of BLAKE2b over the key of the block before it (b"" for the
    first) and its tokens. A collision would hand one sequence another's cache, so the key is a
    cryptographic hash, not Python's."""
    return hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class Blocks:
    """What one sequence holds of the pool."""
    table: list[int] = field(default_factory=list)  # its blocks, by position // block_size
    keys: list[bytes] = field(default_factory=list)  # the keys of its full computed blocks
    reserved: bool = False  # its table was given by its owner (a probe's block), not the pool's


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        assert num_blocks > 0 and block_size in BLOCK_SIZES, (num_blocks, block_size)
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.refs = [0] * num_blocks  # holders of each block
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.by_key: dict[bytes, int] = {}  # full blocks' keys -> block
        self.idle: OrderedDict[int, None] = OrderedDict()  # keyed blocks nobody holds, LRU first
        self.free = list(range(num_blocks))  # a heap of blocks never keyed (or evicted)
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached

    # ---- state ----
    @property
    def available(self) -> int:
        """Blocks a sequence can take now (free, or cached and evictable)."""
        return len(self.free) + len(self.idle)

    @property
    def usage(self) -> float:
        """Share of the pool held by sequences."""
        return 1 - self.available / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def capacity(self) -> int:
        """Positions one sequence can reach alone (admission keeps the watermark free)."""
        return (self.num_blocks - math.ceil(WATERMARK * self.num_blocks)) * self.block_size

    # ---- prefix reuse ----
    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks a sequence of these tokens may start with: whole blocks of
        tokens[:-1] (the last token is always computed, for its logits)."""
        if not self.caching:
            return []
        out, parent = [], b""
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs])
            b = self.by_key.get(parent)
            if b is None:
                break
            out.append(b)
        return out

    def can_admit(self, hit: list[int], tokens: int) -> bool:
        """Whether a sequence starting on the cached blocks `hit` can hold `tokens` positions now,
        leaving the watermark free for the running ones to grow."""
        idle_hits = sum(1 for b in hit if self.refs[b] == 0)
        need = self.blocks_for(tokens) - len(hit)
        return self.available - idle_hits - need >= math.ceil(WATERMARK * self.num_blocks)

    def admit(self, seq: Blocks, hit: list[int], tokens: list[int], first: bool) -> int:
        """Start seq on the cached blocks `hit` (from `match`); returns the tokens they hold.
        `first`: the sequence's first admission (counted in the hit rate; a preempted sequence
        that comes back is not a new query)."""
        assert not seq.table, "a sequence is admitted once (released before it comes back)"
        for b in hit:
            if self.refs[b] == 0:
                self.idle.pop(b)
            self.refs[b] += 1
            seq.table.append(b)
        seq.keys = [self.key_of[b] for b in hit]
        n = len(hit) * self.block_size
        if first:
            self.queries += len(tokens)
            self.hits += n
        return n

    # ---- growth and release ----
    def grow(self, seq: Blocks, tokens: int) -> bool:
        """Give seq blocks for `tokens` positions in all; False (and nothing taken) if the pool
        cannot, even by evicting cached blocks."""
        need = self.blocks_for(tokens) - len(seq.table)
        if need <= 0:
            return True
        if need > self.available:
            return False
        for _ in range(need):
            seq.table.append(self._take())
        return True

    def _take(self) -> int:
        if self.free:
            b = heapq.heappop(self.free)
        else:  # the least recently used cached block
            b, _ = self.idle.popitem(last=False)
            del self.by_key[self.key_of[b]]
            self.key_of[b] = None
        self.refs[b] = 1
        return b

    def commit(self, seq: Blocks, tokens: list[int], computed: int):
        """Key seq's blocks that `computed` (its tokens now in the cache) has filled, so later
        sequences can reuse them."""
        bs = self.block_size
        while len(seq.keys) < min(computed // bs, len(seq.table)):
            i = len(seq.keys)
            key = block_key(seq.keys[-1] if seq.keys else b"", tokens[i * bs:(i + 1) * bs])
            seq.keys.append(key)
            b = seq.table[i]
            if self.caching and not seq.reserved and key not in self.by_key:
                self.by_key[key] = b
                self.key_of[b] = key

    def release(self, seq: Blocks):
        """Give back seq's blocks (it finished, was cancelled or preempted): keyed blocks stay
        cached, the others are free."""
        if not seq.reserved:
            for b in reversed(seq.table):  # its last blocks are the least likely to be shared
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    if self.key_of[b] is not None:
                        self.idle[b] = None
                    else:
                        heapq.heappush(self.free, b)
        seq.table, seq.keys = [], []

    def reset_cache(self):
        """Forget every cached block nobody holds (they become free)."""
        for b in self.idle:
            del self.by_key[self.key_of[b]]
            self.key_of[b] = None
            heapq.heappush(self.free, b)
        self.idle.clear()


def bytes_per_token(args, dtype_bytes: int) -> int:
    """KV cache bytes of one position of one sequence, every layer and KV head."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * dtype_bytes


def available_memory() -> int:
    """MemAvailable of this host (or of its cgroup's limit, where that is lower), in bytes."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail, int(limit) - used) if avail is not None else int(limit) - used
    except (OSError, ValueError):
        pass
    return avail or 0


AUTO_SHARE = 0.25  # of the host's available memory, at most, for a pool sized automatically
# of the VRAM budget (without one, of the device's free memory), at most, for a pool sized
# automatically on a GPU: the rest is the hot neurons' (a pool sized by the host's memory took
# 5.7 of a 4 GiB budget for SmolLM2's default 64 sequences of 8,192 positions)
GPU_SHARE = 0.25


def _gpu_bytes(config) -> int | None:
    if config.vram_budget_gb > 0:
        return int(config.vram_budget_gb * 2**30)
    try:
        import torch
        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


def pool_blocks(args, config, context: int, dtype_bytes: int,
                gpu: bool = False) -> tuple[int, str]:
    """The number of blocks of a model's pool, and how it was decided: `config.kv_cache_gb`, or
    (0: auto) room for `max_batch` sequences of the whole context (and the watermark), capped
    at a quarter of the host's available memory (a pool's pages are resident only once
    written), or, for a pool on a GPU (`gpu`), at a quarter of the VRAM budget."""
    per_block = bytes_per_token(args, dtype_bytes) * config.block_size
    if config.kv_cache_gb > 0:
        avail = available_memory()
        if config.device == "cpu" and avail and config.kv_cache_gb * 2**30 > avail:
            raise ConfigError(  # (a MemoryError from the pool's allocation before)
                f"kv_cache_gb={config.kv_cache_gb:g} is more than this host's available memory "
                f"({avail / 2**30:.1f} GiB)")
        blocks = int(config.kv_cache_gb * 2**30 // per_block)
        if blocks < 2:  # (before: it loaded, and every prompt was refused as past max_seq_len)
            raise ConfigError(
                f"kv_cache_gb={config.kv_cache_gb:g} holds {blocks} of this model's KV blocks "
                f"({config.block_size} positions, {per_block / 2**20:.2f} MiB each), too few "
                f"for a sequence: give at least {2 * per_block / 2**30:.4f}, or 0 (auto)")
        return blocks, f"kv_cache_gb={config.kv_cache_gb:g}"
    want = config.max_batch * -(-context // config.block_size)
    want += math.ceil(1.1 * WATERMARK * want) + 1  # admission keeps the watermark free
    if gpu and (room := _gpu_bytes(config)) is not None:
        cap = int(GPU_SHARE * room // per_block)
        bound = (f"{GPU_SHARE:.0%} of the VRAM budget" if config.vram_budget_gb > 0 else
                 f"{GPU_SHARE:.0%} of the GPU's free memory")
    else:
        cap = int(AUTO_SHARE * available_memory() // per_block)
        bound = f"{AUTO_SHARE:.0%} of the host's available memory"
    if cap >= want:
        return want, f"auto: max_batch {config.max_batch} x the context of {context}"
    return max(cap, 1), f"auto: {bound}"


def planned_blocks(blocks: int, args, config, context: int, dtype_bytes: int,
                   gpu: bool) -> int:
    """The pool a VRAM budget's placement counts: this process's own (`blocks`) where it is on
    the GPU or there is no budget, else the one a GPU would hold (`pool_blocks(gpu=True)`)."""
    if gpu or config.vram_budget_gb <= 0:
        return blocks
    return pool_blocks(args, config, context, dtype_bytes, gpu=True)[0]


def describe(blocks: int, args, config, dtype_bytes: int) -> str:
    gib = blocks * config.block_size * bytes_per_token(args, dtype_bytes) / 2**30
    return (f"{blocks} blocks of {config.block_size} positions = {blocks * config.block_size} "
            f"tokens, {gib:.2f} GiB")
