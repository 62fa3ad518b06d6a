"""The neuron-aware CPU FFN kernel (`csrc/`): its build, its weight formats and their packing.
The GPU's Triton kernels are this package's `triton_ffn`, `triton_attention` and `triton_linear`.

One decode step of a neuron set reads, for each selected neuron, its gate and up rows once from a
neuron-major record ([gate][up][down row], see `csrc/neuron_ffn.h`), applies the activation and
the firing threshold, and adds its down row scaled by the activation into per-thread partial
outputs, which are then summed: no gathered copies, no per-neuron Python. The neurons are a
pipeline: the gate rows of one neuron are read beside the up rows of the one before (only if its
gate lets it fire) and the down rows of the one before that (only if it fired), with the next
rows prefetched, so a core keeps its memory busy across short rows. The weights stay in their
format (f32, bf16, int8 with a per-row scale, GGUF's Q4_0, Q4_1 and Q8_0 blocks) and, where they
are large, on 2 MiB pages (`huge_empty`). The C++ is compiled once per machine by `build()`
(`make` runs it at setup) with g++ into a torch operator library; AVX-512 with bf16 dot products,
AVX-512 or AVX2 is chosen when it loads.

With the block formats (Q4_0, Q4_1, Q8_0) the gate/up dot products run in integers over the input
quantized to 8 bits per block of 32 (`quantize_input`, as ggml does); bf16 rows meet the input
rounded to bf16 (as ggml's bf16 dot products do); `dot_input` gives the input as each format
sees it. The down rows are always added in float. The torch path (`sparse.NeuronSet` without a format) is the reference it is
tested against.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ..cpu import COUNTS, ISAS, LOOP_MODES, LOOP_PHASES, loop_times  # noqa: F401 - (re-exported)
from ..errors import ConfigError
from ..formats import kquants
from ..formats.kquants import q4_k_codes, q5_k_codes, q6_k_codes

log = logging.getLogger("powerinfer")


FORMATS = ("f32", "bf16", "i8", "q4_0", "q4_1", "q8_0")


ACTS = ("relu", "reglu", "dreglu", "swiglu", "geglu", "gelu")  # csrc/neuron_ffn.h's Act


SRC = Path(__file__).parent / "csrc"


MAX_ROWS = 64  # rows per kernel call (csrc/neuron_ffn.h's MAXB)


# per translation unit: the instruction sets it is compiled for
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"]


LITE = "ops.cpp (lite)"  # the torch-free build's unit: ops.cpp with -DPOWERINFER_LITE (see lite_path)
UNITS = {"ops.cpp": [], "neuron_ffn_avx512bf16.cpp": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
         "neuron_ffn_avx512.cpp": _AVX512, "neuron_ffn_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"]}


_GGML = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
         "q8_0": GGMLQuantizationType.Q8_0}


# formats whose rows are plain tensors (f16: the GPU's Triton kernels only)
PLAIN_FORMATS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


_loaded: str | None = None  # the library's path once loaded


Q4_FORMATS = ("q4_0", "q4_1")


def down_format(fmt: str) -> str:
    """The format of a neuron's down row: Q8_0 beside 4-bit gate/up rows (a 4-bit file's blocks
    run along the other axis of the down matrix: 4 bits again would round twice), else `fmt`."""
    return "q8_0" if fmt in Q4_FORMATS else fmt


def record_bytes(fmt: str, dim: int, gated: bool) -> int:
    """Bytes of one neuron's record."""
    return (2 if gated else 1) * row_bytes(fmt, dim) + row_bytes(down_format(fmt), dim)


