"""Structured output on the real model: every constrained sequence's text parses and validates
(jsonschema, re.fullmatch, the choice list), greedy and sampled, in one batch with free-text
sequences whose tokens the constraint must not touch."""
import json
import re

import jsonschema
import pytest

from conftest import FLOAT32_INT4
from powerinfer import Config, InvalidRequestError, PowerInfer
from powerinfer.engine.params import sampling_params
from powerinfer.engine.grammar import Grammar
from powerinfer.engine.grammar import matcher as matcher_for

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["friend", "work", "family"]}}}}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and tags."}]


@pytest.fixture(scope="module")
def smol():
    return PowerInfer.from_pretrained("smollm2-135m-instruct",
                                      config=Config(**FLOAT32_INT4, max_batch=8, max_seq_len=512))


def run(pi, requests):
    """[(prompt, sampling)] decoded together in one batch: [(text, finish_reason)]."""
    eng = pi.engine
    seqs = [eng.new_sequence(pi._ids(p), sampling_params(**kw)) for p, kw in requests]
    texts, reasons = [""] * len(seqs), [None] * len(seqs)
    for ev in eng.run(seqs):
        texts[ev.index] += ev.text
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
    return list(zip(texts, reasons))


def test_constrained_and_free_rows_in_one_batch(smol):
    greedy = dict(max_tokens=80, temperature=0)
    sampled = dict(max_tokens=80, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    free = ("The capital of France is", dict(max_tokens=12, temperature=0))
    requests = [
        (ASK, dict(greedy, grammar=Grammar.json_schema(PERSON))),
        (ASK, dict(sampled, seed=1, grammar=Grammar.json_schema(PERSON))),
        (ASK, dict(sampled, seed=2, grammar=Grammar.json_schema(PERSON))),
        free,
        ("My phone number is", dict(sampled, seed=3, grammar=Grammar.regex(r"[0-9]{3}-[0-9]{4}"))),
        ("Is the sky blue? Answer:", dict(sampled, seed=4,
                                          grammar=Grammar.choice(["yes", "no", "it depends"]))),
        (ASK, dict(greedy, max_tokens=60, grammar=Grammar.json_object())),
    ]
    out = run(smol, requests)
    for text, reason in out[:3]:
        assert reason == "stop", text  # the grammar completed, well inside max_tokens
        jsonschema.validate(json.loads(text), PERSON)
    assert len({t for t, _ in out[:3]}) > 1  # sampling still samples inside the grammar
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out[4][0]) and out[4][1] == "stop"
    assert out[5][0] in ("yes", "no", "it depends") and out[5][1] == "stop"
    text, reason = out[6]
    assert text.startswith("{")  # json_object: an object, whole when it ended by itself
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    # the free row decodes exactly as it does alone: masks touch only their own rows
    assert out[3] == run(smol, [free])[0]


def test_a_request_the_engine_cannot_compile_is_refused_by_name(smol):
    bad = [Grammar.regex("a(b"), Grammar.lark("start: nothing_here"),
           Grammar.json_schema({"type": "strin"}),
           Grammar.json_schema({"type": "array", "uniqueItems": True}, strict=True)]
    for g in bad:
        with pytest.raises(InvalidRequestError) as e:
            smol.generate("x", max_new_tokens=2, grammar=g)
        assert {"json": "JSON schema", "regex": "regex", "lark": "grammar"}[g.kind] in str(e.value)
    # strict=False ignores the keyword it cannot enforce; the rest of the schema holds
    text = smol.generate("Numbers:", max_new_tokens=30, temperature=0, grammar=Grammar.json_schema(
        {"type": "array", "uniqueItems": True, "maxItems": 3, "items": {"type": "integer"}},
        strict=False))
    assert isinstance(json.loads(text), list)
    for source in ("{not json", "[1, 2]"):
        with pytest.raises(InvalidRequestError):
            Grammar("json", source)
    with pytest.raises(InvalidRequestError):
        Grammar.choice([])


