"""What this CPU can run, read from the system without loading anything: the CPU kernel's
instruction-set classes and whether bf16 is native. Beside `errors` and `compat` at the bottom of
the library, so that a configuration is built and checked, and the command line parses, in a
process that never imports torch (the `powerinfer serve` driver)."""
from __future__ import annotations

ISAS = ("avx2", "avx512", "avx512bf16")  # the CPU kernel's classes, each a superset of the one before


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): there bf16 GEMMs beat
    fp32; elsewhere torch emulates bf16 and fp32 is faster."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:  # not Linux: assume the safe choice
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
