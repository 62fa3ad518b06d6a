"""User configuration: small frozen dataclasses validated on construction."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from .cpu import ISAS, bf16_arithmetic
from .errors import ConfigError

if TYPE_CHECKING:
    import torch

# a setting's declared type -> the Python types it takes and how an error names them (an int for
# a float; a bool for neither number)
_TYPES = {"bool": ((bool,), "true or false"), "int": ((int,), "an integer"),
          "float": ((int, float), "a number"), "str": ((str,), "a string"),
          "tuple": ((tuple, list), "a list")}


# the command line's help for the two settings (`powerinfer generate`, `powerinfer serve`)
DTYPE_HELP = ("auto (bf16 where the file's 4-bit blocks run on the CPU kernel or the CPU has "
              "native bf16, else fp32), float32 or bfloat16")


ISA_HELP = ("the CPU kernel's instruction-set class (auto: the best this CPU has; a lower one "
            "runs an older CPU's paths)")


INT4_DTYPES = ("bfloat16", "bf16", "float32", "fp32")  # the activations 4-bit weights run with


def gib(text: str) -> float:
    """The command line's type for an amount of memory in GiB: a finite number, at least 0 (float
    takes "nan" and "inf", which reached the placement's arithmetic as a traceback)."""
    import argparse

    v = float(text)  # (a ValueError: argparse says "invalid gib value")
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of GiB, at least 0")
    return v


# each name a setting takes -> torch's (a configuration is built without torch: the serve driver)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    import torch
    return getattr(torch, DTYPES[name])