def test_each_tool_format_round_trips_through_its_grammar_and_parser(smol):
    """For every family's format: calls as the model writes them are accepted by the call
    grammar of "required" (and refused by a named function's grammar when they call another)
    and parse back to the same calls; plain text is content."""
    from powerinfer.engine import tools

    fs = tools.functions([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "required": ["city"],
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}},
        {"type": "function", "function": {"name": "now", "parameters": {
            "type": "object", "properties": {"tz": {"type": "string"}}}}}])
    names = [f["name"] for f in fs]
    calls = [("get_weather", {"city": "Paris", "unit": "c"}), ("now", {}), ("now", {"tz": "UTC"})]
    tok, vocab = smol.tokenizer, smol.args.vocab_size
    for fmt in tools.FORMATS:
        text = tools.write_calls(calls, fmt)
        ids = tok.encode(text, add_bos=False)
        m = matcher_for(tok, vocab, tools.grammar(fs, fmt))
        assert all(m.consume_token(i) for i in ids) and m.is_accepting(), (fmt, m.get_error())
        named = matcher_for(tok, vocab, tools.grammar(fs, fmt, only="now", parallel=False))
        assert not all(named.consume_token(i) for i in ids)  # get_weather is not "now"
        content, got = tools.parse(text, fmt, names)
        assert not content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
        assert tools.parse("Paris is sunny today.", fmt, names) == ("Paris is sunny today.", [])
        # cut at max_tokens inside the last call: the whole calls, then the cut one as far as
        # its arguments were written (as OpenAI returns it; the markup went out as content)
        # (Gemma's calls are Python: the cut one's keyword arguments as the JSON they make; its
        # reply is the call list or no call, as `parse` reads it)
        cut = text[:text.rindex('"UTC"') + 3]
        before = "Here: " if fmt != "gemma" else ""
        content, got = tools.cut_call(before + cut, fmt, names)
        assert content == before.strip() and [c["function"]["name"] for c in got] == \
            [n for n, _ in calls]
        assert got[-1]["function"]["arguments"] == '{"tz": "UT'
        assert json.loads(got[0]["function"]["arguments"]) == calls[0][1]
        assert json.loads(got[1]["function"]["arguments"]) == {}
        name_cut = text.index('"now"') + 3 if fmt != "gemma" else text.index("now(") + 2
        assert [c["function"]["name"] for c in tools.cut_call(text[:name_cut], fmt, names)[1]] \
            == ["get_weather"]  # (the cut one's name not whole yet: the whole ones)
        assert tools.cut_call(cut.replace("now", "later"), fmt, names) is None  # (not offered)
    # a Gemma call cut inside a string that holds a comma, and inside a second argument; after
    # a string's closing quote; inside an escape; inside a list (its key kept, the value not)
    for cut, arguments in [('get_weather(city="Pa, ris", unit="c',
                            '{"city": "Pa, ris", "unit": "c'),
                           ('get_weather(city="Paris"', '{"city": "Paris"'),
                           ('get_weather(city="Pa\\"ri', '{"city": "Pa\\"ri'),
                           ('get_weather(city="a\\', '{"city": "a'),
                           ("now(tz=['a', 'b", '{"tz": ')]:
        assert tools.cut_call("[" + cut, "gemma", names)[1][0]["function"]["arguments"] \
            == arguments, cut
    # every cut of a written list: the cut call's arguments a prefix of the whole call's JSON
    calls = [("get_weather", {"city": "Zü \"q\" a\\b, c", "unit": "c"}), ("now", {"tz": [1, "a"]})]
    text = tools.write_calls(calls, "gemma")
    for k in range(1, len(text)):
        for (_, args), got in zip(calls, (tools.cut_call(text[:k], "gemma", names) or ("", []))[1]):
            assert json.dumps(args).startswith(got["function"]["arguments"]), text[:k]
    # not a call list: a call named in prose, junk after a call, a positional argument, a set
    for text in ('I would call [get_weather(city="Paris")] but first', '[now(), 42, now(',
                 '[get_weather("Paris", unit="c', '[now(tz={1, 2}), now(tz="U'):
        assert tools.cut_call(text, "gemma", names) is None, text
    assert tools.parse("[now(tz={1, 2})]", "gemma", names) == ("[now(tz={1, 2})]", [])
    # a template that renders tools gets them, with earlier calls as structured messages
    convo = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
              "function": {"name": "now", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "1", "content": "noon"}]
    out, extra = tools.render(convo, fs, "hermes")
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {}
    out, extra = tools.render(convo, fs, "smollm2")
    assert not extra and "<tools>" in out[0]["content"] and out[-1]["role"] == "user"
    assert tools.format_for(smol.tokenizer) == "smollm2"


def test_a_schema_of_true_is_any_json_and_false_is_refused():
    # (OpenAI's json_schema format without its optional schema: the default true was refused by
    # llguidance as "Expecting object schema to apply options")
    from powerinfer.errors import InvalidRequestError

    assert Grammar.json_schema(True) == Grammar.json_schema({})
    assert '"json_schema"' in Grammar.json_schema(True).compiled()
    with pytest.raises(InvalidRequestError, match="no output matches it"):
        Grammar.json_schema(False)
