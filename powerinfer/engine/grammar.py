"""Constrained decoding: a request's output held to a JSON schema, a regular expression, a list
of choices or a Lark grammar, with llguidance (the grammar engine of the guidance project, also
used by vLLM and llama.cpp) on the CPU.

A `Grammar` is what a request asks for: plain data, checked when it is built (a schema that is
not JSON, an empty choice list), hashable and small to pickle, so it travels in
`SamplingParams`. Where the sequence is created, `matcher()` compiles it against the model's
tokenizer (an llguidance `LLTokenizer`, built once per tokenizer: about 0.3 s for SmolLM2's 49k
vocabulary, 2-4 s for Gemma 3's 262k) into a matcher that follows the sequence's output. At each
sampling step `masks()` computes the allowed tokens of every constrained row of the batch in one
parallel call (a runtime may do it while the step runs: it needs only the matchers) and
`apply()` sets the other tokens' logits to -inf, so that greedy and sampled requests alike can
only produce text of the grammar; unconstrained rows of the same batch are left as they are.
The sequence ends (finish reason "stop") as soon as the grammar is complete and admits nothing
more.

JSON is written compact, as `json.dumps` writes it (", " and ": " between items, no other
whitespace): a small model cannot then loop on whitespace, and the output parses the same.
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field, replace
from functools import lru_cache
import numpy as np

from ..errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "lark")


# the JSON compiler's defaults (a schema's "x-guidance" key may override them)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


MAX_SOURCE = 1 << 18  # characters of a schema, regex or grammar


@dataclass(frozen=True, slots=True)
class Grammar:
    """kind "json": source is a JSON schema as JSON text ("{}" for any JSON, '{"type":
    "object"}' for any object); strict=False ignores schema keywords the engine does not
    implement instead of refusing the schema. "regex": source is a regular expression the whole
    output matches. "choice": source is a JSON list of the strings the output may be. "lark": a
    grammar in llguidance's Lark dialect (which also embeds JSON schemas: `%json {...}`)."""

    kind: str
    source: str
    strict: bool = True
    # the request's field it came from (an API's `response_format`, `tools`), named by the
    # errors it raises where the engine cannot take it; not part of what the grammar is
    origin: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"grammar kind {self.kind!r}: expected one of {KINDS}")
        if not isinstance(self.source, str) or not self.source:
            raise InvalidRequestError(f"{self.kind} constraint: empty")
        if len(self.source) > MAX_SOURCE:
            raise InvalidRequestError(f"{self.kind} constraint of {len(self.source)} characters; "
                                      f"the limit is {MAX_SOURCE}")
        if self.kind == "json":
            schema = _json(self.source, "JSON schema")
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("JSON schema: expected an object")
        elif self.kind == "choice":
            choices = _json(self.source, "choice list")
            if not (isinstance(choices, list) and choices
                    and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequestError("choice: expected a non-empty list of non-empty strings")

    def named(self, origin: str) -> "Grammar":
        """This grammar, its errors naming `origin` (a request's field)."""
        return replace(self, origin=origin)

    # ---- constructors for the request formats ----
    @classmethod
    def json_schema(cls, schema: dict | bool | str, strict: bool = True) -> "Grammar":
        """`schema` true (as OpenAI's json_schema format without its optional "schema") is any
        JSON value; false, which no value matches, is refused."""
        if schema is False:
            raise InvalidRequestError("JSON schema false: no output matches it")
        if schema is True:  # (llguidance takes only an object: "Expecting object schema")
            schema = {}
        text = schema if isinstance(schema, str) else json.dumps(schema)  # its key order kept
        return cls("json", text, bool(strict))

    @classmethod
    def json_object(cls) -> "Grammar":
        return cls("json", '{"type": "object"}')

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> "Grammar":
        if not isinstance(choices, (list, tuple)):
            raise InvalidRequestError("choice: expected a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        return cls("lark", text)

    # ---- llguidance ----
    def compiled(self) -> str:
        """The grammar in llguidance's own form (no tokenizer needed)."""
        return _compiled(self)


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e}") from None


@lru_cache(maxsize=256)
def _compiled(g: Grammar) -> str:
    from llguidance import LLMatcher

    if g.kind == "json":
        options = dict(JSON_OPTIONS, lenient=not g.strict)
        try:
            return LLMatcher.grammar_from_json_schema(g.source, defaults=options)
        except ValueError as e:
            raise InvalidRequestError(f"JSON schema: {e}", param=g.origin) from None
    if g.kind == "regex":
        return LLMatcher.grammar_from_regex(g.source)
    if g.kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in json.loads(g.source))
        return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    return LLMatcher.grammar_from_lark(g.source)


