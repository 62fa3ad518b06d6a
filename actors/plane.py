"""The channels of one model's group, who writes and who reads each, and the step protocol.

    channel  writer -> readers       header (the NamedTuple below); payload
    ctl      scheduler -> hot        Step; tokens, positions, sequence starts, block tables and
                                     the sampled tokens' indices (at `ctl_layout`)
    out      hot -> scheduler        Reply; logits (K, vocab) fp32, or an error's text
    pred_in  hot -> predictor        PredictorInput (decode only); its input (B, dim) fp32
                                     (in a device buffer where the two share a GPU)
    mask     predictor -> hot        Masks; per-row predicted-active neurons (B, ffn_dim) bool
                                     (also in a device buffer where the two share a GPU); with
                                     lookahead the cold executors watch it too, unconsumed, to
                                     warm the records it selects (`cold_serve`'s `ahead`)
    x        hot -> cold (all)       FFNInput; FFN input (B*T, dim) [, masks at `mask_offset`],
                                     or (op HEAD) the normed rows the output head reads, or
                                     (op ATTN) the attention input (B*T, dim), positions (B*T,),
                                     sequence starts (S+1,) and block tables (S, M) int32 at
                                     `attn_layout`
    part.k   cold k -> hot           Partial; its partial FFN output (rows, dim) fp32, or (HEAD)
                                     its vocabulary rows' logits (rows, its share) fp32, or
                                     (ATTN) its heads' share of the attention output (rows, dim)

A step's tokens are flat, sequence by sequence (`model.KVTables`): (S, 1) for a decode step
(every sequence one token), (1, N) for any other mix of prompt chunks and decode rows.

A header's first word of a message a loop reads (Step, PredictorInput, FFNInput) is the op;
STOP alone ends the reader's loop. Per decode layer the hot executor sends the layer input on
`pred_in` before attention (lookahead;
after attention in same-layer mode), reads the masks after attention, sends the FFN input with
the masks on `x`, computes its hot neurons, and adds every `part.k`. On a CPU the output head is
split the same way by vocabulary rows (`head_ranges`): after the last layer the hot executor
sends the normed rows with op HEAD and computes its share while the cold executors compute
theirs. On a CPU attention is split too (`kv_ranges`; with a predictor where
`splits_attention` says so): before each layer's attention the hot executor sends its input (op
ATTN, words 5 and 6 the step's sequences and its block tables' width), each executor computes
the heads of its KV heads (in its own paged pool, at the same block ids) and their share of the
output projection, and the shares add up on the hot side. With a predictor on a CPU every
process answers a decode step's messages in the kernel library's native loops (`hot_layers`,
`cold_serve`, `pred_serve`), with the same headers and payloads as the Python loops. Every reply
proves the readers are done with the message before it, so the channels need one buffer each.
"""
from __future__ import annotations

import mmap
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

from .channel import HEADER, SHM_DIR, Channel, ChannelClosed, align, create, segment_path

PREFILL, DECODE, STOP, HEAD, ATTN = 1, 2, 3, 4, 5
# How long a reader spins (yielding its core) before it sleeps. The layer loop's hand-offs come
# every few hundred microseconds while a step runs, the next step within a millisecond of the
# last: spinning through them keeps every hop in microseconds, and an idle group still sleeps.
# The scheduler waits a whole step for `out`, on the hot executor's core: it sleeps at once.
SPIN_US = 2000.0
SLEEPS_AT_ONCE = {"out"}
OK, ERROR = 0, 1
ERROR_BYTES = 1 << 16


def head_ranges(vocab: int, n_cold: int, hot_share: float) -> list[tuple[int, int]]:
    """The output head's rows per executor, hot first, then each cold executor's: the hot
    executor's share of the cores, the rest dealt out evenly."""
    hot = round(vocab * hot_share)
    cuts = [hot + round((vocab - hot) * k / n_cold) for k in range(n_cold + 1)] if n_cold else [vocab]
    return [(0, hot)] + list(zip(cuts, cuts[1:]))


