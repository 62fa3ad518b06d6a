"""`python -m powerinfer.kernels`: build the CPU kernel now (make's setup step)."""
import logging
import sys

from . import build, isa

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
print(build())
print("kernel ISA here:", isa())