class Guide:
    """llguidance's view of one tokenizer: its LLTokenizer and matchers for grammars (the first
    matcher of a grammar is compiled, later ones are copies)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self.vocab_size = vocab_size
        self.lltok = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size,
                                            eos_token=sorted(tokenizer.eog_ids))
        self._protos: dict[Grammar, object] = {}
        self._lock = threading.Lock()

    def matcher(self, g: Grammar):
        from llguidance import LLMatcher

        with self._lock:
            proto = self._protos.get(g)
        if proto is None:
            proto = LLMatcher(self.lltok, g.compiled(), log_level=0)
            if proto.is_error():
                raise InvalidRequestError(f"{_NAMES[g.kind]}: {proto.get_error()}",
                                          param=g.origin)
            with self._lock:
                if len(self._protos) >= 256:
                    self._protos.pop(next(iter(self._protos)))
                self._protos[g] = proto
        return proto.deep_copy()


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "lark": "grammar"}


_GUIDES: "weakref.WeakKeyDictionary[object, Guide]" = weakref.WeakKeyDictionary()


_GUIDES_LOCK = threading.Lock()


_EXECUTOR = None


def guide(tokenizer, vocab_size: int) -> Guide:
    """The tokenizer's Guide, built on first use and kept while the tokenizer lives."""
    with _GUIDES_LOCK:
        g = _GUIDES.get(tokenizer)
        if g is None or g.vocab_size != vocab_size:
            try:
                g = _GUIDES[tokenizer] = Guide(tokenizer, vocab_size)
            except Exception as e:  # noqa: BLE001 - llguidance refuses this vocabulary
                raise InvalidRequestError(f"constrained output is not available for this "
                                          f"model: its tokenizer is not one llguidance reads "
                                          f"({type(e).__name__}: {e})") from None
        return g


def matcher(tokenizer, vocab_size: int, g: Grammar):
    """A fresh matcher of g for a new sequence; InvalidRequestError says what is wrong with g."""
    return guide(tokenizer, vocab_size).matcher(g)


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        from llguidance import LLExecutor

        _EXECUTOR = LLExecutor()
    return _EXECUTOR


@dataclass
class Masks:
    """The allowed tokens of a batch's constrained rows: bit i of words[j] is token i of row
    rows[j] (llguidance's layout)."""
    rows: list[int]
    words: np.ndarray  # (len(rows), ceil(V / 32)) int32


def masks(matchers: list, vocab_size: int) -> Masks | None:
    """The masks of the rows whose matcher is not None (one parallel llguidance call), or None
    when no row is constrained. Needs only the matchers' state: a runtime may compute them while
    the step that produces the logits runs."""
    rows = [k for k, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    n = (vocab_size + 31) // 32
    words = np.zeros((len(rows), n), np.int32)
    _executor().unsafe_compute_mask_ptr([(matchers[k], i) for i, k in enumerate(rows)],
                                        words.ctypes.data, n * 4, len(rows))
    return Masks(rows, words)


def apply(m: Masks | None, logits: np.ndarray) -> np.ndarray:
    """logits (K, V) with the tokens each constrained row forbids at -inf (a copy; logits
    itself when no row is constrained)."""
    if m is None:
        return logits
    V = logits.shape[1]
    bits = np.unpackbits(m.words.view(np.uint8), axis=1, bitorder="little")[:, :V]
    out = logits.copy()
    out[m.rows] = np.where(bits.view(np.bool_), logits[m.rows], np.float32(-np.inf))
    return out