def kv_ranges(n_kv: int, n_cold: int, hot_share: float) -> list[tuple[int, int]]:
    """Each executor's KV heads when attention is split, hot first: the hot executor's share of
    the cores, rounded down (it also runs the norms, the residual stream and the exchanges), at
    least one; the rest dealt out evenly (an executor may get none). A model with one KV head
    keeps it on the hot executor."""
    hot = n_kv if n_kv < 2 or not n_cold else max(1, int(n_kv * hot_share))
    cuts = [hot + round((n_kv - hot) * k / n_cold) for k in range(n_cold + 1)] if n_cold else [n_kv]
    return [(0, hot)] + list(zip(cuts, cuts[1:]))


def split_kv(n_kv: int, n_cold: int, hot_share: float, enabled: bool) -> list[tuple[int, int]] | None:
    """Each executor's KV heads (hot first, `kv_ranges`) when the group splits attention, else
    None: it does where `enabled` (the group's decision: a CPU group, `splits_attention`, whose
    exchanges run natively) with the kernel library loaded, and where every executor gets at
    least one KV head (an executor with none would still have to answer every message)."""
    from powerinfer import kernels
    if not enabled or not kernels.available():
        return None
    ranges = kv_ranges(n_kv, n_cold, hot_share)
    return ranges if all(hi > lo for lo, hi in ranges) else None


def splits_attention(args, plan) -> bool:
    """Whether a CPU group splits attention by KV heads over its executors (`split_kv` decides
    where it can): always without a predictor (every neuron computed); with one where attention's
    weights outweigh half of the FFN's that the predictors pick on average, the work unsplit
    heads would leave the hot executor beyond the others' (a 7B shape's, 3x, needs the split:
    0.87-0.93x in-process against 0.69-0.87x whole; SmolLM2's, 0.4x, decodes faster whole,
    0.81-0.92x against 0.75-0.82x split: the split's exchange and its uneven share of 3 heads
    cost more; BENCHMARKS.md)."""
    if plan.predictor_input is None:
        return True
    a = args
    heads = a.dim * a.head_dim * 2 * (a.n_heads + a.n_kv_heads)  # q, k, v, o
    ffn = (3 if a.gated else 2) * a.dim * a.ffn_dim
    return heads > ffn * (plan.active_share if plan.active_share is not None else 1.0) / 2


class Step(NamedTuple):
    op: int  # PREFILL (any mix of prompt chunks and decode rows), DECODE (one token each) or STOP
    B: int  # the tokens' shape (B, T): (S, 1) or (1, N)
    T: int
    S: int  # sequences
    M: int  # the block tables' width
    K: int  # tokens whose logits are wanted (the sampled sequences' last)


class Reply(NamedTuple):
    status: int  # OK or ERROR
    n: int  # rows of logits, or the error text's bytes
    # input sparsity: the input channels the hot executor's sparse projections kept and saw in
    # the step (decode steps of one row; 0 where it is off)
    kept: int = 0
    seen: int = 0


class PredictorInput(NamedTuple):
    op: int  # DECODE or STOP
    layer: int
    B: int


class Masks(NamedTuple):
    layer: int
    B: int


class FFNInput(NamedTuple):  # a message on `x`
    op: int  # PREFILL, DECODE, HEAD, ATTN or STOP
    layer: int  # -1 for HEAD
    B: int
    T: int
    extra: int  # PREFILL/DECODE: 1 if per-row masks follow the rows; ATTN: the step's sequences
    width: int = 0  # ATTN: the block tables' width


class Partial(NamedTuple):  # its payload float32: partial sums add up before one rounding
    layer: int
    rows: int


class AttnLayout(NamedTuple):
    """Byte offsets of an ATTN message's tensors on `x`."""
    rows: int  # (N, dim) the attention input, in the model's dtype
    positions: int  # (N,) int64
    starts: int  # (S + 1,) int64
    tables: int  # (S, M) int32


class CtlLayout(NamedTuple):
    """Byte offsets of a step's tensors on `ctl`."""
    tokens: int  # (N,) int64
    positions: int  # (N,) int64
    starts: int  # (S + 1,) int64
    tables: int  # (S, M) int32
    last: int  # (K,) int64: flat indices of the tokens whose logits are wanted


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # a group's activation types' bytes

Header = TypeVar("Header", Step, Reply, PredictorInput, Masks, FFNInput, Partial)


def send(ch: Channel, header: NamedTuple):
    ch.publish(*header)


