"""What this CPU can run, read from the system without loading anything: the CPU kernel's
instruction-set classes and whether bf16 is native. Beside `errors` and `compat` at the bottom of
the library, so that a configuration is built and checked, and the command line parses, in a
process that never imports torch (the `powerinfer serve` driver)."""
from __future__ import annotations

import functools

ISAS = ("avx2", "avx512", "avx512bf16")  # the CPU kernel's classes, each a superset of the one before

# the native loops' phases (csrc/ops.cpp, prof::Phase), in order: `hot_layers`' ...
LOOP_PHASES = ("norms", "sends to the executors", "q/k/v projection",
               "RoPE, new keys and values placed", "attention over the cache", "output projection",
               "waits for the executors' attention", "their attention added", "FFN",
               "waits for the executors' FFN", "their FFN added", "predictor input and masks",
               # ... and a cold executor's (`cold_serve`; its attention answers hold the
               # projections and attention above)
               "cold: waits for messages", "cold: attention answered", "cold: FFN answered",
               "cold: head rows answered",
               # (within its waits: warming the records of the predictor's newest masks, and
               # how many records it warmed, a count)
               "cold: warming records ahead", "cold: records warmed")
COUNTS = {"cold: records warmed"}  # loop_profile's entries that count, not nanoseconds
LOOP_MODES = {"read": 0, "start": 1, "stop": 2}  # loop_profile's modes, as the library codes them


def loop_times(totals: list[int]) -> dict:
    """The library's loop_profile totals (nanoseconds per phase in `LOOP_PHASES`' order, then
    the hot_layers calls) as {"calls": calls, phase: seconds (a count for `COUNTS`)}."""
    return {"calls": totals[-1], **{name: v if name in COUNTS else v / 1e9
                                    for name, v in zip(LOOP_PHASES, totals)}}


@functools.cache
def last_level_cache() -> int:
    """Bytes of the CPU's largest cache (sysfs, read once; 32 MiB where it does not say): a
    server CPU's L3 holds hundreds of MiB (300-480 MiB on the Xeons this project was measured
    on, more on an EPYC with stacked cache)."""
    import glob
    best = 0
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(f).read().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return best or 32 * 2**20


@functools.cache
def cpu_name() -> str:
    """The CPU's model name as Linux reports it (a VM's may be generic, "AMD EPYC"), else what
    `platform` says: the name the benchmarks and the test suite's summary record beside their
    figures."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def machine_jiffies() -> tuple[int, int] | None:
    """(busy, all) clock ticks of every core since boot, from /proc/stat's first line (busy: less
    idle and iowait), or None where there is no /proc/stat: what the benchmarks and the test
    suite's summary read around a run to tell how busy the machine's cores were."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def bf16_arithmetic(isa: str) -> bool:
    """Whether bf16 is computed natively at kernel class `isa` (`kernels.cpu_class`; "none":
    where the kernel does not run, as the CPU's flags say)."""
    return isa == "avx512bf16" or (isa == "none" and native_bf16())


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): there bf16 GEMMs beat
    fp32; elsewhere torch emulates bf16 and fp32 is faster."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:  # not Linux: assume the safe choice
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
