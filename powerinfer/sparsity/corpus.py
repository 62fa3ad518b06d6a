"""Calibration and evaluation text.

The built-in corpus "lee" is the Lee news corpus (Lee, Pincombe & Welsh 2005: 348 articles from
the Australian Broadcasting Corporation's news service) that the `gensim` package ships as test
data: `lee_background.cor` (299 articles) is the calibration part and `lee.cor` (49 other
articles) the held-out part. Only the two text files are read; gensim itself is never imported,
so it is installed without its dependencies (`pip install --no-deps gensim`).

Any UTF-8 text file works too: documents are separated by blank lines (or, if there are none, one
per line) and the last tenth of the documents is held out.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import PowerInferError

BUILTIN = {"lee": ("gensim", "gensim", "test/test_data", "lee_background.cor", "lee.cor")}


SPLITS = ("calibration", "held_out")


class CorpusError(PowerInferError):
    pass


@dataclass
class Corpus:
    name: str
    source: str  # where the text came from, for the bundle manifest
    split: str
    documents: list[str]

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "split": self.split,
                "documents": len(self.documents)}


def load_corpus(name_or_file: str, split: str = "calibration") -> Corpus:
    if split not in SPLITS:
        raise CorpusError(f"unknown corpus split {split!r} (one of {', '.join(SPLITS)})")
    if name_or_file in BUILTIN:
        module, package, folder, calib, held = BUILTIN[name_or_file]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(f"corpus {name_or_file!r} is shipped by the package {package}; "
                              f"install it with: pip install --no-deps {package}")
        path = Path(list(spec.submodule_search_locations)[0]) / folder / (
            calib if split == "calibration" else held)
        if not path.is_file():
            raise CorpusError(f"the installed {package} lacks {folder}/{path.name}")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # lee.cor is in Windows-1252 (its pound signs)
            text = raw.decode("cp1252")
        docs = [line.strip() for line in text.splitlines() if line.strip()]
        return Corpus(name_or_file, f"{package} {_version(package)}: {folder}/{path.name}", split, docs)
    path = Path(name_or_file)
    if not path.is_file():
        raise CorpusError(f"corpus {name_or_file!r} is neither a file nor a built-in corpus "
                          f"({', '.join(BUILTIN)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"corpus file {path} is not UTF-8 text ({e})") from None
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if len(docs) < 2:
        docs = [line.strip() for line in text.splitlines() if line.strip()]
    if len(docs) < 2:
        raise CorpusError(f"corpus file {path} has fewer than two documents; nothing to hold out")
    cut = len(docs) - max(1, len(docs) // 10)
    return Corpus(path.name, str(path.name), split, docs[:cut] if split == "calibration" else docs[cut:])


def token_windows(tokenizer, corpus: Corpus, window: int, max_tokens: int = 0) -> list[list[int]]:
    """Concatenate the documents (each starting with BOS when the model uses one) and cut the
    stream into windows of `window` tokens; the last partial window is kept if it is long."""
    stream: list[int] = []
    for doc in corpus.documents:
        stream += tokenizer.encode(doc + "\n\n", parse_special=False)
        if max_tokens and len(stream) >= max_tokens:
            stream = stream[:max_tokens]
            break
    out = [stream[i:i + window] for i in range(0, len(stream), window)]
    if len(out) > 1 and len(out[-1]) < window // 4:
        out.pop()
    return out


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"
