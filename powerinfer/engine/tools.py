"""Tool (function) calling: the request's tools in the prompt, the model's calls out of its text,
and, for `tool_choice` "required" or a named function, a grammar that lets the model write
nothing but a well-formed call.

Each model family writes calls its own way, the way it was trained to:

- "hermes": a chat template that renders `tools` itself (Qwen 2.5, Hermes, SmolLM3 and most
  templates with tool support): the tools go to the template; calls are JSON objects
  `{"name": ..., "arguments": {...}}` in `<tool_call>...</tool_call>` tags, results go back in
  `<tool_response>` tags.
- "smollm2": ChatML without tool support in its template (SmolLM2-Instruct, trained on
  function calling with this prompt): the tools are listed in the system prompt, JSON in
  `<tools>` tags, and the model answers `<tool_call>[{"name": ..., "arguments": {...}}, ...]
  </tool_call>`.
- "gemma": Gemma 3 (no tool syntax of its own; Google's function-calling prompt): the tools are
  described in the system prompt and the model answers with a Python-style list of calls,
  `[get_weather(city="Paris"), ...]`; results go back in a ```tool_output block.

`render()` turns an OpenAI conversation (tools, assistant messages with `tool_calls`, `tool`
messages with results) into plain messages for the model's template; `parse()` splits a finished
text into its content and its calls; `opener()` is what a call starts with, so that a stream can
hold back text that may be a call; `grammar()` is the call grammar of "required" and named
choices. Pure Python: the ingress parses, the model deployment renders.
"""
from __future__ import annotations

import ast
import json
import re
import uuid

from ..errors import InvalidRequestError
from .grammar import JSON_OPTIONS, Grammar

FORMATS = ("hermes", "smollm2", "gemma")


def format_for(tokenizer) -> str:
    """The tool-call format of the model whose tokenizer (and chat template) this is."""
    template = tokenizer.chat_template or ""
    if "tools" in template:
        return "hermes"
    vocab = tokenizer.tok.get_vocab()
    if "<start_of_turn>" in vocab:
        return "gemma"
    return "smollm2"  # ChatML and the rest: JSON calls in tags, described in the system prompt


def functions(tools: list[dict]) -> list[dict]:
    """The request's tools as {"name", "description", "parameters"} (OpenAI's function objects);
    InvalidRequestError names a malformed one."""
    out, seen = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise InvalidRequestError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
            raise InvalidRequestError(f"tools[{i}].function.name: a name of letters, digits, _ . - "
                                      "(at most 64), starting with a letter or _")
        if name in seen:
            raise InvalidRequestError(f"tools[{i}]: function {name!r} is given twice")
        seen.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters: expected a JSON schema object")
        if params.get("type", "object") != "object":  # (any other was read as no arguments)
            raise InvalidRequestError(f"tools[{i}].function.parameters: the schema of an object "
                                      f"(type 'object'), got type {str(params['type'])[:40]!r}")
        out.append({"name": name, "description": str(f.get("description") or ""),
                    "parameters": params})
    return out


