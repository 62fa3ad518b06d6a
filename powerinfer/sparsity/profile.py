"""The activation profiler (`powerinfer profile`): run the dense model over a calibration corpus and
write a bundle with per-neuron firing counts and activation mass, the firing thresholds, and
predictor training samples.

For SwiGLU models a first pass over the start of the corpus records the distribution of
|silu(gate x)| per layer (101 quantiles) and sets each layer's threshold at the target sparsity
(CATS); the quantiles are kept so other operating points need no new profile. ReLU-family models
fire on their natural zeros (threshold 0).

Samples are token positions drawn uniformly from the corpus without replacement; per position and
layer they keep the layer input, the residual entering the FFN, the fired mask, and, for the last
tenth (the latest text: the held-out rows), each neuron's |activation|.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..config import named_device, torch_dtype
from ..formats.bundle import Bundle, model_record
from ..model.load import load_model
from ..model.sparse import activate
from ..model.transformer import held_bytes
from .corpus import Corpus, load_corpus, token_windows

log = logging.getLogger("powerinfer")

# Bytes of samples held in RAM while profiling; past it they are gathered in files beside the
# bundle (a 32-layer 7B's 16,384 samples a layer are 20.2 GB; held in RAM up to this, they were
# cut to 1,927 a layer, and its predictors picked 26.5% of the neurons where the oracle fires 9.9%)
SAMPLE_MEMORY = 2 << 30
# disk left free when they are gathered in files (fewer samples where the disk holds less)
DISK_MARGIN = 1 << 30


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    tokens: int = 0  # 0: the whole calibration corpus
    window: int = 512
    samples: int = 16384  # per layer (fewer only where the disk cannot hold them: _SampleStore)
    held_out: float = 0.1
    # SwiGLU only: the target share of neurons under the threshold; 0.15 is the default
    # model's operating point (+0.3% held-out perplexity, see BENCHMARKS.md)
    sparsity: float = 0.15
    calib_tokens: int = 8192
    seed: int = 0


def is_relu_family(act: str) -> bool:
    return act in ("relu", "reglu", "dreglu")


class _Taps:
    """Forward hooks on every block: the layer input, the residual entering the FFN, and the
    output of w1 (the pre-activations), handed to `on_w1(layer, x_layer, x_ffn, gate, up)`."""

    def __init__(self, model, on_w1):
        self.handles, self.x_layer, self.x_ffn = [], {}, {}
        n = model.args.ffn_dim
        for i, b in enumerate(model.layers):
            self.handles.append(b.register_forward_pre_hook(self._keep(self.x_layer, i)))
            self.handles.append(b.ffn_norm.register_forward_pre_hook(self._keep(self.x_ffn, i)))

            def w1_hook(mod, args, out, i=i, gated=model.args.gated):
                gate, up = out.split(n, dim=-1) if gated else (None, out)
                on_w1(i, self.x_layer[i], self.x_ffn[i], gate, up)
            self.handles.append(b.ffn.w1.register_forward_hook(w1_hook))

    @staticmethod
    def _keep(store, i):
        def hook(mod, args):
            store[i] = args[0]
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _run(model, windows, on_w1, desc: str, progress: bool, after_window=None):
    """One prefill per window with the taps on (on the model's device); after_window(len) runs
    after each window."""
    taps = _Taps(model, on_w1)
    dev = model.norm.weight.device
    try:
        with torch.inference_mode(), tqdm(total=sum(map(len, windows)), desc=desc, unit="tok",
                                          disable=not progress) as bar:
            for w in windows:
                model(torch.tensor([w], device=dev), torch.arange(len(w), device=dev)[None],
                      last=torch.tensor([len(w) - 1], device=dev))
                if after_window is not None:
                    after_window(len(w))
                bar.update(len(w))
    finally:
        taps.close()


def calibrate_thresholds(model, windows, sparsity: float, progress: bool = True):
    """Per-layer quantiles (L, 101) of |act(gate x)| and the thresholds at `sparsity`."""
    act, L = model.args.ffn_act, model.args.n_layers
    pools: list[list[torch.Tensor]] = [[] for _ in range(L)]
    gen = torch.Generator().manual_seed(0)

    def on_w1(i, x_layer, x_ffn, gate, up):
        score, _ = activate(act, gate, up)
        flat = score.flatten().float()
        pick = torch.randint(len(flat), (min(len(flat), 1 << 16),), generator=gen)
        pools[i].append(flat[pick.to(flat.device)].cpu())

    _run(model, windows, on_w1, "calibrating thresholds", progress)
    # numpy's quantiles (a partition, the same linear interpolation): twice torch's speed over
    # a layer's 2M scores
    q = np.linspace(0, 1, 101)
    quantiles = np.stack([np.quantile(torch.cat(p).numpy(), q) for p in pools]).astype(np.float32)
    return quantiles, threshold_at(quantiles, sparsity)


def top_share(mass: np.ndarray, frac: float) -> float:
    """Share of the total mass carried by the top ceil(frac * n) neurons by mass."""
    m = np.sort(np.asarray(mass, np.float64))[::-1]
    k = int(np.ceil(frac * m.size))
    return float(m[:k].sum() / max(m.sum(), 1e-300))


def threshold_at(quantiles: np.ndarray, sparsity: float) -> np.ndarray:
    """Thresholds (L,) that leave `sparsity` of the scores under them, from (L, 101) quantiles."""
    grid = np.linspace(0, 1, quantiles.shape[1])
    return np.array([np.interp(sparsity, grid, q) for q in quantiles], dtype=np.float32)


def _compact(a: np.ndarray) -> np.ndarray:
    """float16 where every value fits it (half the bundle), else float32 (a copy: `a` may be a
    view of a file the samples are gathered in)."""
    return a.astype(np.float16 if np.abs(a).max(initial=0) < 60000 else np.float32)


def disk_room(where: Path, prefix: str) -> int:
    """The bytes of files a run may write in a folder of `where`: the disk's free space less
    DISK_MARGIN, after the folders named `prefix`... that a killed run left there are removed
    (they would count as used)."""
    import shutil

    for old in Path(where).glob(prefix + "*"):
        shutil.rmtree(old, ignore_errors=True)
    return max(int(shutil.disk_usage(where).free - DISK_MARGIN), 0)


class _SampleStore:
    """The samples while a profile gathers them, a layer's arrays at a time (`layers[i]`: x_layer,
    x_ffn (rows, d) float32, fired (rows, n/8) bits, mag (held-out rows, n) float32): in RAM up
    to SAMPLE_MEMORY, else in files in a folder of the bundle's, whose pages the OS writes out as
    they fill, so that a 32-layer model keeps the samples asked for. A layer's files go as soon as
    its samples are written into the bundle (`drop`), so that the disk holds the gathered samples
    and the written ones together only a layer at a time; `close` removes the folder (and a
    profile's start the folders of a profile that was killed). Where the disk holds fewer rows
    (less DISK_MARGIN) than RAM does, the samples stay in RAM; either way fewer, with a warning."""

    def __init__(self, where: Path, L: int, N: int, H: int, d: int, n: int):
        import tempfile

        share = H / N  # (the held-out rows' share)
        row = math.ceil(L * (2 * d * 4 + (n + 7) // 8 + share * n * 4))  # a sample row's bytes
        self.folder = None
        self.layers: list[dict | None] = []
        if N * row > SAMPLE_MEMORY:
            disk = disk_room(where, ".samples-") // row
            ram = int(SAMPLE_MEMORY // row)
            in_files = disk > ram
            if disk < N:
                rows = max(disk if in_files else ram, 2)
                log.warning("%d samples a layer over %d layers need %.1f GB of disk beside the "
                            "bundle while profiling, %.1f GB free: taking %d a layer, held in %s",
                            N, L, N * row / 1e9, disk * row / 1e9, rows,
                            "files beside the bundle" if in_files else "memory")
                N, H = rows, max(1, min(int(rows * share), rows - 1))
            if in_files:
                self.folder = Path(tempfile.mkdtemp(prefix=".samples-", dir=where))
                log.info("%d samples a layer over %d layers (%.1f GB): gathered in files beside "
                         "the bundle, past the %.0f GB held in memory", N, L, N * row / 1e9,
                         SAMPLE_MEMORY / 1e9)
        self.N, self.H = N, H
        try:
            for i in range(L):
                self.layers.append({k: self._array(f"{i}.{k}", shape, t) for k, shape, t in (
                    ("x_layer", (N, d), np.float32), ("x_ffn", (N, d), np.float32),
                    ("fired", (N, (n + 7) // 8), np.uint8), ("mag", (H, n), np.float32))})
        except BaseException:
            self.close()
            raise

    def _array(self, name: str, shape: tuple, dtype) -> np.ndarray:
        if self.folder is None:
            return np.zeros(shape, dtype)
        return np.lib.format.open_memmap(self.folder / f"{name}.npy", "w+", dtype, shape)

    def drop(self, i: int):
        """Layer i's samples gone (written): its files' maps closed and the files removed."""
        self.layers[i] = None
        if self.folder is not None:
            for f in self.folder.glob(f"{i}.*.npy"):
                f.unlink(missing_ok=True)

    def close(self):
        import shutil

        self.layers = []  # (the last references to the files' maps: they close here)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def profile_device(model) -> torch.device:
    """Where `profile(device="auto")` runs a model: a GPU torch sees with room for the model's
    weights and a window's work (a quarter again), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info()
    need = held_bytes(model) * 5 // 4 + (1 << 30)
    return torch.device("cuda" if need < free else "cpu")


FEW_TOKENS = 2048  # a profile of fewer is warned about


def profile(model_name: str, corpus: str, out: str | Path, opts: ProfileOptions = ProfileOptions(),
            dtype: str = "float32", progress: bool = True, device: str = "auto") -> Bundle:
    """Profile `model_name` over `corpus` into a new bundle at `out` (see the module's text);
    device: where the model runs ("auto": `profile_device`, a GPU that holds it, else the CPU;
    a device it cannot use is named before the model loads)."""
    t0 = time.perf_counter()
    dev = None if device == "auto" else named_device(device, "profiles run")
    model, tokenizer, path = load_model(model_name, torch_dtype(dtype))
    dev = dev or profile_device(model)
    if dev.type != "cpu":
        model.to(dev)
    model.setup_cache(1, opts.window)
    a = model.args
    text: Corpus = load_corpus(corpus, "calibration")
    windows = token_windows(tokenizer, text, opts.window, opts.tokens)
    total = sum(map(len, windows))
    if total < FEW_TOKENS:  # (6 tokens went through the whole pipeline, every step exit 0)
        log.warning("profiling %d tokens of %s: too few for firing statistics or predictors to "
                    "mean much (at least %d; give a longer text, or --tokens 0 for all of it)",
                    total, text.name, FEW_TOKENS)
    bundle = Bundle.create(out, model_record(path, a))  # a fresh manifest: no parts

    L, d, n = a.n_layers, a.dim, a.ffn_dim
    relu = is_relu_family(a.ffn_act)
    if relu:
        quantiles, thresholds = None, np.zeros(L, np.float32)
        given = [k for k in ("sparsity", "calib_tokens")
                 if getattr(opts, k) != getattr(ProfileOptions(), k)]
        if given:  # (they were ignored without a word)
            log.warning("%s: not used for a %s model, whose neurons' zeros are its own (they "
                        "set the thresholds of SwiGLU-family models)",
                        ", ".join(given), a.ffn_act)
    else:
        calib = token_windows(tokenizer, text, opts.window, opts.calib_tokens)
        quantiles, thresholds = calibrate_thresholds(model, calib, opts.sparsity, progress)

    N = min(opts.samples, total)
    H = max(1, int(N * opts.held_out))
    # float32 while profiling, written as float16 where that holds them (Gemma's residual stream
    # reaches past float16's range); in files beside the bundle where they would not fit in
    # SAMPLE_MEMORY
    store = _SampleStore(bundle.path, L, N, H, d, n)
    try:
        N, H = store.N, store.H
        rng = np.random.default_rng(opts.seed)
        picks = np.sort(rng.choice(total, N, replace=False))  # positions in the token stream
        counts = [torch.zeros(n, dtype=torch.float64, device=dev) for _ in range(L)]
        mass = [torch.zeros(n, dtype=torch.float64, device=dev) for _ in range(L)]
        cursor = {"start": 0, "row": 0}  # the current window's first stream position and sample row

        def on_w1(i, x_layer, x_ffn, gate, up):
            score, h = activate(a.ffn_act, gate, up)
            fired = score[0] > float(thresholds[i])  # (T, n)
            counts[i] += fired.sum(0, dtype=torch.float64)
            mass[i] += (h[0].abs() * fired).sum(0, dtype=torch.float64)
            start, row = cursor["start"], cursor["row"]
            T = fired.shape[0]
            lo, hi = np.searchsorted(picks, [start, start + T])
            if hi > lo:
                s = store.layers[i]
                pos = torch.from_numpy(picks[lo:hi] - start).to(dev)
                s["x_layer"][row:row + hi - lo] = x_layer[0, pos].float().cpu().numpy()
                s["x_ffn"][row:row + hi - lo] = x_ffn[0, pos].float().cpu().numpy()
                s["fired"][row:row + hi - lo] = np.packbits(fired[pos].cpu().numpy(), axis=1)
                first = max(row, N - H)  # the held-out rows among them: their |activation|
                if first < row + hi - lo:
                    p = pos[first - row:]
                    s["mag"][first - (N - H):row + hi - lo - (N - H)] = \
                        (h[0, p].abs() * fired[p]).float().cpu().numpy()

        def next_window(T):
            lo, hi = np.searchsorted(picks, [cursor["start"], cursor["start"] + T])
            cursor["start"] += T
            cursor["row"] += hi - lo

        _run(model, windows, on_w1, "profiling", progress, next_window)
        for i in tqdm(range(L), desc="writing samples", disable=not progress):
            s = store.layers[i]
            bundle.save_tensors(f"samples/layer_{i:03d}.safetensors",
                                {"x_layer": _compact(s["x_layer"]), "x_ffn": _compact(s["x_ffn"]),
                                 "fired": np.array(s["fired"]), "mag": _compact(s["mag"])})
            del s
            store.drop(i)
    finally:
        store.close()
    bundle.save_tensors("stats.safetensors",
                        {**{f"count.{i}": counts[i].cpu().numpy().astype(np.int64) for i in range(L)},
                         **{f"mass.{i}": mass[i].cpu().numpy() for i in range(L)}})
    th = {"threshold": thresholds}
    if quantiles is not None:
        th["quantiles"] = quantiles
    bundle.save_tensors("thresholds.safetensors", th)
    bundle.manifest.corpus = {**text.describe(), "tokens": total, "window": opts.window}
    bundle.mark("thresholds", {"kind": "natural zeros" if relu else "CATS |act(gate x)|",
                               "sparsity": None if relu else opts.sparsity,
                               "calib_tokens": None if relu else opts.calib_tokens})
    bundle.mark("samples", {"rows": N, "held_out": H, "seed": opts.seed})
    bundle.mark("stats", {"tokens": total, "dtype": dtype, "device": dev.type,
                          "seconds": round(time.perf_counter() - t0, 1)})
    return bundle