def _triton_installed() -> bool:
    """Whether the `gpu` extra's Triton is importable here (its kernels read a 4-bit file's
    blocks on a GPU), without importing it."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def named_device(device: str, what: str):
    """The torch device an offline step was asked to run on (`profile`, `train_predictors`;
    `what` says what runs there, "profiles run"): the CPU or a GPU torch sees, else a
    ConfigError naming it."""
    import torch
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"device {device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"device {device!r}: {what} on the CPU or on a GPU torch sees"
                          f"{' (none here)' if dev.type == 'cuda' else ''}")
    return dev


def device_for(vram_budget_gb: float, device: str | None = None) -> str:
    """The device the front doors (`powerinfer serve`, the CLI, a served model's entry) give a
    model: the one asked for, else "auto" (the GPU where there is one) when a VRAM budget is
    given, which only a GPU can use, else "cpu"."""
    return device or ("auto" if vram_budget_gb > 0 else "cpu")


# what `cold_executors=0` cannot run, said where it is refused (here and by a group that finds a
# bundle beside the model, or a GPU)
ONE_EXECUTOR = ("cold_executors=0 (one executor with the whole model) runs a dense model on the "
                "CPU: a sparsity bundle, a GPU or a VRAM budget needs cold executors")


@dataclass(frozen=True, slots=True)
class Config:
    """How to run a model.

    vram_budget_gb: GPU memory the hot-neuron placement may use (read by the sparse runtime;
        the dense engine ignores it).
    cpu_threads: torch intra-op threads for CPU work (0: all cores of this process; with
        runtime "actors", per actor, at most one per core it is pinned to).
    dtype: compute dtype: "float32" (the reference), "bfloat16", or "auto" (default: bfloat16
        on a GPU, on a CPU with native bf16 instructions, and wherever the file's 4-bit blocks
        run on the CPU kernel (any `cpu_isa` class: its integer dot products never see the
        activations' type, and bf16 halves the KV cache's bytes); else float32).
    device: "cpu", "cuda" or "auto" (cuda when available).
    max_seq_len: positions a sequence may reach (0: the model's own context; a value only
        lowers it).
    max_batch: sequences running together (decoded in one step); how many fit is decided by
        the KV cache's free blocks.
    kv_cache_gb: memory of the paged KV cache, shared by every sequence of the model (0: auto,
        room for max_batch sequences of the whole context, capped at a quarter of the host's
        available memory; its pages are resident only once written).
    block_size: positions a KV cache block holds (16, 32 or 64).
    prefix_cache: reuse the cached blocks of a prompt's prefix (a shared system prompt, the
        turns of a chat) instead of computing them again.
    prefill_chunk: prompt tokens a step prefills at most, beside the decoding sequences (chunked
        prefill: a long prompt no longer stalls the running streams); 0: a prompt in one step.
    prefill_pace: while sequences decode, a step's prompt chunk is cut (down to 32 tokens) so
        that the step takes about this many times a decode step, timed as the model runs: the
        streams' gap between tokens grows by this factor at most while a long prompt is
        prefilled; 0: chunks of prefill_chunk tokens whatever they cost.
    compile: compile the decode step with torch.compile (slow first call, faster tokens).
    cuda_graphs: the actor runtime's hot executor on a GPU replays its decode step as CUDA
        graphs, one a stretch between its exchanges with the predictor and the cold executors
        (captured at a batch height's second step); False launches it op by op.
    runtime: "local" (in-process) or "actors" (the Ray actor runtime: scheduler, predictor,
        hot executor and `cold_executors` cold-neuron executors over shared memory).
    bundle: a sparsity bundle (`powerinfer profile` ...): with it, FFNs compute only the neurons
        its predictors mark active, and the solver's placement splits hot from cold.
    predictor: which trained predictor to run: "layer" (lookahead, overlapping attention),
        "ffn" (same layer) or "auto" (lookahead when trained).
    predictor_device: where the actor runtime's predictor runs beside a hot executor on a GPU:
        "auto" (on that GPU, the predictor input and masks in device buffers the two actors
        share through CUDA IPC; CuPy needed) or "cpu" (on its own cores, over host memory).
        Without a GPU it runs on the CPU either way.
    weights: "dense", "int4" (a GGUF file's Q4_0/Q4_1 projections stay 4-bit, and its Q4_K,
        Q5_K, Q6_K, Q5_0, Q5_1 and Q8_0 ones in their own bits, computed in bf16 or float32 on
        the CPU (bf16 on a GPU); a sparse FFN's neurons keep the file's 4-bit blocks, their down
        rows 8-bit; the output head is 8-bit), or "auto" (default: int4 on the CPU where it can
        run and the file has such projections, else dense; on a GPU, int4 for the actor
        runtime's hot executor where the Triton kernels are installed, dense for a model in one
        process; dtype "float32" asked for is the dense reference). On a GPU, int4 keeps a
        sparse FFN's neurons in those records and the projections (attention's, a dense FFN's,
        an untied head) in the file's Q4_0/Q4_1/Q8_0 blocks, read by the Triton kernels (the
        `gpu` extra); the placement counts them at those bytes (a 4-bit neuron about a third of
        bf16's, so about three times the hot neurons in a budget, and more for attention's share
        freed); the embedding is widened.
    cold_weights: the actor runtime's cold executors' weights (they run on the host's cores):
        "dense", "int4" (as `weights`), or "auto" (default: as `weights` on a CPU; beside a hot
        executor on a GPU, int4 wherever the host can run it, unless weights is "dense"). So a
        4-bit file's cold neurons stay 4-bit in host memory and are read as such, whatever the
        GPU holds.
    cold_executors: cold-neuron executor actors (runtime "actors"); 0: none, the hot executor
        runs the whole model on every core of the group as the in-process engine does (a
        dense model on the CPU: a process and its torch fewer, about 0.25 GiB a served model,
        at about 0.9x its tokens/s on two cores). The server chooses 0 for a model whose entry
        leaves it open where its groups would have more executors than cores
        (`serve_app.settings.share_cores`).
    cpu_isa: the instruction-set class the CPU kernel runs at, and that "auto" decides by:
        "auto" (the best this CPU has), or "avx2", "avx512", "avx512bf16" (each a superset of
        the one before) to hold it to a lower class than the CPU has (how a newer CPU runs, and
        tests, the paths of an older one; a class above the CPU's is a ConfigError at load).
        One class a process: the last model loaded sets it (the actor runtime's processes get
        the model's). POWERINFER_MAX_ISA (a class), set before a process starts, holds that
        process and those it starts as a CPU of that class would run, "auto" included. torch's
        own operators keep the CPU's instructions (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA,
        set before the process starts, hold those).
    cores: the cores the actor group's executors are planned on, as a cpulist ("0-15,32")
        (runtime "actors"; "": every core this process may use). Give each model of a host its
        own set (`powerinfer plan` lays them out) and their groups do not share cores.
    resources: Ray custom resources, ((name, amount), ...), that the node hosting the actor
        group must have (runtime "actors"): a model pinned to some hosts of a cluster.
    max_queue: requests waiting for a batch slot before new ones get an "overloaded" error.
    input_sparsity: activation sparsity in the projections' inputs (TEAL; `powerinfer
        calibrate-input`): "auto" (the bundle's thresholds where `bundle` has them), "off", or a
        bundle to take them from (alone: the FFNs stay dense). Decode steps of one row on the
        4-bit CPU path (weights="int4", a Q4_0/Q4_1 file or a Q4_K_M file's Q4_K projections)
        read only the input channels over
        each threshold; the prompt's rows stay dense. Off unless a bundle has them. Both
        runtimes: in the actor runtime each executor applies them to the projections it holds
        (its heads, its neurons), and a request's last event says what its steps kept.
    max_ppl_increase: a bundle whose evaluation (`powerinfer eval`) shows its predictors raising
        held-out perplexity by more than this share warns at load, as one never evaluated does.
    """

    vram_budget_gb: float = 0.0
    cpu_threads: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    max_seq_len: int = 0
    max_batch: int = 64
    kv_cache_gb: float = 0.0
    block_size: int = 16
    prefix_cache: bool = True
    prefill_chunk: int = 512
    prefill_pace: float = 3.0
    compile: bool = False
    cuda_graphs: bool = True
    runtime: str = "local"
    weights: str = "auto"
    cold_weights: str = "auto"
    bundle: str = ""
    predictor: str = "auto"
    predictor_device: str = "auto"
    cold_executors: int = 1
    max_queue: int = 64
    max_ppl_increase: float = 0.02
    cores: str = ""
    resources: tuple = ()
    cpu_isa: str = "auto"
    input_sparsity: str = "auto"

    def __post_init__(self):
        for f in fields(self):  # each setting of its declared type: "false" was true for a bool
            v, want = getattr(self, f.name), _TYPES.get(f.type)
            if want is not None and (not isinstance(v, want[0]) or
                                     (isinstance(v, bool) and bool not in want[0])):
                raise ConfigError(f"{f.name} must be {want[1]}, got {v!r}")
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got "
                              f"{self.dtype!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.runtime not in ("local", "actors"):
            raise ConfigError(f"runtime must be 'local' or 'actors', got {self.runtime!r}")
        if self.predictor not in ("auto", "layer", "ffn"):
            raise ConfigError(f"predictor must be auto, layer or ffn, got {self.predictor!r}")
        if self.predictor_device not in ("auto", "cpu"):
            raise ConfigError(f"predictor_device must be auto or cpu, got {self.predictor_device!r}")
        if self.cores and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", self.cores):
            raise ConfigError(f"cores must be a cpulist like '0-15,32', got {self.cores!r}")
        if self.cold_executors < 0 or self.max_queue < 1:
            raise ConfigError("cold_executors must be >= 0 and max_queue >= 1")
        if self.cold_executors == 0 and self.needs_cold_executors:
            raise ConfigError(ONE_EXECUTOR)
        for name in ("vram_budget_gb", "kv_cache_gb", "prefill_pace", "max_ppl_increase"):
            if not math.isfinite(getattr(self, name)):  # (a NaN passes every comparison below)
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if min(self.vram_budget_gb, self.cpu_threads, self.max_seq_len, self.max_ppl_increase) < 0:
            raise ConfigError("vram_budget_gb, cpu_threads, max_seq_len and max_ppl_increase "
                              "must be >= 0")
        for name in ("weights", "cold_weights"):
            if getattr(self, name) not in ("dense", "int4", "auto"):
                raise ConfigError(f"{name} must be 'dense', 'int4' or 'auto', got "
                                  f"{getattr(self, name)!r}")
        for name in ("weights", "cold_weights"):
            if getattr(self, name) == "int4" and self.dtype not in ("auto", *INT4_DTYPES):
                raise ConfigError(f"{name}='int4' runs in bfloat16 or float32, got dtype "
                                  f"{self.dtype!r}")
        if self.cpu_isa not in ("auto", *ISAS):
            raise ConfigError(f"cpu_isa must be 'auto' or one of {', '.join(ISAS)}, got "
                              f"{self.cpu_isa!r}")
        if self.max_batch < 1:
            raise ConfigError("max_batch must be >= 1")
        if self.block_size not in (16, 32, 64):
            raise ConfigError(f"block_size must be 16, 32 or 64, got {self.block_size}")
        if self.kv_cache_gb < 0 or self.prefill_chunk < 0:
            raise ConfigError("kv_cache_gb and prefill_chunk must be >= 0")
        if self.prefill_pace != 0 and self.prefill_pace <= 1:
            raise ConfigError(f"prefill_pace must be 0 (off) or over 1, got {self.prefill_pace}")

    @property
    def needs_cold_executors(self) -> bool:
        """What one executor with the whole model cannot run, as far as the configuration says
        (`ONE_EXECUTOR`): a sparsity bundle, a GPU named, or a VRAM budget."""
        return bool(self.bundle) or self.device == "cuda" or self.vram_budget_gb > 0

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype != "auto", "dtype 'auto' is decided by Config.resolve at load"
        return torch_dtype(self.dtype)

    def resolve(self, has_q4: bool, kquant: bool = False) -> "Config":
        """This configuration with "auto" decided for this machine and a model file (has_q4:
        it has Q4_0/Q4_1 projections; kquant: ones the CPU kernel reads in their own bits, a
        Q5_K_M or Q8_0 file's: `formats.gguf`'s "kquant_types"): the fastest setting that needs
        no warm-up, decided by the class the kernel runs at here (`kernels.cpu_class(cpu_isa)`):
        the 4-bit path (the file's blocks kept) on every class (AVX2 `maddubs`, AVX-512, VNNI),
        in bf16, where the file has them; bf16 dense where bf16 is native (avx512bf16), float32
        dense elsewhere. A GPU's int4 takes Q4_0/Q4_1 projections only. `cpu_isa` itself stays
        as asked: "auto" is each process's own best (an actor on another host of a cluster may
        have another), a class asked for is held everywhere."""
        import torch

        from . import kernels
        isa = kernels.cpu_class(self.cpu_isa)  # "none": the kernel does not run here
        on_gpu = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        native = bf16_arithmetic(isa)
        host_int4 = (has_q4 or kquant) and isa != "none"  # blocks the CPU kernel keeps
        dtype = self.dtype
        if dtype == "auto":
            four_bit = host_int4 and "dense" not in (self.weights, self.cold_weights)
            dtype = "bfloat16" if on_gpu or native or four_bit else "float32"
        beside_gpu = on_gpu and self.runtime == "actors"
        weights = self.weights
        if weights == "auto":  # (float32 asked for: the dense reference)
            if on_gpu:  # the hybrid's hot neurons in the file's 4-bit records where the Triton
                # kernels run (an H200: 1.88x the bf16 hybrid's tokens/s on a 70B shape's
                # blocks, its first token sooner); a whole model on one GPU stays bf16 (its
                # tokens/s 0.94x the blocks', its first token 5.8x sooner)
                four = beside_gpu and has_q4 and self.dtype in ("auto", "bfloat16")
                weights = "int4" if four and _triton_installed() else "dense"
            else:  # (the CPU's int4 runs in bf16 or float32; float16 asked for: dense)
                weights = "int4" if host_int4 and self.dtype in ("auto", "bfloat16") else "dense"
        if not on_gpu and self.runtime == "actors" and dtype == "float16":
            # (it loaded, and every step failed: the executors' split attention adds its heads'
            # shares in float32 through projections kept in bf16 or float32 only)
            raise ConfigError("dtype 'float16' runs on the CPU in the local runtime only; the "
                              "actor runtime takes bfloat16 or float32 there")
        if on_gpu and weights == "int4" and dtype != "bfloat16":
            raise ConfigError(f"weights='int4' runs in bfloat16 on a GPU, got dtype {dtype!r}")
        cold = self.cold_weights
        if cold == "auto":  # the host's share: int4 beside a GPU too, unless dense was asked for
            if on_gpu:
                host_q4 = has_q4 and isa != "none"  # (not K-quants: as a GPU's int4)
                cold = "int4" if beside_gpu and host_q4 and self.weights != "dense" \
                    and self.dtype in ("auto", "bfloat16") else "dense"
            else:
                cold = weights
        return replace(self, dtype=dtype, weights=weights, cold_weights=cold)

    def summary(self) -> str:
        """What a resolved configuration runs, in one line for the load's log: the CPU kernel's
        class, the activations' type, the weights (and the cold executors' where they differ)."""
        from . import kernels
        try:  # ("auto" on a host without a GPU: the CPU, not "a GPU")
            gpu = self.device != "cpu" and self.torch_device.type == "cuda"
        except ConfigError:
            gpu = False
        where = "a GPU" if gpu else "the CPU"
        line = (f"on {where}, CPU kernel {kernels.cpu_class(self.cpu_isa)}, {self.dtype} "
                f"activations, {self.weights} weights")
        if self.runtime == "actors" and self.cold_weights != self.weights:
            line += f" ({self.cold_weights} in the cold executors)"
        return line

    @property
    def torch_device(self) -> torch.device:
        """The device this process computes on; a typed error where "cuda" finds no device."""
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but this process sees no CUDA device "
                              "(torch.cuda.is_available() is False); use device='cpu' or 'auto'")
        return torch.device(self.device)