def chosen(choice, names: list[str]) -> str | None:
    """tool_choice as "none", "auto", "required" or a function's name."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError("tool_choice: expected none, auto, required or "
                                      "{'type': 'function', 'function': {'name': ...}}")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in names:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not among the "
                                  f"tools ({', '.join(names)})")
    return name


SMOLLM2_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, answer the question in plain "
    "text.\n\nYou have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, the output MUST strictly adhere to the following format, and NO other text "
    "MUST be included:\n<tool_call>[\n{{\"name\": \"func_name1\", \"arguments\": "
    "{{\"argument1\": \"value1\", \"argument2\": \"value2\"}}}},\n... (more tool calls as "
    "required)\n]</tool_call>")


GEMMA_SYSTEM = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put "
    "it in the format of\n[func_name1(params_name1=params_value1, params_name2=params_value2...), "
    "func_name2(params)]\n\nYou SHOULD NOT include any other text in the response if you call a "
    "function.\n{tools}")


def render(messages: list[dict], tools: list[dict] | None, fmt: str) -> tuple[list[dict], dict]:
    """(messages for the chat template, extra template arguments): OpenAI's tool messages in
    the format's own words. tools: functions() of the request, or None (tool_choice "none":
    the model is not told of them, but earlier calls and results still read as they were)."""
    if fmt == "hermes":  # the template renders tools and tool messages itself
        out = [_hermes_message(m) for m in messages]
        extra = {"tools": [{"type": "function", "function": f} for f in tools]} if tools else {}
        return out, extra
    out = [_plain_message(m, fmt) for m in messages]
    if tools:
        listing = (json.dumps(tools) if fmt == "smollm2" else
                   "\n".join(json.dumps(f, indent=2) for f in tools))
        preamble = (SMOLLM2_SYSTEM if fmt == "smollm2" else GEMMA_SYSTEM).format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return _merge_turns(out), {}


def _arguments(call: dict) -> dict:
    args = call.get("function", {}).get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise InvalidRequestError("an assistant message's tool_calls[].function.arguments is not "
                                  "JSON") from None
    return args if isinstance(args, dict) else {}


def _hermes_message(m: dict) -> dict:
    if m.get("tool_calls"):
        calls = [{"type": "function", "function": {"name": c["function"]["name"],
                                                   "arguments": _arguments(c)}}
                 for c in m["tool_calls"]]
        return {"role": "assistant", "content": m.get("content") or "", "tool_calls": calls}
    return dict(m)


def _plain_message(m: dict, fmt: str) -> dict:
    role, content = m["role"], m.get("content") or ""
    if role == "assistant" and m.get("tool_calls"):
        calls = [(c["function"]["name"], _arguments(c)) for c in m["tool_calls"]]
        return {"role": "assistant", "content": (content + "\n" if content else "")
                + write_calls(calls, fmt)}
    if role == "tool":
        if fmt == "gemma":
            return {"role": "user", "content": f"```tool_output\n{content}\n```"}
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": role, "content": content}


def _merge_turns(messages: list[dict]) -> list[dict]:
    """Consecutive user turns (several tool results) as one, which every template accepts."""
    out: list[dict] = []
    for m in messages:
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(m)
    return out


def write_calls(calls: list[tuple[str, dict]], fmt: str) -> str:
    """Calls as the model writes them."""
    if fmt == "gemma":
        def value(v):
            return json.dumps(v)  # strings, numbers, lists; true/false/null read back (parse)
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={value(v)}" for k, v in a.items()) + ")"
                               for n, a in calls) + "]"
    objs = [{"name": n, "arguments": a} for n, a in calls]
    if fmt == "smollm2":
        return "<tool_call>[" + ", ".join(json.dumps(o) for o in objs) + "]</tool_call>"
    return "\n".join(f"<tool_call>\n{json.dumps(o)}\n</tool_call>" for o in objs)


def opener(fmt: str) -> str:
    """What a call starts with: a stream holds back text that may be the start of one."""
    return "[" if fmt == "gemma" else "<tool_call>"


def parse(text: str, fmt: str, names: list[str]) -> tuple[str, list[dict]]:
    """(content, calls) of a finished text: calls as OpenAI's tool_calls (arguments as JSON
    text), content what is left of the text. Only calls of the request's functions count; a
    text that does not hold one well-formed is content, as it came."""
    calls: list[tuple[str, dict]] = []
    if fmt == "gemma":
        body = text.strip()
        fenced = re.fullmatch(r"```(?:tool_code|python)?\s*(.*?)\s*```", body, re.S)
        found = _python_calls(fenced.group(1) if fenced else body, names)
        if found is None:
            return text, []
        calls, content = found, ""
    else:
        content = text
        for m in reversed(list(re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text,
                                           re.S))):
            found = _json_calls(m.group(1), names)
            if found is None:
                continue
            calls[:0] = found
            content = content[:m.start()] + content[m.end():]
        content = content.strip()
    return content, [_call(n, json.dumps(a)) for n, a in calls]


def cut_call(text: str, fmt: str, names: list[str]) -> tuple[str, list[dict]] | None:
    """(content, calls) of a text that ended inside a call (a reply cut at max_tokens): the
    calls written whole, then the cut one with its name and its arguments as far as they were
    written (JSON text cut short, as OpenAI returns a call cut by finish reason "length"); a
    call cut before its name is left out, markup and all. None where the text holds no call, or
    one of a function not offered. Gemma's calls are Python: the cut one's keyword arguments are
    given as the JSON text they make, as far as they were written (`_cut_python_call`)."""
    if fmt == "gemma":
        return _cut_python_calls(text, names)
    at = text.rfind(opener(fmt))
    if at < 0:
        return None
    body, pos, whole = text[at + len(opener(fmt)):], 0, []
    decoder = json.JSONDecoder()
    while True:  # (smollm2: a list of calls, each whole one decoded, up to the cut one)
        pos = _BETWEEN_CALLS.match(body, pos).end()
        try:
            item, pos = decoder.raw_decode(body, pos)
        except ValueError:
            break
        found = _calls_of(item, names)
        if found is None:
            return None
        whole += found
    m = re.match(r'\{\s*"name"\s*:\s*"([^"]*)"\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*(.*))?',
                 body[pos:], re.S)
    if m is not None and m.group(1) not in names:
        return None
    content, calls = parse(text[:at], fmt, names)
    calls += [_call(n, json.dumps(a)) for n, a in whole]
    if m is not None:
        calls.append(_call(m.group(1), (m.group(2) or "").strip()))
    return content.strip(), calls


def _cut_python_calls(text: str, names: list[str]) -> tuple[str, list[dict]] | None:
    """cut_call for Python-style calls (`[f(a=1), g(b="x` cut short): the reply is the call list,
    as `parse` reads it (a call named in prose is not one); the calls written whole, then the
    cut one, its keyword arguments as JSON text as far as they were written. None where the
    text is not such a list."""
    start = re.match(r"\s*(?:```(?:tool_code|python)?\s*)?\[\s*(?=[A-Za-z_]\w*\()", text)
    if start is None:
        return None
    body, pos, calls = text[start.end():], 0, []
    call = re.compile(r"[\s,]*([A-Za-z_]\w*)\(")
    while True:
        m = call.match(body, pos)
        if m is None:  # the list's end cut, or a call cut before its parenthesis (left out)
            if not re.fullmatch(r"[\s,]*(?:[A-Za-z_]\w*)?", body[pos:]):
                return None
            break
        if m.group(1) not in names:
            return None
        end = _closing(body, m.end())
        if end == -1:
            return None
        if end is None:  # the cut one
            arguments = _partial_arguments(body[m.end():])
            if arguments is None:
                return None
            calls.append(_call(m.group(1), arguments))
            break
        found = _python_calls(body[m.start(1):end + 1], names)
        if found is None:
            return None
        calls += [_call(n, json.dumps(a)) for n, a in found]
        pos = end + 1
    return ("", calls) if calls else None


def _top_level(s: str, seps: str = ","):
    """Yields (index, char) of s's characters in `seps` outside strings and brackets, and the
    brackets that close one open before s starts; a string's backslash escapes skipped."""
    depth, quote, i = 0, None, 0
    while i < len(s):
        c = s[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                yield i, c
        elif depth == 0 and c in seps:
            yield i, c
        i += 1


def _closing(s: str, pos: int) -> int | None:
    """Where the parenthesis open before s[pos] closes (strings and brackets inside skipped):
    None where s ends first, -1 where another bracket closes it (not a call)."""
    for i, c in _top_level(s[pos:], ""):
        return pos + i if c == ")" else -1
    return None


# a JSON number as far as it may be written
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9]\d*)?(?:\.\d*)?(?:[eE][+-]?\d*)?")


def _partial_arguments(written: str) -> str | None:
    """The JSON text of keyword arguments `written` up to a cut (`city="Par` -> `{"city":
    "Par`): a prefix of the whole call's JSON where the cut allows it. The whole ones as
    `_python_calls` reads them; the cut one's string decoded as far as it goes, a number as
    written, a value whole by now as JSON, any other (a list, True, ... cut short) left out after
    its key. "" where nothing was written; None where an argument is not a keyword one of
    JSON's values."""
    cuts = [i for i, _ in _top_level(written)]
    whole = {}
    if cuts:
        found = _python_calls(f"f({written[:cuts[-1]]})", ["f"])
        if found is None:
            return None
        whole = found[0][1]
    tail = written[cuts[-1] + 1 if cuts else 0:].strip()
    key, eq, value = (t.strip() for t in tail.partition("="))
    if not re.fullmatch(r"(?:[A-Za-z_]\w*)?", key) or (eq and not key):
        return None
    text = json.dumps(whole)[:-1]  # (the whole ones, the object left open)
    if eq:
        text += (", " if whole else "") + f"{json.dumps(key)}: {_partial_value(value)}"
    return text if whole or eq else ""


def _partial_value(v: str) -> str:
    """A Python literal cut short, as the start of its JSON text (see _partial_arguments)."""
    try:  # whole already (a string's closing quote written, a number)
        return json.dumps(_literal(ast.parse(v, mode="eval").body))
    except (SyntaxError, ValueError):
        pass
    if v[:1] in ("'", '"') and not v.startswith(v[0] * 3):  # a string cut short
        body = v[1:]
        if len(body) - len(body.rstrip("\\")) & 1:  # (an escape cut in two)
            body = body[:-1]
        try:
            return json.dumps(ast.literal_eval(v[0] + body + v[0]))[:-1]
        except (SyntaxError, ValueError):
            return ""
    return v if _NUMBER_PREFIX.fullmatch(v) else ""


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_BETWEEN_CALLS = re.compile(r"[\s\[,]*")


def _json_calls(body: str, names: list[str]) -> list[tuple[str, dict]] | None:
    try:
        got = json.loads(body)
    except ValueError:
        return None
    return _calls_of(got, names)


def _calls_of(got, names: list[str]) -> list[tuple[str, dict]] | None:
    """(name, arguments) of a decoded call or list of calls; None where one is not a call of
    the request's functions."""
    items = got if isinstance(got, list) else [got]
    out = []
    for c in items:
        if not (isinstance(c, dict) and c.get("name") in names):
            return None
        args = c.get("arguments", c.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        out.append((c["name"], args))
    return out


_PY_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False,
                 "None": None}


def _python_calls(body: str, names: list[str]) -> list[tuple[str, dict]] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    out = []
    for c in items:
        if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in names
                and not c.args):
            return None
        try:
            out.append((c.func.id, {k.arg: _literal(k.value) for k in c.keywords}))
        except ValueError:
            return None
    return out


def _literal(node):
    if isinstance(node, ast.Name) and node.id in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):  # (JSON's keys are strings)
            raise ValueError("a dict key that is not a string")
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand)
    try:  # a string or a number; ValueError for anything else
        value = ast.literal_eval(node)
    except TypeError as e:  # (a set of lists: unhashable)
        raise ValueError(str(e)) from None
    if not (value is None or isinstance(value, (str, int, float))):  # (bool is an int)
        raise ValueError(f"{type(value).__name__} is not a JSON value")  # (a set, bytes, 1j)
    return value


def grammar(tools: list[dict], fmt: str, only: str | None = None, parallel: bool = True) -> Grammar:
    """The grammar of a reply that is one call (or, parallel, one or more calls) of the tools,
    or of function `only`, in the format's syntax."""
    fs = [f for f in tools if only is None or f["name"] == only]
    more = ' (", " call)*' if parallel else ""
    if fmt == "gemma":
        rules = [f'start: "[" call{more} "]"', "call: " + " | ".join(f"c{i}" for i in range(len(fs)))]
        for i, f in enumerate(fs):
            rules += _python_call_rules(f"c{i}", f)
        return Grammar.lark("\n".join(rules) + "\n")
    alts = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": f["name"]}, "arguments": _schema(f["parameters"])}}
            for f in fs]
    call = alts[0] if len(alts) == 1 else {"anyOf": alts}
    call = {**call, "x-guidance": JSON_OPTIONS}
    if fmt == "smollm2":
        start = f'start: "<tool_call>[" call{more} "]</tool_call>"'
    else:
        start = 'start: "<tool_call>\\n" call "\\n</tool_call>"' + (
            ' ("\\n<tool_call>\\n" call "\\n</tool_call>")*' if parallel else "")
    return Grammar.lark(f"{start}\ncall: %json {json.dumps(call)}\n")


def _schema(params: dict) -> dict:
    """A function's parameters as the schema of its arguments: an object, with no properties
    but those described unless the schema allows others (a model is apt to copy the schema's
    own keys otherwise)."""
    if params.get("type") != "object" and "properties" not in params:
        return {"type": "object", "additionalProperties": False, "properties": {}}
    return {"additionalProperties": False, **params}


def _python_call_rules(rule: str, f: dict) -> list[str]:
    """name(k1=v1, k2=v2): the required parameters in order, then any of the optional ones in
    order, each a JSON value of its schema."""
    props = _schema(f["parameters"]).get("properties", {}) or {}
    required = [k for k in f["parameters"].get("required", []) if k in props]
    optional = [k for k in props if k not in required]
    names = required + optional
    rules = [f"{rule}_{j}: %json {json.dumps({**props[k], 'x-guidance': JSON_OPTIONS})}"
             for j, k in enumerate(names)]
    item = {k: f'"{k}=" {rule}_{j}' for j, k in enumerate(names)}
    if required:
        body = ' ", " '.join(item[k] for k in required)
        body += "".join(f' (", " {item[k]})?' for k in optional)
    elif optional:  # whichever optional parameter comes first, the later ones may follow
        firsts = [item[k] + "".join(f' (", " {item[o]})?' for o in optional[i + 1:])
                  for i, k in enumerate(optional)]
        body = "(" + " | ".join(firsts) + ")?"
    else:
        body = ""
    return [f'{rule}: "{f["name"]}(" {body} ")"'] + rules
