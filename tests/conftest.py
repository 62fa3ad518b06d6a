"""Shared fixtures. No network: the hub is switched off before transformers is imported."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the torch-free actors' shard cache (`actors/shard_cache.py`) of this run alone, shared by its
# tests and the servers they start, removed at its end: the user's own cache is not touched
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "POWERINFER_SHARD_CACHE" not in os.environ:
    os.environ["POWERINFER_SHARD_CACHE"] = tempfile.mkdtemp(prefix="powerinfer-test-shards-")
    atexit.register(shutil.rmtree, os.environ["POWERINFER_SHARD_CACHE"], True)

import pytest  # noqa: E402


def _cpu_classes() -> list[str]:
    """Every instruction-set class the CPU kernel runs at on this CPU (`Config.cpu_isa`; each a
    superset of the one before), or none where it does not run."""
    from powerinfer import kernels
    return kernels.ISAS[:kernels.ISAS.index(kernels.best_isa()) + 1] if kernels.available() else []


CPU_CLASSES = _cpu_classes()


# A real model's tests that want float32 sums without its weights widened to float32: float32
# activations over the file's 4-bit blocks (the same kernel sums in process and in an actor
# group, and on every CPU class; SmolLM2 decodes ten times the tokens a second of the widened
# weights). The float32 references against transformers keep the widened weights.
FLOAT32_INT4 = dict(dtype="float32", weights="int4")


@pytest.fixture(scope="session")
def default_model_path():
    """Path of the default GGUF model (SmolLM2-135M-Instruct, Q4_1); skips if not installed."""
    from powerinfer.errors import ModelNotFoundError
    from powerinfer.formats.loader import DEFAULT_MODEL, resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def gemma_model_path():
    """Path of Gemma 3 270M (Q4_K_M GGUF, joined from its packages at setup); skips if not
    installed."""
    from powerinfer.errors import ModelNotFoundError
    from powerinfer.formats.loader import resolve_model

    try:
        return resolve_model("gemma3-270m")
    except ModelNotFoundError as e:
        pytest.skip(f"Gemma 3 270M not installed: {e}")


@pytest.fixture(scope="session")
def gemma_fp32(gemma_model_path):
    """Gemma 3 270M in the in-process engine, fp32 (the reference of the tests that use it)."""
    from powerinfer import Config, PowerInfer

    return PowerInfer.from_pretrained(gemma_model_path, Config(dtype="float32", weights="dense",
                                                                max_seq_len=1024, max_batch=2))


@pytest.fixture(scope="session")
def bundle(default_model_path, tmp_path_factory):
    """SmolLM2's small but complete bundle: profile, both predictors, a placement (0.2 GiB), its
    thresholds from the profile's own 1,024 tokens (the default's 8,192 took 23 of its 33 s);
    built on every thread, once for the modules that take it."""
    import torch

    from powerinfer.sparsity.profile import ProfileOptions, profile
    from powerinfer.sparsity.solver import solve_bundle
    from powerinfer.sparsity.train import train_predictors
    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        b = profile("smollm2-135m-instruct", "lee", tmp_path_factory.mktemp("rt") / "bundle",
                    ProfileOptions(tokens=1024, window=256, samples=1000, calib_tokens=2048),
                    progress=False)
        for inp in ("layer", "ffn"):
            train_predictors(b, inp, ranks=[64], epochs=4, progress=False)
        solve_bundle(b, 0.2, context=256)
    finally:
        torch.set_num_threads(before)
    return str(b.path)


@pytest.fixture(autouse=True, scope="module")
def _all_threads_again():
    """Each module starts with torch on the threads it started with: an engine made with
    `cpu_threads=1` sets the process's count, which every later module would inherit (the
    transformers oracle, the native loops and the kernels' tests ran on one core of two)."""
    import torch
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- where the suite's time goes
# Each module's wall time (its tests' setup, call and teardown), how busy it kept the machine's
# cores meanwhile (every process's CPU: its servers and actors too, from /proc/stat), and the CPU
# it ran on, at the end of every run: the suite must fit its time on every CPU class, and a CI
# log then says which modules took it there. The busy seconds are a floor: run in any order or
# side by side, the suite cannot take less than its cores' busy time (a module that keeps the
# cores half idle is one that waits, on a subprocess, a timeout or a single thread).
_MODULE_S: dict[str, float] = {}
_MODULE_BUSY: dict[str, list[int]] = {}  # module: [busy jiffies, all jiffies]
_STAT_AT_START: dict[str, tuple[int, int]] = {}


def pytest_runtest_logstart(nodeid, location):
    from powerinfer.cpu import machine_jiffies
    now = machine_jiffies()
    if now is not None:
        _STAT_AT_START[nodeid] = now


def pytest_runtest_logfinish(nodeid, location):
    from powerinfer.cpu import machine_jiffies
    start, now = _STAT_AT_START.pop(nodeid, None), machine_jiffies()
    if start is not None and now is not None:
        acc = _MODULE_BUSY.setdefault(nodeid.split("::", 1)[0], [0, 0])
        acc[0] += now[0] - start[0]
        acc[1] += now[1] - start[1]


def pytest_runtest_logreport(report):
    mod = report.nodeid.split("::", 1)[0]
    _MODULE_S[mod] = _MODULE_S.get(mod, 0.0) + report.duration


def _busy_share(mod: str) -> float | None:
    busy, every = _MODULE_BUSY.get(mod, (0, 0))
    return busy / every if every else None


def pytest_terminal_summary(terminalreporter):
    if not _MODULE_S:
        return
    from powerinfer.cpu import cpu_name
    tr = terminalreporter
    total = sum(_MODULE_S.values())
    held = f", held by POWERINFER_MAX_ISA={os.environ['POWERINFER_MAX_ISA']}" \
        if os.environ.get("POWERINFER_MAX_ISA") else ""
    tr.write_sep("=", f"time by module ({total:.0f} s in tests; {cpu_name()}, "
                      f"{len(os.sched_getaffinity(0))} cores, classes {', '.join(CPU_CLASSES)}"
                      f"{held})")
    busy_s = 0.0
    for mod, s in _MODULE_S.items():
        share = _busy_share(mod)
        busy_s += s * (share if share is not None else 1.0)
    for mod, s in sorted(_MODULE_S.items(), key=lambda kv: -kv[1])[:15]:
        share = _busy_share(mod)
        busy = f"  cores {100 * share:3.0f}% busy" if share is not None else ""
        tr.write_line(f"{s:8.1f} s  {100 * s / total:4.1f}%{busy}  {mod}")
    if _MODULE_BUSY:
        tr.write_line(f"the cores were busy for {busy_s:.0f} s of the {total:.0f} "
                      f"({100 * busy_s / total:.0f}%): no order or overlap of the same work takes "
                      "less than that")
