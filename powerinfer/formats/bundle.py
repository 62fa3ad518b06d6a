"""The sparsity bundle: what the offline pipeline writes next to a model and the engine reads.

A bundle is a directory:

    manifest.json                   format, version, model (file, sha256, shapes), corpus, settings,
                                    and the parts written so far with their settings
    stats.safetensors               count.{i} (ffn_dim,) int64  tokens on which neuron fired
                                    mass.{i}  (ffn_dim,) float64 sum over tokens of |activation|
    thresholds.safetensors          threshold (n_layers,) float32: a neuron fires when
                                    |act(gate x)| > threshold (0 for ReLU-family models)
    samples/layer_{i:03d}.safetensors   predictor training samples of layer i, N rows:
                                    x_layer (N, dim) f16   the layer input (pre-norm residual; f32 where f16 cannot hold it)
                                    x_ffn   (N, dim) f16   the residual entering the FFN (pre-norm; f32 likewise)
                                    fired   (N, ceil(ffn_dim/8)) uint8  np.packbits(mask, axis=1)
                                    mag     (N, ffn_dim) f16  |activation|, held-out rows only
                                    (the last `held_out` rows of the file; see manifest)
    predictors.{input}.safetensors  fc1.{i} (r_i, dim), fc2.{i} (ffn_dim, r_i), f32;
                                    input is "ffn" or "layer"; active when fc2 relu(fc1 x) >= 0
    predictors.{input}.json         per-layer table: rank, recall by count and by mass, precision
    placement.safetensors           hot.{i} (ffn_dim,) uint8: 1 = neuron lives on the GPU
    placement.json                  budget, byte breakdown, objective, gap, solve time, greedy

Every file is written to a temporary name and renamed into place, and the manifest is updated
last, so an interrupted run leaves the previous state of the bundle intact.

The same folder beside the model (`<model>.bundle/`) holds the model's converted copy where it has
block types the CPU kernel cannot read (`model.convert`); the records here say where that copy
lives and which file it was made from (`converted_from`, `original_of`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from ..errors import PowerInferError

log = logging.getLogger("powerinfer")


BUNDLE_SUFFIX = ".bundle"


FORMAT, VERSION = "powerinfer-bundle", 1


class BundleError(PowerInferError):
    def __init__(self, path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"sparsity bundle {path}: {problem}")

    def __reduce__(self):  # pickled as its arguments: raised again as itself across processes
        return type(self), (self.path, self.problem)


@dataclass
class Manifest:
    model: dict  # file, sha256, size, arch, n_layers, dim, ffn_dim, ffn_act
    corpus: dict = field(default_factory=dict)  # name, source, split, tokens
    settings: dict = field(default_factory=dict)  # per part: the options it was made with
    parts: list[str] = field(default_factory=list)  # stats, thresholds, samples, predictors.*, placement
    format: str = FORMAT
    version: int = VERSION
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))


# what a manifest's fields hold: a damaged or hand-edited manifest is named, field by field
# (it was a KeyError or TypeError wherever the field was first read)
_FIELDS = {"model": dict, "corpus": dict, "settings": dict, "parts": list, "format": str,
           "version": int, "created": str}
_MODEL_FIELDS = {"file": str, "n_layers": int}  # (each reader needs them; the others, where
_MODEL_TYPES = {"sha256": str, "size": int, "dim": int, "ffn_dim": int}  # present, are typed)
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer",
               float: "a number", bool: "true or false", type(None): "null"}


def _is(value, kind: type | tuple) -> bool:
    if isinstance(kind, tuple):  # ((int, float): a number)
        return any(_is(value, k) for k in kind)
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _expected(kind: type | tuple) -> str:
    return "a number" if kind == (int, float) else _JSON_NAMES[kind]


def _kind(value) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _manifest(path: Path, raw) -> Manifest:
    """The manifest in `raw` (manifest.json's contents), its fields checked; fields this build
    does not know (a later one's) are left out."""
    def bad(problem: str):
        return BundleError(path, f"manifest.json: {problem}")

    if not isinstance(raw, dict):
        raise bad(f"holds {_kind(raw)}, not an object")
    if raw.get("format") != FORMAT:
        raise BundleError(path, f"manifest format is {raw.get('format')!r}, expected {FORMAT!r}")
    if not _is(raw.get("version"), int) or raw["version"] != VERSION:
        raise BundleError(path, f"format version {raw.get('version')!r} (this build reads "
                                f"{VERSION})")
    if "model" not in raw:
        raise bad("no 'model' field")
    for name, kind in _FIELDS.items():
        if name in raw and not _is(raw[name], kind):
            raise bad(f"'{name}' is {_kind(raw[name])}, expected {_JSON_NAMES[kind]}")
    for name, kind in (_MODEL_FIELDS | _MODEL_TYPES).items():
        if (name in _MODEL_FIELDS or name in raw["model"]) and \
                not _is(raw["model"].get(name), kind):
            got = "missing" if name not in raw["model"] else f"{_kind(raw['model'][name])}"
            raise bad(f"'model.{name}' is {got}, expected {_JSON_NAMES[kind]}")
    if not all(isinstance(p, str) for p in raw.get("parts", [])):
        raise bad("'parts' holds other than names")
    return Manifest(**{k: v for k, v in raw.items() if k in _FIELDS})


def model_files(path: Path) -> list[Path]:
    """The files that make a model: the GGUF file, or a folder's config and weights."""
    if path.is_dir():
        return sorted(f for f in path.iterdir() if f.name == "config.json" or f.suffix == ".safetensors")
    return [path]


def model_size(path: Path) -> int:
    return sum(f.stat().st_size for f in model_files(path))


def model_record(path: Path, args) -> dict:
    """What a bundle records of the model it was made for (checked by `check_model`)."""
    return {"file": path.name, "sha256": file_sha256(path), "size": model_size(path),
            "arch": args.arch, "n_layers": args.n_layers, "dim": args.dim,
            "ffn_dim": args.ffn_dim, "ffn_act": args.ffn_act, "args": asdict(args)}


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of a model file, or of a folder's model files in name order. Kept in the user's
    cache by the files' identity (path, device, inode, size, and the times a write sets, ctime
    included, which no tool sets back), so that each load with a bundle does not read the whole
    model again (about 1 s a GiB: 40 s before a 40 GB model's load, in silence); a file of more
    than a GiB hashed shows its progress."""
    files = model_files(path)
    key = str(Path(path).resolve())
    stamp = [_identity(f) for f in files]
    cache = _hash_cache()
    if cache.get(key, {}).get("stamp") == stamp:
        return cache[key]["sha256"]
    from tqdm import tqdm

    total = sum(size for _, _, size, _, _ in stamp)
    h = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"sha256 of {Path(path).name}",
              disable=total < 1 << 30, leave=False) as bar:
        for f in files:
            with open(f, "rb") as fh:
                while block := fh.read(chunk):
                    h.update(block)
                    bar.update(len(block))
    digest = h.hexdigest()
    if stamp == [_identity(f) for f in files]:  # (unchanged while it was read)
        cache = _hash_cache()
        cache.pop(key, None)  # (the newest last)
        _save_hash_cache({**cache, key: {"stamp": stamp, "sha256": digest}})
    return digest


def _identity(f: Path) -> list[int]:
    st = f.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


HASH_CACHE_ENTRIES = 256


def _hash_cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "powerinfer" / \
        "sha256.json"


def _hash_cache() -> dict:
    try:
        cache = json.loads(_hash_cache_file().read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_hash_cache(cache: dict):
    """Write the cache (its newest entries), where the user's cache folder allows it (two
    loads may write at once: the last one's cache stays)."""
    keep = dict(list(cache.items())[-HASH_CACHE_ENTRIES:])
    with contextlib.suppress(OSError):
        f = _hash_cache_file()
        f.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(f, lambda tmp: tmp.write_text(json.dumps(keep)))


class Bundle:
    def __init__(self, path: str | os.PathLike, manifest: Manifest):
        self.path, self.manifest = Path(path), manifest

    @classmethod
    def create(cls, path, model: dict) -> "Bundle":
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        b = cls(path, Manifest(model=model))
        b.save_manifest()
        return b

    @classmethod
    def open(cls, path) -> "Bundle":
        path = Path(path)
        f = path / "manifest.json"
        if not path.exists():
            raise BundleError(path, "no such folder (a bundle is the folder `powerinfer "
                                    "profile --out` writes)")
        if not f.is_file():
            raise BundleError(path, "no manifest.json (not a bundle, or profiling never finished a part)")
        try:
            raw = json.loads(f.read_text())
        except ValueError as e:  # (not JSON, or not UTF-8)
            raise BundleError(path, f"manifest.json is not valid JSON ({e})") from None
        return cls(path, _manifest(path, raw))

    @property
    def n_layers(self) -> int:
        return int(self.manifest.model["n_layers"])

    def has(self, part: str) -> bool:
        return part in self.manifest.parts

    def predictor_input(self, choice: str) -> str:
        """"layer", "ffn", or for "auto" the runtimes' choice: the lookahead predictors when
        trained, else the same-layer ones."""
        if choice != "auto":
            return choice
        return "layer" if self.has("predictors.layer") else "ffn"

    def require(self, part: str, made_by: str):
        if not self.has(part):
            raise BundleError(self.path, f"has no {part!r} yet; run `powerinfer {made_by}` first")

    def check_model(self, model_path: Path):
        """Raise unless model_path is the file this bundle was made from (size, then sha256), or
        the copy of it the CPU kernel reads (`convert.converted`: a K-quant file's blocks
        converted once), checked through the original beside it, else by the name and size the
        copy records of its source."""
        m = self.manifest.model
        if not {"sha256", "size"} <= m.keys():
            raise BundleError(self.path, "manifest.json: 'model' records no size or sha256 of "
                                         "the model file to check it against")
        model_path = Path(model_path)
        size = model_size(model_path)
        if size == m["size"] and file_sha256(model_path) == m["sha256"]:
            return
        source = converted_from(model_path)
        if source is not None and source[:2] == (m["file"], m["size"]):
            original = model_path.parent.parent / m["file"]  # the copy beside its original
            if not original.is_file() or file_sha256(original) == m["sha256"]:
                return
        made_for = f"was made for {m['file']} ({m['size']:,} bytes, sha256 {m['sha256'][:12]}…)"
        if model_path.name == m["file"]:  # the same name: the file itself changed
            differs = "the same size, other contents" if size == m["size"] else f"{size:,} bytes"
            raise BundleError(self.path, f"{made_for}; {model_path} has {differs}: it changed, "
                                         "or was damaged or cut short, since the bundle was made")
        raise BundleError(self.path, f"{made_for}, not for {model_path}")

    def save_manifest(self):
        write_atomically(self.path / "manifest.json",
                lambda tmp: tmp.write_text(json.dumps(asdict(self.manifest), indent=1)))

    def mark(self, part: str, settings: dict | None = None):
        """Record that `part` is complete (after its files are in place)."""
        if part not in self.manifest.parts:
            self.manifest.parts.append(part)
        if settings is not None:
            self.manifest.settings[part] = settings
        self.save_manifest()

    def save_tensors(self, name: str, tensors: dict[str, np.ndarray]):
        f = self.path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(f, lambda tmp: save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                         str(tmp)))

    def load_tensors(self, name: str, shapes: dict[str, tuple] | None = None
                     ) -> dict[str, np.ndarray]:
        """The tensors of the part `name`; with `shapes` (key -> shape, None in a shape for any
        length), each of those keys checked for its presence, its shape and, if it is floating
        point, finite values."""
        f = self.path / name
        if not f.is_file():
            raise BundleError(self.path, f"missing {name}")
        try:
            t = load_file(str(f))
        except Exception as e:  # safetensors raises its own error types
            raise BundleError(self.path, f"{name} is unreadable ({e})") from None
        for key, shape in (shapes or {}).items():
            check_tensor(self.path, name, key, t.get(key), shape)
        return t

    def save_json(self, name: str, obj):
        write_atomically(self.path / name, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))

    def load_json(self, name: str, keys: dict | None = None):
        """The JSON part `name`: a list for the tables (predictors.{input}.json, quality.json),
        an object for the others; with `keys` ({key: type, or (int, float) for a number}),
        each row of a table, or the object, holds those keys with those types
        (`check_rows`)."""
        expect = list if name.startswith("predictors.") or name == "quality.json" else dict
        f = self.path / name
        if not f.is_file():
            raise BundleError(self.path, f"missing {name}")
        try:
            obj = json.loads(f.read_text())
        except ValueError as e:  # (not JSON, or not UTF-8)
            raise BundleError(self.path, f"{name} is not valid JSON ({e})") from None
        if not isinstance(obj, expect):
            raise BundleError(self.path, f"{name} holds {_kind(obj)}, expected "
                                         f"{_JSON_NAMES[expect]}")
        if keys is not None:
            self.check_rows(name, obj if expect is list else [obj], keys, expect is list)
        return obj

    def check_rows(self, where: str, rows, keys: dict, table: bool = True):
        """BundleError naming the row and the key where `rows` (a part's rows, e.g. a
        hand-edited table) are not objects holding `keys` of their types (a KeyError or
        TypeError in whatever read them first)."""
        if not isinstance(rows, list):
            raise BundleError(self.path, f"{where} is {_kind(rows)}, expected a list")
        for i, row in enumerate(rows):
            at = f"{where} row {i}" if table else where
            if not isinstance(row, dict):
                raise BundleError(self.path, f"{at} is {_kind(row)}, expected an object")
            for k, kind in keys.items():
                if k not in row:
                    raise BundleError(self.path, f"{at}: missing '{k}'")
                if not _is(row[k], kind):
                    raise BundleError(self.path, f"{at}: '{k}' is {_kind(row[k])}, expected "
                                                 f"{_expected(kind)}")

    # typed accessors for the parts
    def stats(self) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        """Per-layer firing counts and activation mass, and the number of tokens profiled."""
        self.require("stats", "profile")
        L, n = self.n_layers, self.manifest.model.get("ffn_dim")
        t = self.load_tensors("stats.safetensors", {f"{k}.{i}": (n,) for i in range(L)
                                                    for k in ("count", "mass")})
        tokens = self.manifest.corpus.get("tokens")
        if not _is(tokens, int):
            raise BundleError(self.path, "manifest.json: 'corpus.tokens' is "
                              f"{'missing' if tokens is None else _kind(tokens)}, expected an "
                              "integer")
        return [t[f"count.{i}"] for i in range(L)], [t[f"mass.{i}"] for i in range(L)], tokens

    def thresholds(self) -> np.ndarray:
        self.require("thresholds", "profile")
        name = "thresholds.safetensors"
        return self.load_tensors(name, {"threshold": (self.n_layers,)})["threshold"]

    def samples(self, layer: int) -> dict[str, np.ndarray]:
        self.require("samples", "profile")
        return self.load_tensors(f"samples/layer_{layer:03d}.safetensors")

    def placement(self) -> list[np.ndarray]:
        self.require("placement", "solve")
        n = self.manifest.model.get("ffn_dim")
        t = self.load_tensors("placement.safetensors",
                              {f"hot.{i}": (n,) for i in range(self.n_layers)})
        return [t[f"hot.{i}"].astype(bool) for i in range(self.n_layers)]


