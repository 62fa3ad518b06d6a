"""The llama (SentencePiece) vocabulary path, checked against SentencePiece itself on a model
trained here from real text, exported the way GGUF stores it (tokens, scores, token types)."""
import io
from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")

from powerinfer.formats.tokenizer import (TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL, TYPE_UNKNOWN,
                                          Tokenizer)

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and   runs of   spaces",
    "naïve café, 東京 and emoji 😀 fall back to bytes",
    "line one\nline two\n\ttabbed",
    "numbers 12345 and symbols #@!?",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import jinja2
    import torch

    # real English prose shipped with installed packages: their license texts and docs
    corpus = "\n".join(Path(m.__file__).read_text() for m in (torch.nn.modules.module, jinja2.environment))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus.splitlines()), model_writer=model,
                                   vocab_size=600, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2,
                                   # as LLaMA's model: no normalization, whitespace kept
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(TYPE_UNKNOWN if sp.is_unknown(i) else TYPE_CONTROL if sp.is_control(i)
                     else TYPE_BYTE if sp.is_byte(i) else TYPE_NORMAL)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id()}
    return sp, Tokenizer.from_gguf(meta)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_sentencepiece(trained, text):
    sp, tok = trained
    assert tok.encode(text, add_bos=False) == sp.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_roundtrip(trained, text):
    sp, tok = trained
    ids = sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text


def test_bos_added_once_like_llama_cpp(trained):
    sp, tok = trained
    assert tok.add_bos
    ids = tok.encode("Hello")
    assert ids[0] == sp.bos_id() and ids[1:] == sp.encode("Hello")
    assert tok.encode("<s>Hello")[:2] != [sp.bos_id(), sp.bos_id()]