def receive(ch: Channel, kind: type[Header], timeout: float | None = None) -> Header:
    """Wait for the next message on ch and read its header as `kind`."""
    return kind(*(int(v) for v in ch.wait(timeout)[:len(kind._fields)]))


class Answering:
    """The loop of an actor that answers the messages of one channel (a cold executor, the
    predictor): `_next` waits for the next message it answers in Python (its native loop, where
    it has one, answers the others inside that wait), `_answer` answers it; the seconds spent
    answering add up in `busy_s`. Runs until STOP ("stopped") or the group closes the channel
    ("closed"), the value its `run` call returns to the group."""

    busy_s: float = 0.0

    def _next(self):
        raise NotImplementedError

    def _answer(self, got):
        raise NotImplementedError

    def run(self) -> str:
        import torch  # (the answering actors compute with torch; the scheduler never runs this)
        with torch.inference_mode():
            return self._answer_all()

    def _answer_all(self) -> str:
        try:
            while True:
                got = self._next()
                if got.op == STOP:
                    return "stopped"
                t0 = time.perf_counter()
                self._answer(got)
                self.busy_s += time.perf_counter() - t0
        except ChannelClosed:
            return "closed"


def rope_bytes(tables: int, max_seq: int, head_dim: int) -> int:
    """Bytes of `tables` RoPE tables, cos and sin of max_seq rows of head_dim float32 each."""
    return tables * 2 * max_seq * head_dim * 4