def check_tensor(path: Path, name: str, key: str, a: np.ndarray | None, shape: tuple):
    """BundleError unless `a`, the tensor `key` of the part `name`, is there, of `shape` (None:
    any length) and, if floating point, finite (a NaN passes every threshold and comparison:
    it decoded other text, or evaluated as garbage, without a word)."""
    if a is None:
        raise BundleError(path, f"{name} lacks {key}")
    if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape)):
        want = "(" + ", ".join("any" if s is None else str(s) for s in shape) + \
            ("," if len(shape) == 1 else "") + ")"
        raise BundleError(path, f"{name}: {key} has shape {tuple(a.shape)}, expected {want}")
    # (a float64 sum: NaN or infinity in any entry makes it so, and it reads at memory speed)
    if a.dtype.kind == "f" and not np.isfinite(a.sum(dtype=np.float64)):
        raise BundleError(path, f"{name}: {key} holds NaN or infinite values")


def write_atomically(path: Path, write):
    """`write(tmp)` into a file beside `path`, renamed into place once written: the file appears
    under its name only once complete, and the temporary one goes whatever happens. Its name is
    this process's own, so that two processes writing the same file (two replicas converting one
    model, two loads saving the hash cache) do not write into each other's."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        # the mode a new file gets from the umask (safetensors writes its files readable by their
        # owner alone, so a service's user could not read a bundle another user made)
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


CONVERTED_NAME = "kernel-formats"


SOURCE_KEY = "powerinfer.converted_from"


# in a converted copy: it holds only the tensors it converted, and the model's other tensors are
# read from the file it was made from (`formats.gguf.load_gguf`)
CONVERTED_ONLY_KEY = "powerinfer.converted_only"


def source_stamp(path: Path) -> str:
    st = path.stat()
    return f"{path.name}:{st.st_size}:{st.st_mtime_ns}"


def cache_path(model: Path) -> Path:
    beside = Path(str(model) + BUNDLE_SUFFIX)
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside / f"{CONVERTED_NAME}.gguf"
    except OSError:
        pass
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "powerinfer"
    home.mkdir(parents=True, exist_ok=True)
    return home / f"{model.name}.{CONVERTED_NAME}.gguf"


def converted_report(copy: Path) -> dict | None:
    """The report written beside a converted copy (`converted`), or None where there is none."""
    try:
        report = json.loads(Path(copy).with_suffix(".json").read_text())
        return report if isinstance(report.get("source"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def converted_from(copy: Path) -> tuple[str, int, int] | None:
    """(name, size, mtime in ns) of the file a converted copy was made from, as its report
    records it, or None where `copy` is no such copy."""
    try:
        name, size, mtime = converted_report(copy)["source"].rsplit(":", 2)
        return name, int(size), int(mtime)
    except (TypeError, ValueError):
        return None


def original_of(copy: Path) -> Path | None:
    """The file a converted copy was made from, where it is still there unchanged (its name,
    size and mtime as the copy's report records them): the path the report names, else the
    model beside the copy's bundle folder; None otherwise."""
    copy = Path(copy)
    if (report := converted_report(copy)) is None:
        return None
    stamp = report["source"]
    candidates = [Path(report["model"])] if isinstance(report.get("model"), str) else []
    if copy.parent.name.endswith(".bundle"):
        candidates.append(copy.parent.parent / stamp.rsplit(":", 2)[0])
    for c in candidates:
        try:
            if source_stamp(c) == stamp:
                return c
        except OSError:
            continue
    return None