def row_bytes(fmt: str, dim: int) -> int:
    return {"f32": 4 * dim, "bf16": 2 * dim, "f16": 2 * dim, "i8": 4 + dim, "q4_0": dim // 32 * 18,
            "q4_1": dim // 32 * 20, "q8_0": dim // 32 * 34}[fmt]


def _ext_dir() -> Path:
    here = Path(__file__).parent / "_ext"
    try:
        here.mkdir(exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    return Path.home() / ".cache" / "powerinfer" / "ext"


def _library_path() -> Path:
    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(SRC.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    for unit, flags in UNITS.items():
        h.update((unit + " ".join(flags)).encode())
    name = f"neuron_ffn-{h.hexdigest()[:12]}.so"
    # one built beside the package (an image builds it there, then runs as a user who cannot
    # write there) is used as it is
    shipped = Path(__file__).parent / "_ext" / name
    return shipped if shipped.exists() else _ext_dir() / name


def lite_path(path: Path) -> Path:
    """The torch-free build beside the library at `path` (csrc/lite.h: the same ops over a
    stand-in for the parts of ATen they use, with the C entry points only), which a cold executor
    without torch loads (`actors/cold_native.py`)."""
    return path.with_name(path.name.replace("neuron_ffn-", "neuron_ffn_lite-"))


def build() -> Path:
    """Compile the kernel library for this torch if it is not built yet, and its torch-free
    build beside it (`lite_path`); returns the library's path. Safe to call from several
    processes at once (one builds, the others wait)."""
    out = _library_path()
    if out.exists() and lite_path(out).exists():
        return out
    from torch.utils import cpp_extension  # (setuptools with it: 5 MiB a process that loads)

    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("building the CPU FFN kernel needs a C++ compiler (g++)")
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists() and lite_path(out).exists():
            return out
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        inc = [f"-I{p}" for p in cpp_extension.include_paths()]
        common = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            def compile_unit(unit):
                lite = unit == LITE
                src = "ops.cpp" if lite else unit
                obj = Path(tmp) / ("ops_lite.o" if lite else unit + ".o")
                extra = ["-DPOWERINFER_LITE"] if lite else inc if unit == "ops.cpp" else UNITS[unit]
                cmd = [cxx, *common, *extra, "-c", str(SRC / src), "-o", str(obj)]
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError(f"compiling {unit} failed:\n{run.stderr[-4000:]}")
                return str(obj)

            def link(objs, so, libs):
                run = subprocess.run([cxx, "-shared", "-fopenmp", *objs, *libs, "-o", str(so)],
                                     capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError(f"linking the CPU FFN kernel failed:\n{run.stderr[-4000:]}")

            log.info("building the CPU FFN kernel (once per machine and torch version)")
            units = [*UNITS, LITE]
            with ThreadPoolExecutor(len(units)) as pool:
                objs = dict(zip(units, pool.map(compile_unit, units)))
            lib = cpp_extension.library_paths()[0]
            kernels = [objs[u] for u in UNITS if u != "ops.cpp"]
            so, so_lite = Path(tmp) / out.name, Path(tmp) / lite_path(out).name
            link([objs["ops.cpp"], *kernels], so,
                 [f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10"])
            link([objs[LITE], *kernels], so_lite, [])
            os.replace(so_lite, lite_path(out))
            os.replace(so, out)
        for old in [*out.parent.glob("neuron_ffn-*.so"), *out.parent.glob("neuron_ffn_lite-*.so")]:
            if old not in (out, lite_path(out)):  # builds for other sources or torches
                old.unlink(missing_ok=True)
    return out


def available() -> bool:
    """Load the kernel (building it if needed) once; False where it cannot run here."""
    global _loaded
    if _loaded is None:
        try:
            path = build()
            torch.ops.load_library(str(path))
            # shapes for torch.compile's tracing: (B, dim) float32, like x
            torch.library.register_fake("powerinfer::neuron_ffn")(
                lambda x, w, sel, keep, bias, threshold, act, fmt: torch.empty_like(x))
            torch.library.register_fake("powerinfer::records_rows")(
                lambda x, w, bias, threshold, act, fmt: torch.empty_like(x))
            torch.library.register_fake("powerinfer::predicted_ffn")(
                lambda x, p, fc1, fc2, pred_fmt, pred_threshold, w, bias, threshold, act, fmt:
                torch.empty_like(x))
            torch.library.register_fake("powerinfer::linear")(
                lambda x, w, fmt: x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32))
            torch.library.register_fake("powerinfer::linear_x16")(
                lambda x, w, n, layout: x.new_empty(*x.shape[:-1], n))
            torch.library.register_fake("powerinfer::pred_logits")(
                lambda p, fc1, fc2, fmt: p.new_empty(p.shape[0], fc2.shape[0] * (16 if fmt < 0 else 1),
                                                     dtype=torch.float32))
            torch.library.register_fake("powerinfer::linear_q4c")(
                lambda x, w, n, kind, threshold, stats: x.new_empty(*x.shape[:-1], n))
            torch.library.register_fake("powerinfer::rms_norm")(lambda x, w, eps: torch.empty_like(x))
            torch.library.register_fake("powerinfer::qk_norm")(
                lambda qkv, qw, kw, n_heads, n_kv, eps: torch.empty_like(qkv))
            torch.library.register_fake("powerinfer::ch_send")(
                lambda parts, base, capacity, op, layer, extra:
                torch.empty_like(parts[0], memory_format=torch.contiguous_format))
            torch.library.register_fake("powerinfer::ch_recv")(
                lambda like, state, base, width, spin_us:
                like.new_empty(*like.shape[:-1], width, dtype=torch.float32))
            torch.library.register_fake("powerinfer::paged_attention")(
                lambda qkv, cos, sin, k, v, tables, starts, pos, n_heads, window, scale:
                qkv.new_empty(qkv.shape[0], n_heads * k.shape[2]))
            torch.library.register_fake("powerinfer::widen_out")(lambda w, fmt, rows, dim, out: None)
            torch.library.register_fake("powerinfer::widen")(
                lambda w, fmt, rows, dim: w.new_empty(w.shape[0], rows, dim, dtype=torch.float32))
            _loaded = str(path)
            _warn_of_a_cap_that_holds_nothing()
            if torch.ops.powerinfer.isa() == "none":
                log.warning("the CPU FFN kernel needs AVX2 and FMA; the torch path runs instead")
                _loaded = ""
        except (RuntimeError, OSError) as e:
            log.warning("the CPU FFN kernel is unavailable (%s); the torch path runs instead", e)
            _loaded = ""
    return bool(_loaded)


def _warn_of_a_cap_that_holds_nothing():
    """POWERINFER_MAX_ISA (a class), set before a process starts, makes the library report that
    class as this CPU's best (csrc/ops.cpp, `pick_isa`): the process and those it starts run as
    on a CPU of that class, `auto` included. A value that is not a class, or one above this
    CPU's, holds nothing: named here in a warning, as a POWERINFER_PREFETCH that is not a
    level (`prefetch_level`) and a POWERINFER_FAR_PREFETCH that is not a setting
    (`far_prefetch`)."""
    pf = os.environ.get("POWERINFER_PREFETCH", "")
    if pf and pf not in ("l1", "l2"):
        log.warning("POWERINFER_PREFETCH=%r is not l1 or l2: ignored (the CPU's vendor picks %r)",
                    pf, torch.ops.powerinfer.prefetch_level(""))
    far = os.environ.get("POWERINFER_FAR_PREFETCH", "")
    if far and far not in FAR_PREFETCH:
        log.warning("POWERINFER_FAR_PREFETCH=%r is not one of %s: ignored (the CPU's vendor picks "
                    "%r)", far, ", ".join(FAR_PREFETCH), torch.ops.powerinfer.far_prefetch(""))
    cap = os.environ.get("POWERINFER_MAX_ISA", "")
    if cap and cap not in ISAS:
        log.warning("POWERINFER_MAX_ISA=%r is not one of %s: ignored", cap, ", ".join(ISAS))
    elif cap and torch.ops.powerinfer.best_isa() != cap:
        log.warning("POWERINFER_MAX_ISA=%r: this CPU runs at most %r, which it runs", cap,
                    torch.ops.powerinfer.best_isa())


def library(lite: bool = False) -> str:
    """The kernel library's path once loaded (lite: its torch-free build's, `lite_path`), or ""
    where it does not run here."""
    if not available():
        return ""
    return str(lite_path(Path(_loaded))) if lite else _loaded


def isa() -> str:
    """The instruction set the kernel runs with here ("avx512", "avx2"), or "none"."""
    return torch.ops.powerinfer.isa() if available() else "none"


def best_isa() -> str:
    """The best instruction set this CPU offers the kernel, or "none"."""
    return torch.ops.powerinfer.best_isa() if available() else "none"


def cpu_class(cap: str = "auto") -> str:
    """The instruction-set class the kernel runs at when held to `cap` ("auto": the best this
    CPU has; else one of ISAS): "none" where the kernel does not run here; a ConfigError for a
    class this CPU lacks."""
    best = best_isa()
    if cap == "auto" or best == "none":
        if cap != "auto":
            raise ConfigError(f"cpu_isa={cap!r}: the CPU kernel does not run here (it needs an "
                              "x86 CPU with AVX2 and FMA, and g++ to build it)")
        return best
    if cap not in ISAS:
        raise ConfigError(f"cpu_isa must be 'auto' or one of {', '.join(ISAS)}, got {cap!r}")
    if ISAS.index(cap) > ISAS.index(best):
        raise ConfigError(f"cpu_isa={cap!r}: this CPU runs at most {best!r}")
    return cap


def hold(cap: str = "auto") -> str:
    """Run the kernel at `cpu_class(cap)` in this process from now on; returns that class."""
    got = cpu_class(cap)
    if got != "none":
        torch.ops.powerinfer.use_isa(got)
    return got


def q4c_walk(walk: str) -> str:
    """How the kernel's VNNI bodies walk a Q4 q4c matrix in this process from now on: "runs"
    (quad by quad, each four channels' runs read in order; the default) or "passes" (pass by
    pass, a block's runs side by side: the AVX2 and avx512 bodies' walk), for a benchmark's
    baseline; the same floats either way. Returns the walk before."""
    return torch.ops.powerinfer.q4c_walk(walk)


def prefetch_level(level: str = "") -> str:
    """Where the kernel's weight walks ask for the lines they read next in this process from now
    on: "l1" (into every level of the caches) or "l2" (into L2; the dense GEMVs ask twice), for a
    benchmark's baseline; "" leaves it. The CPU's vendor picks it at load (Intel's cores "l2",
    others "l1"), `POWERINFER_PREFETCH=l1|l2` overrides that. The same floats either way.
    Returns the level before."""
    return torch.ops.powerinfer.prefetch_level(level)


FAR_PREFETCH = ("none", "acts", "downs", "both")


def far_prefetch(which: str = "") -> str:
    """Which of the records kernel's walks also ask, into L2, for the rows they read two passes
    ahead, in this process from now on: "none", "acts" (the gate and up rows), "downs" (the
    down rows) or "both", for a benchmark's baseline; "" leaves it. The CPU's vendor picks it at
    load (Intel's cores "both", others "none"), `POWERINFER_FAR_PREFETCH` overrides that. The
    same floats whatever the setting. Returns the setting before."""
    return torch.ops.powerinfer.far_prefetch(which)


def loop_profile(mode: str = "read") -> dict:
    """The native loops' time by phase in this process (`hot_layers` and its attention steps,
    or a cold executor's `cold_serve`), for benchmarks: "start" zeroes and starts the count (two
    clock reads a phase while on), "read" reads it, "stop" reads and stops it. Returns {"calls":
    hot_layers calls, phase: seconds (a count for `COUNTS`)} (`LOOP_PHASES`), the totals before
    the call; empty where the kernel library is not loaded."""
    if not available():
        return {}
    return loop_times(torch.ops.powerinfer.loop_profile(LOOP_MODES[mode]).tolist())


HUGE_MIN_BYTES = 4 << 20  # smaller tensors stay where torch puts them


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in fresh anonymous memory marked for 2 MiB pages (madvise
    MADV_HUGEPAGE; Linux's transparent huge pages back it at first touch where they are enabled
    or set to "madvise"), for weights a decode step streams through: with 4 KiB pages each
    neuron's short rows cross page boundaries where the hardware prefetchers start over and the
    TLB misses; measured 20.5 against 17.3 GB/s reading 10% of a 7B layer's records on one core
    (and 30 against 25 GB/s for one long stream). Small tensors come from torch.empty."""
    n = math.prod(shape) * dtype.itemsize
    if n < HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared memory has no THP)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=n).view(dtype).view(shape)


def huge(t: torch.Tensor) -> torch.Tensor:
    """t, moved to 2 MiB pages if it is large enough (see `huge_empty`); a CPU tensor only."""
    if t.nbytes < HUGE_MIN_BYTES or t.device.type != "cpu":
        return t
    out = huge_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def quantize_rows(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """(n, dim) float weights -> (n, row_bytes) uint8 in `fmt` (for Q4_0/Q4_1/Q8_0 the blocks
    that the gguf package's quantizer, and llama.cpp's, would write: `kquants.blocks32`), on
    w's device."""
    n, dim = w.shape
    assert dim % 32 == 0 or fmt in PLAIN_FORMATS, dim  # (blocks of 32)
    if n == 0:
        return torch.empty(0, row_bytes(fmt, dim), dtype=torch.uint8, device=w.device)
    if fmt in PLAIN_FORMATS:  # the same numbers: a view of w's storage when it already has the type
        return w.detach().to(PLAIN_FORMATS[fmt]).contiguous().view(torch.uint8).reshape(n, -1)
    w = w.detach().float()
    if fmt == "i8":
        scale = w.abs().amax(1, keepdim=True) / 127
        q = torch.where(scale > 0, w / scale.clamp_min(1e-30), 0).round().clamp(-127, 127).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], 1)
    if fmt not in _GGML:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    return kquants.blocks32(w, _GGML[fmt].name)  # (on w's device)


def dequantize_rows(b: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """(n, row_bytes) uint8 in `fmt` -> (n, dim) float32: the weights the kernel computes with."""
    n = b.shape[0]
    b = b.contiguous()
    if n == 0:
        return torch.empty(0, dim)
    if fmt == "f32":
        return b.view(torch.float32).reshape(n, dim).clone()
    if fmt in ("bf16", "f16"):
        return b.view(PLAIN_FORMATS[fmt]).reshape(n, dim).float()
    if fmt == "i8":
        return b[:, 4:].view(torch.int8).float() * b[:, :4].contiguous().view(torch.float32)
    return kquants.dequantize(b.cpu().numpy(), _GGML[fmt].name, dim)


def split_rows(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """(n, row_bytes) rows of GGUF Q4_0/Q4_1 blocks -> the same bytes as a record holds them: each
    row's nibbles (16 bytes a block, block after block), then its f16 scales, then (Q4_1) its f16
    minimums (csrc/neuron_ffn.h: one load then serves four blocks, one conversion 16 scales)."""
    n, bb = rows.shape[0], row_bytes(fmt, 32)
    b = rows.reshape(n, rows.shape[1] // bb, bb)
    parts = [b[:, :, bb - 16:], b[:, :, :2]] + ([b[:, :, 2:4]] if fmt == "q4_1" else [])
    return torch.cat([p.reshape(n, p.shape[1] * p.shape[2]) for p in parts], 1)


def join_rows(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """`split_rows` undone: a record's 4-bit rows as GGUF blocks."""
    n, bb = rows.shape[0], row_bytes(fmt, 32)
    nb = rows.shape[1] // bb
    nib = rows[:, :16 * nb].reshape(n, nb, 16)
    heads = [rows[:, 16 * nb + 2 * nb * i:16 * nb + 2 * nb * (i + 1)].reshape(n, nb, 2)
             for i in range(bb // 2 - 8)]
    return torch.cat(heads + [nib], 2).reshape(n, nb * bb)


def pack(gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows (k, dim) of gate (None for plain ReLU), up and the transposed down -> the kernel's
    neuron-major records (k, record_bytes) uint8. Gate and up rows may come already in `fmt`
    (uint8, a file's own blocks). 4-bit rows are held split (`split_rows`)."""
    rows = [r if r.dtype == torch.uint8 else quantize_rows(r, fmt) for r in (gate, up)
            if r is not None]
    if fmt in Q4_FORMATS:
        rows = [split_rows(r, fmt) for r in rows]
    rows.append(quantize_rows(down_t, down_format(fmt)))
    dev = up.device  # (the records go where the rows were: a file's own blocks may be elsewhere)
    rows = [r.to(dev) for r in rows]
    shape = (rows[0].shape[0], sum(r.shape[1] for r in rows))
    out = huge_empty(shape, torch.uint8) if dev.type == "cpu" else torch.empty(shape, dtype=torch.uint8, device=dev)
    return torch.cat(rows, 1, out=out)


def widen(w: torch.Tensor, fmt: str, rows: int, dim: int) -> torch.Tensor:
    """Records of `rows` rows each in `fmt` (the last in `down_format` unless it is the only one:
    a plain matrix), (n, bytes) -> (n, rows, dim): a view for f32 and bf16, else widened to
    float32 (by the kernel library where it is loaded)."""
    if fmt in PLAIN_FORMATS:
        return w.view(PLAIN_FORMATS[fmt]).view(w.shape[0], rows, dim)
    if w.device.type != "cpu":  # records on a GPU: widened there
        from . import triton_ffn
        return triton_ffn.widen(w, fmt, rows, dim)
    if _loaded:
        return torch.ops.powerinfer.widen(w.contiguous(), FORMATS.index(fmt), rows, dim)
    rb, last = row_bytes(fmt, dim), fmt if rows == 1 else down_format(fmt)
    lead = (lambda r: join_rows(r, fmt)) if fmt in Q4_FORMATS else (lambda r: r)  # noqa: E731
    return torch.stack([dequantize_rows(lead(w[:, r * rb:(r + 1) * rb]), fmt, dim) for r in range(rows - 1)]
                       + [dequantize_rows(w[:, (rows - 1) * rb:], last, dim)], 1)


def widen_into(w: torch.Tensor, fmt: str, rows: int, dim: int, out: torch.Tensor) -> torch.Tensor:
    """`widen` written into out (a contiguous float32 or bf16 tensor of (n, rows, dim) values,
    bf16 rounded to nearest even), which a many-token step reuses chunk after chunk: a fresh
    tensor's first touch of its pages cost more than the widening. Returns out viewed (n, rows, dim)."""
    out = out.view(w.shape[0], rows, dim)
    if fmt in PLAIN_FORMATS or w.device.type != "cpu" or not _loaded:
        return out.copy_(widen(w, fmt, rows, dim))
    torch.ops.powerinfer.widen_out(w.contiguous(), FORMATS.index(fmt), rows, dim, out)
    return out


def widened(w: torch.Tensor, fmt: str, rows: int, dim: int, dtype: torch.dtype, budget: int):
    """(lo, hi, records lo:hi widened to (hi - lo, rows, dim) in dtype) over w's records, `budget`
    bytes of widened rows at a time (16 records at least), each chunk written into this
    thread's one reused buffer (`scratch`): valid until the next chunk is asked for."""
    n = w.shape[0]
    step = max(16, budget // (rows * dim * dtype.itemsize))
    buf = scratch(min(step, n) * rows * dim, dtype, w.device)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        yield lo, hi, widen_into(w[lo:hi], fmt, rows, dim, buf[:(hi - lo) * rows * dim])


_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A buffer of at least `numel` values of `dtype` on `device`, this thread's, reused by every
    call (the next call may hand out the same memory: use it before calling again)."""
    held = getattr(_scratch, "buffers", None)
    if held is None:
        held = _scratch.buffers = {}
    key = (dtype, torch.device(device))
    buf = held.get(key)
    if buf is None or buf.numel() < numel:
        buf = held[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def unpack(w: torch.Tensor, fmt: str, dim: int, gated: bool):
    """The kernel's records -> (gate or None, up, down_t), each (k, dim) (see `widen`)."""
    t = widen(w, fmt, 3 if gated else 2, dim)
    return (t[:, 0] if gated else None), t[:, -2], t[:, -1]


Q4X16_BLOCK = 320  # bytes of one block of 32 weights of 16 rows (see csrc/neuron_ffn.h)


def pack_q4x16(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """An (n, k) 4-bit matrix as `quant.q4_split` gives it (q in 0..15; per block of 32 a scale d
    and zero z: w = d * (q - 8) + z) -> (ceil(n / 16), k / 32 * 320) uint8 in the kernel's q4x16
    layout: per group of 16 rows and block, their 16 f16 scales, 16 f16 offsets m = z - 8 d (a
    Q4_0 block's m = -8 d exactly; a Q4_1 block's own m), then the 16 rows' 4-byte runs of
    nibbles side by side. Rows past n (up to a multiple of 16) are zero."""
    n, k = q.shape
    assert k % 32 == 0 and scale.shape == zero.shape == (n, k // 32), (q.shape, scale.shape)
    nb, groups = k // 32, -(-n // 16)
    pad = groups * 16 - n
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(groups, 16, nb, 32)
    d = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad))
    m = torch.nn.functional.pad(zero.float() - 8 * scale.float(), (0, 0, 0, pad))
    halves = lambda t: t.view(groups, 16, nb).transpose(1, 2).half().contiguous().view(torch.uint8)
    out = huge_empty((groups, nb, Q4X16_BLOCK), torch.uint8)
    return torch.cat([halves(d), halves(m), _runs(q)], -1, out=out).view(groups, nb * Q4X16_BLOCK)


def _runs(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes (groups, 16, nb, 32) of 16 rows' blocks of 32 -> (groups, nb, 256): per block
    the q4x16 layout's four 64-byte vectors of nibble runs (row i's bytes 4k..4k+3 at 4i in vector
    k; a byte's low nibble weight t, its high one t + 16, GGUF's order in a block)."""
    groups, _, nb, _ = q.shape
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # (groups, 16, nb, 16)
    return nibbles.view(groups, 16, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 256)


LAYOUTS = ("q4x16", "q4kx16", "q6kx16", "q8x16", "q5kx16", "q5x16")  # csrc/neuron_ffn.h's Layout


Q4KX16_SB, Q5KX16_SB, Q6KX16_SB = 2368, 2880, 3360  # bytes of one super-block (256 weights) of 16 rows


Q8X16_BLOCK = 544  # bytes of one block of 32 weights of 16 rows


Q5X16_BLOCK = 384  # (q4x16's and its 64 bytes of fifth bits)


def group_bytes(layout: str, dim: int) -> int:
    """Bytes of one group of 16 rows of `dim` columns in `layout`."""
    return {"q4x16": dim // 32 * Q4X16_BLOCK, "q4kx16": dim // 256 * Q4KX16_SB,
            "q5kx16": dim // 256 * Q5KX16_SB, "q6kx16": dim // 256 * Q6KX16_SB,
            "q8x16": dim // 32 * Q8X16_BLOCK, "q5x16": dim // 32 * Q5X16_BLOCK}[layout]


def _group_rows(raw: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """A K-quant matrix's bytes (n, nsb * block) -> (groups, 16, nsb, block), zero rows padding n
    to a multiple of 16 (their d is 0: they sum to 0)."""
    n, nsb = raw.shape[0], raw.shape[1] // block
    assert raw.dtype == torch.uint8 and raw.shape[1] == nsb * block, (raw.dtype, raw.shape, block)
    groups = -(-n // 16)
    raw = torch.nn.functional.pad(raw, (0, 0, 0, groups * 16 - n))
    return raw.view(groups, 16, nsb, block), groups, nsb


def _by_row(t: torch.Tensor) -> torch.Tensor:
    """(groups, 16, nsb, k, ...) -> (groups, nsb, k, 16, ...): one byte (or half) per row, row 0
    first, for each of the super-block's k entries."""
    return t.movedim(1, 3).contiguous()


def pack_q4kx16(raw: torch.Tensor) -> torch.Tensor:
    """Q4_K rows as a GGUF file stores them, (n, dim / 256 * 144) uint8 -> (ceil(n / 16),
    dim / 256 * 2368) uint8 in the kernel's q4kx16 layout (csrc/neuron_ffn.h): the same codes,
    6-bit scales and minimums, and fp16 d and dmin, regrouped 16 rows at a time."""
    b, groups, nsb = _group_rows(raw, 144)
    dd = _by_row(b[..., 0:4].reshape(groups, 16, nsb, 2, 2))  # (groups, nsb, 2, 16, 2): d, dmin
    sc, mn, codes = q4_k_codes(b)
    # per sub-block: its 16 rows' scales, their minimums, its nibble runs
    subs = torch.cat([_by_row(sc), _by_row(mn),
                      _runs(codes.reshape(groups, 16, nsb * 8, 32)).view(groups, nsb, 8, 256)], -1)
    out = huge_empty((groups, nsb, Q4KX16_SB), torch.uint8)
    return torch.cat([dd.reshape(groups, nsb, 64), subs.reshape(groups, nsb, 2304)], -1,
                     out=out).view(groups, nsb * Q4KX16_SB)


def pack_q5kx16(raw: torch.Tensor) -> torch.Tensor:
    """Q5_K rows as a GGUF file stores them, (n, dim / 256 * 176) uint8 -> (ceil(n / 16),
    dim / 256 * 2880) uint8 in the kernel's q5kx16 layout (csrc/neuron_ffn.h): q4kx16's with
    each sub-block's low 4 bits as its nibble runs, then a 64-byte vector of the fifth bits
    (byte p: from bit 0, those at byte p of low vector 0, high vector 0, ..., high vector 3)."""
    b, groups, nsb = _group_rows(raw, 176)
    dd = _by_row(b[..., 0:4].reshape(groups, 16, nsb, 2, 2))  # (groups, nsb, 2, 16, 2): d, dmin
    sc, mn, codes = q5_k_codes(b)
    q = codes.reshape(groups, 16, nsb * 8, 32)
    runs = _runs(q & 15).view(groups, nsb, 8, 256)
    subs = torch.cat([_by_row(sc), _by_row(mn), runs, _fifth(q).view(groups, nsb, 8, 64)], -1)
    out = huge_empty((groups, nsb, Q5KX16_SB), torch.uint8)
    return torch.cat([dd.reshape(groups, nsb, 64), subs.reshape(groups, nsb, 2816)], -1,
                     out=out).view(groups, nsb * Q5KX16_SB)


def _fifth(q: torch.Tensor) -> torch.Tensor:
    """5-bit codes (groups, 16, nb, 32) of 16 rows' blocks of 32 -> (groups, nb, 64): per block
    the vector of their fifth bits (`_runs`' weight 4k + j of row i, low vector k, and 16 + 4k
    + j, high vector k, at byte 4i + j: bits 2k and 2k + 1)."""
    groups, _, nb, _ = q.shape
    top = (q >> 4).view(groups, 16, nb, 2, 4, 4)  # row, block, low/high, k, j
    bits = (top << (2 * torch.arange(4, dtype=torch.uint8).view(4, 1)
                    + torch.arange(2, dtype=torch.uint8).view(2, 1, 1))).sum(3).sum(3)
    return bits.to(torch.uint8).permute(0, 2, 1, 3).reshape(groups, nb, 64)


def pack_q5x16(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """Q5_0 or Q5_1 rows as a GGUF file stores them, (n, dim / 32 * 22 or 24) uint8 ->
    (ceil(n / 16), dim / 32 * 384) uint8 in the kernel's q5x16 layout (csrc/neuron_ffn.h):
    q4x16's f16 scales d and offsets m (Q5_0's m = -16 d exactly, Q5_1's its own) and nibble
    runs of each block's low 4 bits, then the vector of their fifth bits."""
    size = 22 if kind == "Q5_0" else 24
    b, groups, nb = _group_rows(raw, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (groups, 16, nb, 1)
    m = -16 * d if kind == "Q5_0" else b[..., 2:4].contiguous().view(torch.float16).float()
    at = size - 20  # qh (a little-endian uint32: bit j the fifth bit of weight j), then qs
    qh = b[..., at:at + 4].contiguous().view(torch.int32)  # (groups, 16, nb, 1)
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    qs = b[..., at + 4:at + 20]
    q = torch.cat([qs & 15, qs >> 4], -1) | (high.to(torch.uint8) << 4)  # (groups, 16, nb, 32)

    def halves(t):  # (groups, 16, nb, 1) -> (groups, nb, 32): row 0 first
        return t.view(groups, 16, nb).transpose(1, 2).half().contiguous().view(torch.uint8)
    out = huge_empty((groups, nb, Q5X16_BLOCK), torch.uint8)
    return torch.cat([halves(d), halves(m), _runs(q & 15), _fifth(q)], -1,
                     out=out).view(groups, nb * Q5X16_BLOCK)


def pack_q6kx16(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K rows as a GGUF file stores them, (n, dim / 256 * 210) uint8 -> (ceil(n / 16),
    dim / 256 * 3360) uint8 in the kernel's q6kx16 layout (csrc/neuron_ffn.h): the same 6-bit
    codes, int8 scales and fp16 d, regrouped 16 rows at a time."""
    b, groups, nsb = _group_rows(raw, 210)
    q = q6_k_codes(b).view(groups, 16, nsb * 8, 32)
    runs = _runs(q & 15).view(groups, nsb * 8, 4, 16, 4)  # vector k, row i, byte j
    top = (q >> 4).view(groups, 16, nsb * 8, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # blk, k, i, j, lo/hi
    top = top.reshape(groups, nsb * 8, 2, 2, 64, 2)  # vector pair (k 0-1, 2-3), k within, byte p
    fields = top[:, :, :, 0, :, 0] | (top[:, :, :, 0, :, 1] << 2) | (top[:, :, :, 1, :, 0] << 4) \
        | (top[:, :, :, 1, :, 1] << 6)  # (groups, nblocks, 2, 64)
    blocks = torch.cat([runs.reshape(groups, nsb, 8, 256), fields.reshape(groups, nsb, 8, 128)], -1)
    d = _by_row(b[..., 208:210].reshape(groups, 16, nsb, 1, 2)).reshape(groups, nsb, 32)
    sc = _by_row(b[..., 192:208]).reshape(groups, nsb, 256)
    out = huge_empty((groups, nsb, Q6KX16_SB), torch.uint8)
    return torch.cat([d, sc, blocks.reshape(groups, nsb, 3072)], -1, out=out).view(groups, nsb * Q6KX16_SB)


def pack_q8x16(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 rows as a GGUF file stores them, (n, dim / 32 * 34) uint8 -> (ceil(n / 16),
    dim / 32 * 544) uint8 in the kernel's q8x16 layout (csrc/neuron_ffn.h): per block of 32
    weights of 16 rows, their fp16 d, then eight 64-byte vectors of codes (row i's codes 4k..4k+3
    at 4i in vector k), each code q + 128 as an unsigned byte."""
    b, groups, nb = _group_rows(raw, 34)
    d = _by_row(b[..., 0:2].reshape(groups, 16, nb, 1, 2)).reshape(groups, nb, 32)
    q = (b[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # (groups, 16, nb, 32)
    codes = q.view(groups, 16, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 512)
    out = huge_empty((groups, nb, Q8X16_BLOCK), torch.uint8)
    return torch.cat([d, codes], -1, out=out).view(groups, nb * Q8X16_BLOCK)


def pack_kquant(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 or Q5_1 matrix's bytes (n, row bytes) in its 16-row
    layout (KQUANT_LAYOUTS)."""
    if kind in ("Q5_0", "Q5_1"):
        return pack_q5x16(raw, kind)
    return {"Q4_K": pack_q4kx16, "Q5_K": pack_q5kx16, "Q6_K": pack_q6kx16,
            "Q8_0": pack_q8x16}[kind](raw)


def linear_x16(x: torch.Tensor, w: torch.Tensor, n: int, layout: str) -> torch.Tensor:
    """x (..., k) float32 or bfloat16 -> (..., n) in x's type = x W^T for W of n rows packed in
    `layout` (q4x16, q4kx16, q6kx16), over x rounded to 8 bits per block (`quantize_input`),
    MAX_ROWS rows a call."""
    op, code = torch.ops.powerinfer.linear_x16.default, LAYOUTS.index(layout)
    x = x.contiguous()
    if x.numel() <= MAX_ROWS * x.shape[-1]:
        return op(x, w, n, code)
    rows = x.reshape(-1, x.shape[-1])
    y = torch.cat([op(rows[r:r + MAX_ROWS], w, n, code) for r in range(0, rows.shape[0], MAX_ROWS)])
    return y.view(*x.shape[:-1], n)


def linear_q4x16(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """x (..., k) float32 or bfloat16 -> (..., n) in x's type = x W^T for W packed by
    `pack_q4x16` (`linear_x16`)."""
    return linear_x16(x, w, n, "q4x16")


def q4c_rows(n: int) -> int:
    """Rows a q4c matrix of n rows holds: n up to a multiple of 128, its passes (csrc/neuron_ffn.h)."""
    return -(-n // 128) * 128


def pack_q4c(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """An (n, k) 4-bit matrix as `quant.q4_split` gives it (q in 0..15; per block of 32 a scale d
    and zero z: w = d * (q - 8) + z) -> (bytes, offsets): the kernel's q4c layout
    (csrc/input_sparse.h), which keeps each input channel's weights together so that an
    input-sparse product (`linear_q4c`) reads only the channels in use. The same codes, f16
    scales and offsets as `pack_q4x16`; the offsets m = z - 8 d are kept only where some z is not
    0 (Q4_1; a Q4_0 block's w = d * (q - 8)). Rows past n (to a multiple of 64) are zero."""
    n, k = q.shape
    assert k % 32 == 0 and scale.shape == zero.shape == (n, k // 32), (q.shape, scale.shape)
    offsets = bool((zero != 0).any())
    m = (zero.float() - 8 * scale.float()).half() if offsets else None
    return _pack_q4c(q, scale.float().half(), m), offsets


# a q4c matrix's kind, by its code (csrc: Q4CKind); q6_k: a Q6_K matrix's 6-bit codes (`q6kc_of_q6kx16`)
Q4C_KINDS = ("q4_0", "q4_1", "q4_k", "q6_k")


def _by_block(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(n, blocks) values a row -> (blocks, rows * itemsize) bytes: each block's rows in order,
    the rows past n zero."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0])).t().contiguous().view(torch.uint8)


def _q4c_runs(q: torch.Tensor, rows: int) -> torch.Tensor:
    """q (n, k) 4-bit codes -> (k / 32, 16 rows) bytes: each block's 32 channel runs, a 64-byte
    line a pass of 128 rows: byte 16 L + 4 m + t holds row 16 m + 4 L + t of the pass in its low
    nibble and that row + 64 in its high one (csrc/input_sparse.h)."""
    n, k = q.shape
    nb = k // 32
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, rows - n))
    # (rows, k) -> (nb, 32 channels, passes, nibble u, m, L, t) for row 128 pass + 64 u + 16 m + 4 L + t
    c = q.view(rows, nb, 32).permute(1, 2, 0).reshape(nb, 32, rows // 128, 2, 4, 4, 4)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 1, 2, 4, 3, 5).reshape(nb, 16 * rows)


def _pack_q4c(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """q (n, k) codes, d and m (n, k / 32) f16 (m None: Q4_0's -8 d) -> the q4c bytes."""
    n, k = q.shape
    rows = q4c_rows(n)
    parts = [_by_block(d, rows)] + ([_by_block(m, rows)] if m is not None else []) + [_q4c_runs(q, rows)]
    out = huge_empty((k // 32, sum(p.shape[1] for p in parts)), torch.uint8)
    return torch.cat(parts, 1, out=out).view(-1)


def _pack_q4kc(q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor,
               dmin: torch.Tensor) -> torch.Tensor:
    """q (n, k) codes, sc and mn (n, k / 32) uint8 (each block's 6-bit scale and minimum), d and
    dmin (n, k / 256) f16 (each super-block's) -> the bytes of a Q4_K q4c matrix: the blocks'
    regions, then per super-block its rows' d and dmin."""
    n, k = q.shape
    rows = q4c_rows(n)
    regions = torch.cat([_by_block(sc, rows), _by_block(mn, rows), _q4c_runs(q, rows)], 1)
    tail = torch.cat([_by_block(d, rows), _by_block(dmin, rows)], 1)  # (k / 256, 4 rows)
    out = huge_empty((regions.numel() + tail.numel(),), torch.uint8)
    return torch.cat([regions.view(-1), tail.view(-1)], out=out)


def _of_groups(t: torch.Tensor, n: int) -> torch.Tensor:
    """Values of 16-row groups, (groups, ..., 16) with one value a row last -> (n, ...) flattened
    per row: each row's values in order (the inverse of `_by_row`'s grouping)."""
    groups = t.shape[0]
    return t.reshape(groups, -1, 16).transpose(1, 2).reshape(groups * 16, -1)[:n]


def _codes_of_runs(runs: torch.Tensor, n: int) -> torch.Tensor:
    """The q4x16 layout's nibble runs, (groups, blocks, 256) bytes (see `_runs`: vector j of a
    block holds row i's bytes 4j..4j+3 at 4i) -> the 4-bit codes (n, blocks * 32)."""
    groups, nb = runs.shape[0], runs.shape[1]
    r = runs.reshape(groups, nb, 4, 16, 4).permute(0, 3, 1, 2, 4).reshape(groups * 16, nb, 16)
    return torch.cat([r & 0xF, r >> 4], -1).reshape(groups * 16, nb * 32)[:n]


def q4c_of_q4x16(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, bool]:
    """A matrix packed by `pack_q4x16` -> the same codes, scales and offsets in the q4c layout
    (`pack_q4c`), without widening: the f16 values as they are."""
    b = packed.view(packed.shape[0], k // 32, Q4X16_BLOCK)
    d, m = (_of_groups(b[:, :, lo:lo + 32].contiguous().view(torch.float16), n) for lo in (0, 32))
    offsets = not torch.equal(m.float(), -8 * d.float())  # Q4_0's m is -8 d exactly
    return _pack_q4c(_codes_of_runs(b[:, :, 64:], n), d, m if offsets else None), offsets


def q4kc_of_q4kx16(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A Q4_K matrix packed by `pack_q4kx16` -> the same codes, 6-bit scales and minimums and f16
    d and dmin in the q4c layout (kind q4_k: csrc/input_sparse.h), without widening: 4.625 bits
    a weight, as q4kx16."""
    groups, nsb = packed.shape[0], k // 256
    sb = packed.reshape(groups, nsb, Q4KX16_SB)
    d, dmin = (_of_groups(sb[:, :, lo:lo + 32].contiguous().view(torch.float16), n) for lo in (0, 32))
    subs = sb[:, :, 64:].reshape(groups, nsb * 8, 288)  # per block: 16 scales, 16 minimums, runs
    sc, mn = _of_groups(subs[..., 0:16], n), _of_groups(subs[..., 16:32], n)
    return _pack_q4kc(_codes_of_runs(subs[..., 32:], n), sc, mn, d, dmin)


def _q6c_runs(q: torch.Tensor, rows: int) -> torch.Tensor:
    """q (n, k) 6-bit codes -> (k / 32, 24 rows) bytes: each block's 32 runs of the low 4 bits as
    `_q4c_runs` lays them, then 32 runs of the top 2 bits, 32 bytes a pass: byte i holds, from
    bit 0, those of the low and the high nibble's codes at byte i of the pass's line, then at
    byte i + 32 (csrc/input_sparse.h)."""
    n, k = q.shape
    nb = k // 32
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, rows - n))
    low = _q4c_runs(q & 0xF, rows)
    # (nb, 32 channels, passes, u, m, L, t) as in _q4c_runs -> (.., u, byte 32 j + i of the line)
    top = (q >> 4).view(rows, nb, 32).permute(1, 2, 0).reshape(nb, 32, rows // 128, 2, 4, 4, 4)
    top = top.permute(0, 1, 2, 3, 5, 4, 6).reshape(nb, 32, rows // 128, 2, 2, 32)
    shift = torch.tensor([[0, 4], [2, 6]], dtype=torch.uint8).view(2, 2, 1)  # by (u, j)
    packed = (top << shift).sum(dim=(3, 4), dtype=torch.uint8).reshape(nb, 8 * rows)
    return torch.cat([low, packed], -1)


def q6kc_of_q6kx16(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A Q6_K matrix packed by `pack_q6kx16` -> the same 6-bit codes, 8-bit scales (one a row per
    16 channels) and f16 super-block scales in the q4c layout (kind q6_k: csrc/input_sparse.h),
    without widening: 6.5625 bits a weight, as q6kx16."""
    groups, nsb = packed.shape[0], k // 256
    sb = packed.reshape(groups, nsb, Q6KX16_SB)
    d = _of_groups(sb[:, :, 0:32].contiguous().view(torch.float16), n)  # (n, k / 256)
    sc = _of_groups(sb[:, :, 32:288].reshape(groups, nsb * 16, 16), n)  # (n, k / 16) int8 bytes
    blocks = sb[:, :, 288:].reshape(groups, nsb * 8, 384)
    low = _codes_of_runs(blocks[..., :256], n)
    # the top 2 bits: byte 4i + t of the first vector holds those of weights t, 16 + t, 4 + t,
    # 20 + t of row i (bits 0, 2, 4, 6), the second of 8 + t, 24 + t, 12 + t, 28 + t
    h0, h1 = (blocks[..., lo:lo + 64].reshape(groups, nsb * 8, 16, 4) for lo in (256, 320))
    top = torch.stack([h0, h0 >> 4, h1, h1 >> 4, h0 >> 2, h0 >> 6, h1 >> 2, h1 >> 6], 3) & 3
    top = top.reshape(groups, nsb * 8, 16, 32).permute(0, 2, 1, 3).reshape(groups * 16, k)[:n]
    q = low | (top << 4)
    rows = q4c_rows(n)
    regions = torch.cat([_by_block(sc[:, 0::2], rows), _by_block(sc[:, 1::2], rows),
                         _q6c_runs(q, rows)], 1)
    tail = _by_block(d, rows)  # (k / 256, 2 rows)
    out = huge_empty((regions.numel() + tail.numel(),), torch.uint8)
    return torch.cat([regions.view(-1), tail.view(-1)], out=out)


def linear_q4c(x: torch.Tensor, w: torch.Tensor, n: int, kind: int, threshold: float,
               stats: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., k) float32 or bfloat16 -> (..., n) in x's type = x' W^T for W of n rows packed by
    `pack_q4c`, `q4kc_of_q4kx16` or `q6kc_of_q6kx16`, where x' is x with every entry of
    magnitude <= threshold set to 0 (input sparsity: those channels' weights are not read),
    rounded to 8 bits per block as the q4x16 product rounds its input. kind: the matrix's
    (`Q4C_KINDS`: 0 Q4_0, 1 Q4_1: `pack_q4c`'s `offsets`; 2 Q4_K; 3 Q6_K), checked against its
    size. Each row keeps its own channels. `stats`
    (int64, 2), where given, gains the channels kept and the channels seen."""
    op, kind = torch.ops.powerinfer.linear_q4c.default, int(kind)
    x = x.contiguous()
    if x.numel() <= MAX_ROWS * x.shape[-1]:
        return op(x, w, n, kind, threshold, stats)
    rows = x.reshape(-1, x.shape[-1])
    y = torch.cat([op(rows[r:r + MAX_ROWS], w, n, kind, threshold, stats)
                   for r in range(0, rows.shape[0], MAX_ROWS)])
    return y.view(*x.shape[:-1], n)


INTEGER_DOTS = ("q4_0", "q4_1", "q8_0")  # formats whose dot products run in integers


def quantize_input(x: torch.Tensor) -> torch.Tensor:
    """The input (..., dim) as the kernel's dot products see it with a block format
    (INTEGER_DOTS): 8 bits per block of 32 with scale max|x| / 127, rounded half away from zero
    (ggml's activation rounding), widened back to float32."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    v = b * torch.where(d != 0, 1 / d, 0)
    t = torch.trunc(v)
    r = v - t  # exact: no rounding of v + 0.5 (0.49999997 + 0.5 is 1.0)
    q = t + (r >= 0.5).float() - (r <= -0.5).float()
    return (q * d).reshape(x.shape)


def dot_input(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The input (..., dim) as format `fmt`'s dot products see it, in float32: quantized per
    block for the block formats (`quantize_input`), rounded to bf16 for bf16 rows (native bf16
    products where the CPU has them, and the same values on every instruction set), else x."""
    if fmt in INTEGER_DOTS:
        return quantize_input(x)
    return x.bfloat16().float() if fmt == "bf16" else x.float()


TRITON_ON_CPU = False  # run the GPU's Triton kernels on CPU tensors (tests, TRITON_INTERPRET=1)


def on_triton(t: torch.Tensor) -> bool:
    """Whether neuron sets and predictors over tensors like `t` run on the Triton kernels
    (`triton_ffn`): on a GPU where Triton is installed, or on the CPU with TRITON_ON_CPU."""
    if t.device.type == "cpu" and not TRITON_ON_CPU:
        return False
    from . import triton_ffn
    return triton_ffn.available(t.device)


def format_for(weight: torch.Tensor, q4_type: str | None = None) -> str | None:
    """The kernel format for neuron sets made from weights like `weight` (its dtype and device):
    the file's 4-bit type when it is kept (q4_type "Q4_0"/"Q4_1"), else the weights' own
    precision; on a GPU the Triton kernels' (`triton_ffn.format_for`); None (the torch path)
    for float16 on a CPU, or where no kernel runs."""
    if weight.device.type != "cpu" or TRITON_ON_CPU:
        from . import triton_ffn
        return triton_ffn.format_for(weight, q4_type)
    if not usable(weight):
        return None
    if q4_type is not None:  # (or "Q8_0": a file's 8-bit blocks, kept as they are)
        return q4_type.lower()
    return next((f for f, dt in PLAIN_FORMATS.items() if dt == weight.dtype and f in FORMATS), None)


def usable(t: torch.Tensor) -> bool:
    """Whether the kernel can compute with tensors like `t` here (on the CPU, library loaded)."""
    return t.device.type == "cpu" and available()


def linear(x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
    """x (B, dim) float32 or bfloat16, B <= MAX_ROWS; w (n, row_bytes) rows in `fmt` (a plain
    bf16 or f32 matrix is its own rows: pass it as it is) -> (B, n) float32 = x W^T, reading
    each row once (x as `dot_input` gives it)."""
    return torch.ops.powerinfer.linear(x.contiguous(), _as_rows(w, fmt), FORMATS.index(fmt))


def _as_rows(w: torch.Tensor, fmt: str) -> torch.Tensor:
    # rows in `fmt` as the kernel takes them: uint8 records or groups, or a plain bf16/f32
    # matrix's bytes
    if w.dtype != torch.uint8:
        assert w.dtype == PLAIN_FORMATS[fmt] and w.is_contiguous(), (w.dtype, fmt)
        w = w.view(torch.uint8)
    return w


def neuron_ffn(x: torch.Tensor, w: torch.Tensor, sel: torch.Tensor, keep: torch.Tensor | None,
               bias: torch.Tensor | None, threshold: float, act: str, fmt: str) -> torch.Tensor:
    """x (B, dim) float32 or bfloat16; w the (k, bytes) records; sel the neurons to compute:
    (m,) int64 indices, or a (k,) bool mask; keep per-row masks or None: (B, m) bool with
    indices, (B, k) with a mask; bias (k,) float32 or None -> (B, dim) in x's type (summed in
    float32, rounded once)."""
    if x.shape[0] > MAX_ROWS:  # the kernel keeps a row's sums in registers: MAX_ROWS at a time
        return torch.cat([neuron_ffn(x[r:r + MAX_ROWS], w, sel,
                                     None if keep is None else keep[r:r + MAX_ROWS], bias,
                                     threshold, act, fmt) for r in range(0, x.shape[0], MAX_ROWS)])
    return torch.ops.powerinfer.neuron_ffn(x, w, sel, keep, bias, float(threshold),
                                           ACTS.index(act), FORMATS.index(fmt))


def records_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, threshold: float,
                 act: str, fmt: str) -> torch.Tensor:
    """x (T, dim) float32 or bfloat16; w the (k, bytes) records -> (T, dim) in x's type: every
    record for every row (a prompt step over a neuron set: the records a block at a time,
    multiplied as matrices, csrc/records_rows.h), summed in float32 and rounded once. A bfloat16
    x with 4-bit records has its gate and up products in integers over x quantized to 8 bits (as
    the q4x16 GEMV), and with AVX-512 BF16 its down rows rounded to bf16 (as on AMX's tiles); a
    float32 x is multiplied in float32. A row's answer is the same floats whatever rows share the
    call."""
    return torch.ops.powerinfer.records_rows(x, w, bias, float(threshold), ACTS.index(act),
                                             FORMATS.index(fmt))


def pred_code(fmt: str) -> int:
    """The kernel's code of a predictor's matrices' format: a row format's index in FORMATS
    (plain bf16 or f32 rows), or -1 - its index in LAYOUTS for 16-row groups (q8x16)."""
    return FORMATS.index(fmt) if fmt in FORMATS else -1 - LAYOUTS.index(fmt)


def pred_logits(p: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, fmt: str) -> torch.Tensor:
    """A predictor's logits relu(p fc1^T) fc2^T for p (B, dim) float32 or bfloat16, B <=
    MAX_ROWS, its matrices in `fmt` (plain bf16 or f32 rows, or q8x16 groups: `pack_q8x16` of
    their Q8_0 rows) -> (B, ffn_dim) float32: the logits the native loops pick neurons from."""
    return torch.ops.powerinfer.pred_logits(p, _as_rows(fc1, fmt), _as_rows(fc2, fmt), pred_code(fmt))


def predicted_ffn(x: torch.Tensor, p: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                  pred_fmt: str, pred_threshold: float, w: torch.Tensor, bias: torch.Tensor | None,
                  threshold: float, act: str, fmt: str) -> torch.Tensor:
    """A decode step of every neuron of a layer's records w with a predictor, in one call: the
    rows of x (B, dim) with B <= MAX_ROWS; p (B, dim) the predictor's input; fc1 (r, dim) and
    fc2 (k, r) its matrices in pred_fmt (see `pred_logits`); each row's neurons are those whose
    logit relu(p fc1^T) fc2^T is >= pred_threshold -> (B, dim) in x's type, as
    `neuron_ffn(x, w, union, rows, ...)` over `pred_logits` gives it."""
    assert x.shape[0] <= MAX_ROWS, x.shape
    return torch.ops.powerinfer.predicted_ffn(
        x, p, _as_rows(fc1, pred_fmt), _as_rows(fc2, pred_fmt), pred_code(pred_fmt),
        float(pred_threshold), w, bias, float(threshold), ACTS.index(act), FORMATS.index(fmt))
