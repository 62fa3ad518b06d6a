"""Tokenizer and chat template, built with the `tokenizers` library from GGUF metadata (gpt2-style
BPE or llama SentencePiece vocabularies) or from a Hugging Face folder's tokenizer.json.

BOS/EOS follow llama.cpp: BOS is prepended when the vocabulary asks for it (GGUF key
`tokenizer.ggml.add_bos_token`, else the vocabulary type's default) and not already present;
generation ends on any end-of-generation token (EOS, EOT and the known end-of-turn tokens).
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` (gpt2's is ByteLevel's built-in one)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
               r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# tokens llama.cpp treats as end of generation when the vocabulary has them
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
             "<|end_of_text|>", "<|eom_id|>", "<｜end▁of▁sentence｜>")


CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


# Gemma's turns, for files that carry no template (the system prompt opens the first user turn)
GEMMA = ("{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
         "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
         "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
         "{% for m in turns %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' "
         "else m['role']) + '\n' + (first if loop.first else '') + m['content'] | trim "
         "+ '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6


def _byte_level_bytes() -> dict[str, int]:
    """A byte-level BPE's piece characters -> the bytes they stand for (GPT-2's table: the
    printable bytes as themselves, the others as the characters from U+0100 on, in order)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
             *range(ord("\u00ae"), ord("\u00ff") + 1)]
    rest = [b for b in range(256) if b not in shown]
    return {**{chr(b): b for b in shown}, **{chr(256 + i): b for i, b in enumerate(rest)}}