def shm_room() -> int:
    """Bytes free on the filesystem the segments live on."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class PlaneSpec:
    """Sizes and segment paths of a group's channels, and of the paged KV cache every
    attention-holding executor allocates (the same block ids in each); every actor receives it."""
    owner: int
    group: str
    n_cold: int
    batch: int  # sequences a step, the health probe's included
    tokens: int  # tokens a step: decode rows and prompt chunks
    max_seq: int  # positions a sequence reaches
    num_blocks: int  # KV cache blocks, the health probe's included (the last)
    block_size: int
    dim: int
    ffn_dim: int
    vocab: int
    dtype: str  # activations on the channels, the model's compute dtype
    spin_us: float = SPIN_US
    paths: dict = field(default_factory=dict)
    # the predictor shares the hot executor's GPU: the predictor input and the masks travel in
    # device buffers (`device_buffers`), the host channels carry the headers and the masks'
    # copy for the cold executors
    device_predictor: bool = False
    # the CPU kernel's instruction-set class every actor holds (`Config.cpu_isa`, resolved)
    isa: str = "auto"
    # with lookahead masks, each cold executor warms the records they select into its caches
    # while the hot side attends (`cold_serve`'s `ahead`); POWERINFER_WARM_AHEAD=0 turns it off
    # (a diagnostic: the step's breakdown with and without)
    warm_ahead: bool = field(
        default_factory=lambda: os.environ.get("POWERINFER_WARM_AHEAD", "1") != "0")
    # the RoPE tables (0, 1, or 2 where the sliding layers have their own base; cos and sin of
    # max_seq rows of head_dim float32 each) in a segment of their own: the hot executor fills
    # their rows as steps reach them (`Transformer.rope_ensure`, before it sends a step on) and
    # the cold executors that attend read the same pages, one copy a group, only what was reached
    ropes: int = 0
    head_dim: int = 0

    @classmethod
    def new(cls, n_cold: int, batch: int, tokens: int, max_seq: int, num_blocks: int,
            block_size: int, args, dtype: "torch.dtype | str", spin_us: float = SPIN_US,
            isa: str = "auto") -> "PlaneSpec":
        ropes = 0 if args.learned_pos else 2 if args.rope_base_local else 1
        if rope_bytes(ropes, max_seq, args.head_dim) > shm_room() // 2:
            # a small shared-memory filesystem (a container's 64 MiB /dev/shm): a write past its
            # size would kill the writer (SIGBUS), so each executor holds its own tables
            ropes = 0
        spec = cls(os.getpid(), uuid.uuid4().hex[:8], n_cold, batch, tokens, max_seq, num_blocks,
                   block_size, args.dim, args.ffn_dim, args.vocab_size,
                   str(dtype).removeprefix("torch."), spin_us, isa=isa, ropes=ropes,
                   head_dim=args.head_dim)
        for name in spec.capacities():
            spec.paths[name] = str(segment_path(spec.owner, spec.group, name))
        return spec

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes of an activation of the group's type (without torch: the scheduler's sizes)."""
        return ITEMSIZE[self.dtype]

    @property
    def max_blocks(self) -> int:
        """The widest block table: a sequence at max_seq positions, and never under a step's
        least width (`batching.MIN_TABLE_BLOCKS`)."""
        from powerinfer.engine.batching import MIN_TABLE_BLOCKS  # (the scheduler's module: the
        # executors that map the plane need none of it)
        return max(MIN_TABLE_BLOCKS, -(-self.max_seq // self.block_size))

    def capacities(self) -> dict[str, int]:
        S, N, M, es = self.batch, self.tokens, self.max_blocks, self.itemsize
        where = align(N * 8) + align((S + 1) * 8) + align(S * M * 4)  # positions, starts, tables
        caps = {"ctl": align(N * 8) + where + align(S * 8),
                "out": max(align(S * self.vocab * 4), ERROR_BYTES),
                "pred_in": align(S * self.dim * 4),
                "mask": align(S * self.ffn_dim),
                # after the rows: masks, or an attention step's positions, starts and tables
                "x": align(N * self.dim * es) + max(align(S * self.ffn_dim), where)}
        # partial sums in float32 at most, or a cold executor's rows of the head (at most all)
        part = max(align(N * self.dim * 4), align(S * self.vocab * 4))
        caps.update({f"part.{k}": part for k in range(self.n_cold)})
        if self.ropes:  # (tmpfs: a page costs memory once it is written)
            caps["rope"] = rope_bytes(self.ropes, self.max_seq, self.head_dim)
        return caps

    @staticmethod
    def ctl_layout(N: int, S: int, M: int) -> CtlLayout:
        pos = align(N * 8)
        starts = pos + align(N * 8)
        tables = starts + align((S + 1) * 8)
        return CtlLayout(0, pos, starts, tables, tables + align(S * M * 4))

    def attn_layout(self, N: int, S: int) -> AttnLayout:
        positions = align(N * self.dim * self.itemsize)
        starts = positions + align(N * 8)
        return AttnLayout(0, positions, starts, starts + align((S + 1) * 8))

    def mask_offset(self, rows: int) -> int:
        """Where the masks start on `x`, after `rows` rows of FFN input."""
        return align(rows * self.dim * self.itemsize)

    def create_all(self):
        for name, cap in self.capacities().items():
            create(Path(self.paths[name]), cap)

    def unlink_all(self):
        for p in self.paths.values():
            Path(p).unlink(missing_ok=True)

    def rope_tables(self, writer: bool = False) -> tuple | None:
        """The group's RoPE tables over their segment, as `transformer.rope_tables` gives them:
        (global, local) (cos, sin) float32 tensors (max_seq, head_dim), local the global pair
        again where the model has one base; None without RoPE. writer: the hot executor's, which
        fills their rows; the others map them read-only."""
        arrays = self.rope_arrays(writer)
        if arrays is None:
            return None
        import torch
        with warnings.catch_warnings():  # (a reader's map is read-only: it only reads)
            warnings.simplefilter("ignore", UserWarning)
            return tuple(tuple(torch.from_numpy(a) for a in pair) for pair in arrays)

    def rope_arrays(self, writer: bool = False) -> tuple | None:
        """`rope_tables` as numpy arrays (a process without torch: `cold_native`)."""
        if not self.ropes:
            return None
        fd = os.open(self.paths["rope"], os.O_RDWR if writer else os.O_RDONLY)
        try:
            m = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE if writer else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        rows = self.max_seq * self.head_dim
        t = [np.frombuffer(m, np.float32, rows, HEADER + 4 * rows * k).reshape(self.max_seq, self.head_dim)
             for k in range(2 * self.ropes)]
        glob = (t[0], t[1])
        return glob, (t[2], t[3]) if self.ropes > 1 else glob

    def open(self, name: str, writer: bool = False) -> Channel:
        return Channel(Path(self.paths[name]), writer,
                       0.0 if name in SLEEPS_AT_ONCE else self.spin_us)
