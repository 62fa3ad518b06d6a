"""The hot executor's decode step in segments between its host exchanges, each replayed as a CUDA
graph on a GPU.

On a GPU the hot executor's step is bound by launching, not by the device: on the 70B shape's
8 blocks, 84 torch launches and 29 Triton ones a step, 1.4 ms of GPU work in 11-14 ms of the
hot side's time (BENCHMARKS.md, sixth device run). Between two exchanges with the predictor
or the cold executors, a step's launches are the same for a given batch height and block-table
width, so they are captured once and replayed, one launch a segment. A step of B rows runs:

    embed      the tokens' embeddings, the RoPE rows at their positions;
               [lookahead predictor] the layer input into the predictor's buffer
    (host)     [lookahead] the predictor's input for layer 0 published
    per layer i:
      attn i   the norm, attention (the cache's write among it) and the residual; the FFN's
               norm, its rows into the `x` channel; [same-layer predictor] its input
      (host)   the copies done; [same-layer] its input published; the masks received and
               put after the rows; the FFN's message sent; [device buffers] the masks waited for
      hot i    the hot neurons under the masks (a layer holding some)
      (host)   the cold executors' partial sums received
      add i    the sums copied in and added (float32, one rounding), the residual;
               [lookahead] the next layer's input into the predictor's buffer
      (host)   [lookahead] that input published
    head       the final norm and the head at the rows sampled: the logits

The step's inputs (tokens, positions, sequence starts, block tables, the rows sampled) are
copied into tensors that stay where they are; the tables are padded to a width bucket (a power
of two, 16 blocks or more, up to a sequence's most), so that a batch height needs few captures
(`SegmentedDecode.sets`). A segment's outputs stay where its capture put them and the next
segment reads them there. The first step of a (height, width) runs the segments launch by
launch (the kernels compile then, outside a capture); the second captures them and replays
(for MAX_CAPTURED sets at most: the others keep running launch by launch).
Where a capture fails the reason is logged and kept in `stats`, and every step after takes the
module path.

The same sequence runs launch by launch where nothing is captured (`capture=False`): on a CPU
that is what the tests check against the modules' path; it is the reference of the graphs.
"""
from __future__ import annotations

import logging
import time

import torch

from powerinfer.model import transformer as model_mod
from powerinfer.model.transformer import KVTables

from .plane import DECODE, FFNInput, Partial, receive, send

log = logging.getLogger("powerinfer")

MIN_WIDTH = 16  # blocks: the narrowest table a capture is made for
# captured (height, width) sets at most: each holds its segments' tensors (its logits alone are
# height x vocab float32, 33 MB at 64 rows of a 128k vocabulary) outside the placement's budget;
# the sets past it run op by op. The first ones seen are kept: the small heights, where the
# launches cost the most against the device's work
MAX_CAPTURED = 8


def width_bucket(m: int, most: int) -> int:
    """The table width a step of m blocks a sequence runs at: the next power of two from
    MIN_WIDTH, no wider than a sequence can need (`most`), never under m."""
    w = MIN_WIDTH
    while w < m:
        w *= 2
    return max(m, min(w, most))


class SegmentedDecode:
    """The hot executor's decode step (T == 1, every row sampled) as segments; `__call__` takes
    the model's forward arguments. `model`: the hot executor's (`RemoteFFN` in every block);
    `io`: its `DataPlane` (not the native one); `most`: the blocks a sequence can hold."""

    def __init__(self, model, io, most: int, capture: bool):
        self.model, self.io, self.most, self.capture = model, io, most, capture
        self.sets: dict[tuple[int, int], _Set] = {}
        self.off: str | None = None  # why the graphs were given up (a failed capture)
        self.replayed = self.eager = self.fallback = 0  # steps each way
        self.capture_s = 0.0

    @staticmethod
    def supports(model, io) -> str | None:
        """None where the segments run this model's decode step, else why not."""
        if io.native:
            return "the FFN exchanges are native (a CPU step without a predictor)"
        if any(b.parallel for b in model.layers):
            return "parallel attention and FFN blocks"
        if model.pos_embeddings is not None:
            return "learned positions"
        return None

    def __call__(self, tokens, pos, kv: KVTables, last):
        B, T = tokens.shape
        if T != 1 or last.shape[0] != B or kv.tables.shape[0] != B or self.off is not None:
            self.fallback += 1
            return self.model(tokens, pos, kv, last)
        key = (B, width_bucket(kv.tables.shape[1], self.most))
        s = self.sets.get(key)
        if s is None:
            s = self.sets[key] = _Set(self, *key)
        s.load(tokens, pos, kv, last)
        return s.step()

    def captured(self) -> int:
        return sum(s.graphs is not None for s in self.sets.values())

    def stats(self) -> dict:
        return {"replayed": self.replayed, "eager": self.eager, "fallback": self.fallback,
                "captured": sorted(k for k, s in self.sets.items() if s.graphs is not None),
                "capture_s": self.capture_s, "off": self.off}


class _Set:
    """One batch height and table width: the step's input tensors, the tensors its segments
    pass on (`t`), and the segments' graphs once captured."""

    def __init__(self, owner: SegmentedDecode, B: int, width: int):
        self.owner, self.B = owner, B
        dev = owner.io.device
        self.tokens = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        self.starts = torch.zeros(B + 1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(B, width, dtype=torch.int32, device=dev)
        self.last = torch.zeros(B, dtype=torch.int64, device=dev)
        self.t: dict[str, object] = {}
        self.graphs: dict[str, torch.cuda.CUDAGraph] | None = None
        self.runs = 0

    def load(self, tokens, pos, kv: KVTables, last):
        self.tokens.copy_(tokens, non_blocking=True)
        self.pos.copy_(pos, non_blocking=True)
        self.starts.copy_(kv.starts, non_blocking=True)
        m = kv.tables.shape[1]
        self.tables[:, :m].copy_(kv.tables, non_blocking=True)  # (past m: never read)
        self.last.copy_(last, non_blocking=True)

    def step(self) -> torch.Tensor:
        o = self.owner
        if o.capture and self.graphs is None and self.runs and o.captured() < MAX_CAPTURED:
            t0 = time.perf_counter()
            try:
                self._run("capture")
            except Exception as e:  # the module path from now on, saying why
                o.off = f"{type(e).__name__}: {e}"[:500]
                log.warning("the hot executor's decode step could not be captured as CUDA "
                            "graphs (%s): it runs launch by launch", o.off)
                self.graphs = None
                o.fallback += 1
                return o.model(self.tokens, self.pos, KVTables(self.starts, self.tables),
                               self.last)
            finally:
                o.capture_s += time.perf_counter() - t0
        if self.graphs is None:
            self.runs += 1
            o.eager += 1
            return self._run("eager")
        o.replayed += 1
        return self._run("replay")

    # the sequence, three ways: eager (each segment's launches), capture (no host work: the
    # segments recorded), replay (each segment one launch)
    def _run(self, mode: str) -> torch.Tensor:
        o, io, t = self.owner, self.owner.io, self.t
        m = o.model
        host = mode != "capture"
        graphs = {} if mode == "capture" else self.graphs
        if mode == "capture":  # the set's segments share one memory pool, replayed in order;
            # captured on the stream the steps run on (one cuBLAS workspace: see `HotExecutor.run`)
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.current_stream(io.device)

        def seg(name, fn, *args):
            if mode == "eager":
                fn(*args)
            elif mode == "replay":
                graphs[name].replay()
            else:
                graphs[name] = self._capture(fn, args, pool, stream)

        lookahead, n = io.predicting and io.lookahead, len(m.layers)
        seg("embed", self._embed)
        if host and lookahead:
            self._publish_predictor_input(0)
        for i, block in enumerate(m.layers):
            f = block.ffn.f
            seg(f"attn{i}", self._attn, i)
            if host:
                self._exchange(i)
            hot = len(f.hot.idx) > 0
            if hot:
                seg(f"hot{i}", self._hot, i)
            if host:
                for p in io.parts:
                    receive(p, Partial)
            seg(f"add{i}", self._add, i, hot)
            if host and lookahead and i + 1 < n:
                self._publish_predictor_input(i + 1)
        seg("head", self._head)
        if mode == "capture":  # (nothing ran: `step` replays them for this step)
            self.graphs = graphs
            return None
        return t["logits"]

    @staticmethod
    def _capture(fn, args, pool, stream) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
            fn(*args)
        return g

    # the segments: device work only, reading and writing `t`
    def _embed(self):
        m, t = self.owner.model, self.t
        h = m.tok_embeddings(self.tokens)
        if m.args.embed_scale:
            h = h * torch.tensor(m.args.embed_scale, dtype=h.dtype)
        t["flat"] = self.pos.view(-1)
        t["ropes"] = m.ropes(t["flat"])
        t["h"] = h
        if self.owner.io.predicting and self.owner.io.lookahead:
            self.owner.io.put_predictor_input(h, non_blocking=True)

    def _attn(self, i: int):
        o, t = self.owner, self.t
        block = o.model.layers[i]
        f = block.ffn.f
        # this step's memo of index work, for its layers (see `Transformer.forward`)
        if i == 0:
            t["kv"] = KVTables(self.starts, self.tables, {} if model_mod.STEP_MEMO else None)
        x = t["h"]
        y = block.attn(block.attn_norm(x), t["ropes"][block.rope], t["flat"], t["kv"])
        if block.post_attn_norm is not None:
            y = block.post_attn_norm(y)
        h = x + y
        x = f.norm(h)
        t["h"], t["x"] = h, x
        o.io.x.put(x, non_blocking=True)
        if o.io.predicting and not o.io.lookahead:
            o.io.put_predictor_input(h, non_blocking=True)

    def _hot(self, i: int):
        io, t = self.owner.io, self.t
        f = self.owner.model.layers[i].ffn.f
        rows = None
        if io.predicting:  # (its wait for the predictor's writes is the host's, in `_exchange`)
            rows = io.device_mask(io.mask.view(torch.bool, (self.B, io.spec.ffn_dim)), wait=False)
        t["y"] = f.hot_part(t["x"], None if rows is None else rows.any(0), rows)

    def _add(self, i: int, hot: bool):
        io, t = self.owner.io, self.t
        block = self.owner.model.layers[i]
        f, x = block.ffn.f, t["x"]
        y = t["y"] if hot else 0
        for p in io.parts:  # float32 partial sums add up before one rounding
            y = y + p.view(torch.float32, x.shape).to(io.device, non_blocking=True)
        y = y.to(x.dtype)
        if f.down_b is not None:
            y = y + f.down_b
        if block.post_ffn_norm is not None:
            y = block.post_ffn_norm(y)
        t["h"] = t["h"] + y
        if io.predicting and io.lookahead and i + 1 < len(self.owner.model.layers):
            io.put_predictor_input(t["h"], non_blocking=True)

    def _head(self):
        m, t = self.owner.model, self.t
        h = t["h"].reshape(self.B, -1)[self.last].unsqueeze(1)
        t["logits"] = m.output(m.norm(h)).float()

    # the host's part between segments
    def _sync(self):
        if self.owner.io.device.type == "cuda":
            torch.cuda.current_stream(self.owner.io.device).synchronize()

    def _publish_predictor_input(self, layer: int):
        """The input a segment put (`DataPlane.put_predictor_input`), published: on the host
        channel once its copy is done; in the device buffer at this point of the stream."""
        if self.owner.io.buffers is None:
            self._sync()
        self.owner.io.publish_predictor_input(layer, self.B)

    def _exchange(self, i: int):
        """After attn i: the FFN's input out to the cold executors, with the masks."""
        io, B = self.owner.io, self.B
        layer = self.owner.model.layers[i].ffn.f.layer
        if io.predicting and not io.lookahead:
            self._publish_predictor_input(layer)
        self._sync()  # the rows (and a host predictor's input) are in the channels
        if io.predicting:
            rows = io.recv_mask(B)
            io.x.put(rows, io.spec.mask_offset(B))
        send(io.x, FFNInput(DECODE, layer, B, 1, int(io.predicting)))
        if io.buffers is not None:
            io.buffers["mask"].consume()  # the hot segment reads the predictor's masks