BYTE_LEVEL = _byte_level_bytes()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 chat_template: str | None, eog_ids: set[int]):
        self.tok, self.bos_id, self.eos_id, self.add_bos = tok, bos_id, eos_id, add_bos
        self.chat_template = chat_template
        self.eog_ids = frozenset(i for i in eog_ids | {eos_id} if i is not None)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._decoders: set | None = None  # (`token_bytes`)

    def token_text(self, i: int | None) -> str:
        return "" if i is None else (self.tok.id_to_token(i) or "")

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for, also where they are a part of a character that takes
        several tokens (whose decoded text is U+FFFD alone): what OpenAI's logprobs carry as
        `bytes`, so that a client can join such tokens into their characters."""
        piece = self.tok.id_to_token(i)
        if piece is None:
            return b""
        if self._decoders is None:  # (the decoder's own description: its types, nested ones too)
            d = self.tok.decoder
            desc = json.loads(d.__getstate__()) if d is not None else {}
            self._decoders = {desc.get("type")} | {x.get("type") for x in desc.get("decoders", ())}
        if "ByteLevel" in self._decoders:
            try:
                return bytes(BYTE_LEVEL[c] for c in piece)
            except KeyError:  # (an added token written as itself)
                return piece.encode()
        if "ByteFallback" in self._decoders:
            if m := BYTE_PIECE.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return self.tok.decode([i], skip_special_tokens=False).encode()

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        self.tok.encode_special_tokens = not parse_special
        ids = self.tok.encode(text, add_special_tokens=False).ids
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def __getstate__(self):
        # the compiled chat template does not pickle (jinja2); it is compiled again on first use
        return {**self.__dict__, "_template": None}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **extra) -> str:
        """The conversation as the model's template writes it, with the model's turn opened
        (`add_generation_prompt`), or, `continue_final_message`, ending inside the last message,
        the assistant's own beginning of its reply (a prefill), which the model goes on from
        (as transformers and vLLM do it: the render cut after that message's text)."""
        final = ""
        if continue_final_message:
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError("continue_final_message: the last message must be the "
                                 "assistant's, the beginning of the reply to go on from")
            final = messages[-1].get("content") or ""
            add_generation_prompt = not final.strip()  # (nothing to go on from: a new turn)
        text = self._render(messages, add_generation_prompt, **extra)
        if final.strip():
            at = text.rfind(final)
            if at < 0:  # (a template that trims what it writes)
                final = final.strip()
                at = text.rfind(final)
            if at < 0:
                raise ValueError("continue_final_message: the chat template does not write the "
                                 "last message as it is, so there is no place to go on from")
            text = text[:at + len(final)]
        return text

    def _render(self, messages: list[dict], add_generation_prompt: bool, **extra) -> str:
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template or self._default_template())
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.token_text(self.bos_id),
                                     eos_token=self.token_text(self.eos_id), **extra)

    def _default_template(self) -> str:
        """The template of a file that has none: Gemma's turns where the vocabulary has them,
        else ChatML."""
        return GEMMA if self.tok.token_to_id("<start_of_turn>") is not None else CHATML

    # ------------------------------------------------------------------------------ builders

    @classmethod
    def from_source(cls, source: tuple[str, object]) -> "Tokenizer":
        """From a checkpoint's `tokenizer_source`: ("gguf", metadata) or ("hf", folder)."""
        kind, where = source
        return cls.from_gguf(where) if kind == "gguf" else cls.from_hf(where)

    @classmethod
    def from_gguf(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        for key in ("tokenizer.ggml.tokens",) + (("tokenizer.ggml.scores",) if kind == "llama"
                                                 else ()):
            if key not in meta:  # (a KeyError's bare "'tokenizer.ggml.tokens'" before)
                raise ValueError(f"the file's metadata lacks {key}: no tokenizer to load")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [TYPE_NORMAL] * len(tokens))
        if kind == "gpt2":
            tok = _gpt2_bpe(tokens, list(meta.get("tokenizer.ggml.merges", ())),
                            meta.get("tokenizer.ggml.pre", "default"))
            default_bos = meta.get("tokenizer.ggml.pre") in ("llama-bpe", "llama3")
        elif kind == "llama":
            tok = _sentencepiece_bpe(tokens, list(meta["tokenizer.ggml.scores"]), types,
                                     meta.get("tokenizer.ggml.unknown_token_id", 0),
                                     bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
            default_bos = True
        else:
            raise ValueError(f"unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        special = [AddedToken(t, special=ty == TYPE_CONTROL, normalized=False)
                   for t, ty in zip(tokens, types) if ty in (TYPE_CONTROL, TYPE_USER)]
        tok.add_special_tokens([a for a in special if a.special])
        tok.add_tokens([a for a in special if not a.special])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eog = {meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id")}
        eog |= {i for i, (t, ty) in enumerate(zip(tokens, types))
                if ty == TYPE_CONTROL and t in EOG_TEXTS}
        return cls(tok, meta.get("tokenizer.ggml.bos_token_id"), eos,
                   bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
                   meta.get("tokenizer.chat_template"), eog)

    @classmethod
    def from_hf(cls, folder: Path) -> "Tokenizer":
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{tok_file} not found")
        tok = HFTokenizer.from_file(str(tok_file))
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")

        def token_id(value):
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if value else None

        bos, eos = token_id(cfg.get("bos_token")), token_id(cfg.get("eos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # the post-processor decides: see whether it prepends BOS
            add_bos = bos is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
        eog = gen.get("eos_token_id", [])
        eog = set(eog if isinstance(eog, list) else [eog])
        eog |= {tok.token_to_id(t) for t in EOG_TEXTS if tok.token_to_id(t) is not None}
        template = cfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(tok, bos, eos if eos is not None else next(iter(eog), None), bool(add_bos),
                   template, eog)


class StreamDecoder:
    """Incremental detokenization: emits text only once it is complete UTF-8 and stable."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix_offset = self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""


def _raise(message):
    raise ValueError(f"chat template error: {message}")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _gpt2_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3", "qwen2"):
        regex = QWEN2_REGEX if pre == "qwen2" else LLAMA3_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # gpt2 and unknown pre-tokenizers: GPT-2's regex
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk_id: int,
                       add_space_prefix: bool) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    # merges from the vocabulary: every split of a piece into two pieces that exist, ranked by
    # the merged piece's score (higher first), as SentencePiece's BPE applies them
    # (a right part is looked up only after its left one is found: Gemma 3's 262,144 pieces
    # have 1.2 million splits, 2.0 -> 1.4 s)
    ranked, get = [], vocab.get
    for piece, pid in vocab.items():
        if types[pid] != TYPE_NORMAL:
            continue
        score = -scores[pid]
        for k in range(1, len(piece)):
            left = piece[:k]
            if (li := get(left)) is not None and (ri := get(right := piece[k:])) is not None:
                ranked.append((score, li, ri, left, right))
    ranked.sort()
    tok = HFTokenizer(models.BPE(vocab, [(r[3], r[4]) for r in ranked], unk_token=tokens[unk_id],
                                 fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok
