"""Tool calls: the constraint a forced tool choice puts on the output, and the readers that turn
a choice's text into OpenAI `tool_calls`, whole or as stream deltas.

- A named function (`tool_choice: {"type": "function", "function": {"name": ...}}`): the output
  is constrained to the function's parameter schema, and that JSON is the call's `arguments`.
- `"required"`: the output is constrained to a JSON array of one or more `{"name": ...,
  "parameters": {...}}` objects, each one of the tools with its own schema (one call only with
  `parallel_tool_calls: false`).
- `"auto"`: nothing is constrained; the model decides, in the format its chat template taught it.
  inflight reads Hermes' format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as in
  the Qwen 2.5/3, Hermes and SmolLM3 templates) and Llama 3.1-3.3's JSON (an answer that is one
  `{"name": ..., "parameters": {...}}` object, or several joined by ";": vLLM's `llama3_json`)
  and LFM2's Python-style calls (`<|tool_call_start|>[name(arg=value, ...), ...]<|tool_call_end|>`,
  its markers special tokens, kept in the text; llama.cpp's reading: Python literals, and JSON's
  true, false and null) and GLM-4.5's to 4.7's (`<tool_call>name<arg_key>k</arg_key><arg_value>v
  </arg_value>...</tool_call>`, a newline or none between; a value as written where the tool's
  schema types it a string, else JSON where it parses, as vLLM's glm45 reader takes it) and
  DeepSeek's (V3's, R1's and its distilled models': `<｜tool▁calls▁begin｜>` around calls
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` then the arguments' JSON in a ```json fence, or
  V3.1's `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}`, each up to `<｜tool▁call▁end｜>`; its markers
  special tokens, kept in the text); a template that renders tools in another format, or none,
  gets a 400 for "auto".
"""

from __future__ import annotations

import ast
import functools
import json
import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

from inflight.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

ToolMode = Literal["named", "required", "hermes", "llama3_json", "lfm2", "glm45", "deepseek"]
# The formats that tag each call (or list of calls) in the text, and the modes whose markers are
# special tokens (a request of that mode keeps them: skip_special_tokens off).
TAGGED_MODES = ("hermes", "lfm2", "glm45", "deepseek")
SPECIAL_TOKEN_MODES = ("lfm2", "glm45", "deepseek")
# A tool's name -> its parameters that its schema types as strings (GLM's values are written
# bare: these stay text whatever they look like).
StringArgs = dict[str, frozenset[str]]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LFM2_OPEN, LFM2_CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
# What Llama 3.1-3.3's templates tell the model when they render tools (3.2's and 3.3's alike).
LLAMA3_JSON_PROMPT = '"parameters": dictionary of argument name and its value'
# How LFM2's templates list the tools (LFM2's between special tokens, LFM2.5's plainly); llama.cpp
# recognizes the two templates by the same words.
LFM2_TOOL_LISTS = ("List of tools: <|tool_list_start|>[", "List of tools: [")
# GLM-4.5's to 4.7's templates name each argument between these (inside Hermes' tags).
GLM_ARG_KEY = "<arg_key>"
# DeepSeek's markers (V3's, R1's, V3.1's; special tokens of their vocabularies).
DEEPSEEK_CALLS_OPEN, DEEPSEEK_CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_OPEN, DEEPSEEK_CALL_CLOSE, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def tool_call_format(chat_template: str | None) -> Literal["hermes", "llama3_json", "lfm2", "glm45",
                                                           "deepseek"] | None:
    """The tool-call format a chat template teaches its model, if inflight can read it."""
    if not chat_template or "tools" not in chat_template:
        return None
    if GLM_ARG_KEY in chat_template:  # (its calls in Hermes' tags)
        return "glm45"
    if DEEPSEEK_CALLS_OPEN in chat_template:
        return "deepseek"
    if HERMES_OPEN in chat_template:
        return "hermes"
    if LLAMA3_JSON_PROMPT in chat_template:
        return "llama3_json"
    if any(words in chat_template for words in LFM2_TOOL_LISTS):
        return "lfm2"
    return None


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=text))


def _hermes_calls(body: str) -> list[ToolCall] | None:
    """A Hermes tag's body: one JSON call; None where it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    return [_call(value["name"], value.get("arguments", value.get("parameters", {})))]


# JSON's literals, which LFM2 writes among Python's (llama.cpp reads both).
_JSON_LITERALS = {"true": True, "false": False, "null": None}


def _python_value(node: ast.expr) -> Any:
    """An argument's value: a Python literal (JSON's true, false and null too); ValueError else."""
    if isinstance(node, ast.Name) and node.id in _JSON_LITERALS:
        return _JSON_LITERALS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_python_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):  # a ** unpacking
            raise ValueError("not a literal")
        return {_python_value(key): _python_value(value)  # type: ignore[arg-type]
                for key, value in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)


def _lfm2_calls(body: str) -> list[ToolCall] | None:
    """LFM2's tag body: a Python list of calls, `[name(arg=value, ...), ...]`, each argument by
    keyword; None where it is not one."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for item in tree.elts:
            if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and not item.args
                    and all(kw.arg is not None for kw in item.keywords)):
                return None
            calls.append(_call(item.func.id, {kw.arg: _python_value(kw.value) for kw in item.keywords}))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(text: str, is_string: bool) -> Any:
    """A GLM argument's value: as written for a string parameter, else its JSON (or a Python
    literal's) value where it is one, else the text."""
    if is_string:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text


def _glm_calls(body: str, string_args: StringArgs | None = None) -> list[ToolCall] | None:
    """GLM's tag body: the function's name, then each argument's key and value; None where it is
    not that (no name, a name with spaces, or text beside the arguments)."""
    at = body.find(GLM_ARG_KEY)
    name = (body if at < 0 else body[:at]).strip()
    if not name or any(c.isspace() for c in name):
        return None
    strings = (string_args or {}).get(name, frozenset())
    arguments, rest = {}, body[len(body) if at < 0 else at:]
    while rest.strip():
        match = _GLM_ARG.match(rest)
        if match is None:
            return None
        key = match.group(1).strip()
        arguments[key] = _glm_value(match.group(2), key in strings)
        rest = rest[match.end():]
    return [_call(name, arguments)]


_DEEPSEEK_CALL = re.compile(re.escape(DEEPSEEK_CALL_OPEN) + "(.*?)" + re.escape(DEEPSEEK_CALL_CLOSE), re.DOTALL)
_JSON_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _deepseek_calls(body: str) -> list[ToolCall] | None:
    """DeepSeek's calls block: calls one after another, each `function<｜tool▁sep｜>name` and its
    arguments' JSON in a fence (V3's, R1's) or `name<｜tool▁sep｜>` and the JSON (V3.1's); None
    where the block holds anything else, or a call is not one."""
    calls, at = [], 0
    for match in _DEEPSEEK_CALL.finditer(body):
        if body[at:match.start()].strip():
            return None
        at = match.end()
        head, sep, rest = match.group(1).partition(DEEPSEEK_SEP)
        if not sep:
            return None
        if head.strip() == "function":  # V3's and R1's: the name on the first line, then the fenced JSON
            name, _, rest = rest.partition("\n")
            fenced = _JSON_FENCE.match(rest.strip())
            rest = fenced.group(1) if fenced else rest
        else:
            name = head
        name = name.strip()
        try:
            arguments = json.loads(rest)
        except json.JSONDecodeError:
            return None
        if not name or any(c.isspace() for c in name) or not isinstance(arguments, dict):
            return None
        calls.append(_call(name, arguments))
    if not calls or body[at:].strip():
        return None
    return calls


# Each tagged format: its markers and the reader of a tag's body.
_TAGS: dict[str, tuple[str, str, Callable[[str], list[ToolCall] | None]]] = {
    "hermes": (HERMES_OPEN, HERMES_CLOSE, _hermes_calls), "lfm2": (LFM2_OPEN, LFM2_CLOSE, _lfm2_calls),
    "glm45": (HERMES_OPEN, HERMES_CLOSE, _glm_calls),
    "deepseek": (DEEPSEEK_CALLS_OPEN, DEEPSEEK_CALLS_CLOSE, _deepseek_calls)}


def string_args(tools: list[Any] | None) -> StringArgs:
    """Each tool's parameters that its schema types as strings (`Tool`s as the request has them)."""
    out: StringArgs = {}
    for tool in tools or ():
        properties = (tool.function.parameters or {}).get("properties") or {}
        out[tool.function.name] = frozenset(key for key, schema in properties.items()
                                            if isinstance(schema, dict) and schema.get("type") == "string")
    return out


def _tag_reader(mode: str, strings: StringArgs | None) -> tuple[str, str, Callable[[str], list[ToolCall] | None]]:
    """A tagged format's markers and body reader (GLM's knowing which arguments are strings)."""
    open_tag, close_tag, read = _TAGS.get(mode, _TAGS["hermes"])
    if read is _glm_calls:
        read = functools.partial(_glm_calls, string_args=strings)
    return open_tag, close_tag, read


def _required_calls(text: str) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None  # cut short by max_tokens
    return [_call(item["name"], item["parameters"]) for item in value]


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside tool-call tags, or None if nothing is left; the calls inside them). A
    tag whose body is not a call (bad JSON, no name) stays in the text."""
    return parse_tagged(text, "hermes")


def parse_tagged(text: str, mode: str, strings: StringArgs | None = None) -> tuple[str | None, list[ToolCall]]:
    """`parse_hermes` for any tagged format (`TAGGED_MODES`): LFM2's tags hold a list of calls,
    GLM's a name and its arguments (`strings`: those to keep as written). A mode of no format of
    its own ("auto" resolved elsewhere) reads Hermes' tags, as before."""
    open_tag, close_tag, read = _tag_reader(mode, strings)
    content, calls, rest = [], [], text
    while (start := rest.find(open_tag)) >= 0:
        end = rest.find(close_tag, start)
        body_end = end if end >= 0 else len(rest)
        found = read(rest[start + len(open_tag):body_end].strip())
        if found is None:
            content.append(rest[:body_end + (len(close_tag) if end >= 0 else 0)])
        else:
            content.append(rest[:start])
            calls.extend(found)
        rest = rest[body_end + len(close_tag):] if end >= 0 else ""
    content.append(rest)
    joined = "".join(content).strip()
    return joined or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3's calls: an answer that is JSON objects with a "name" and "parameters" (or
    "arguments"), joined by ";", is those calls; any other answer (prose, or JSON that is not all
    calls) is content, as it stands."""
    body = text.strip()
    if not body.startswith("{"):
        return text or None, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            return text, []
        calls.append(_call(value["name"], value.get("parameters", value.get("arguments", {}))))
        at = end
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return None, calls


class ToolCallReader:
    """One choice's text as content and tool calls, for a response (`whole`) or a stream
    (`feed` each delta's text, then `end`)."""

    def __init__(self, mode: ToolMode, function_name: str | None = None, strings: StringArgs | None = None) -> None:
        """`strings`: each tool's string parameters (`string_args`), for GLM's bare values."""
        self.mode = mode
        self.function_name = function_name
        self.strings = strings
        self._text = ""
        self._sent = 0  # of _text, streamed as content (hermes) or arguments (named)
        self._named_id: str | None = None
        self.num_calls = 0

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":
            assert self.function_name is not None
            return None, [_call(self.function_name, text)]
        if self.mode == "required":
            calls = _required_calls(text)
            return (text, []) if calls is None else (None, calls)
        if self.mode == "llama3_json":
            return parse_llama3_json(text)
        return parse_tagged(text, self.mode, self.strings)

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """(content to stream now, tool-call deltas to stream now) for a delta's new text."""
        self._text += text
        if self.mode == "named":
            return "", self._named_delta(text)
        if self.mode == "required":
            return "", []  # a call is known once the array is whole: sent by `end`
        if self.mode == "llama3_json":
            return self._llama3_step(final=False)
        return self._tagged_step(final=False)

    def end(self) -> tuple[str, list[DeltaToolCall]]:
        """What is left to stream once the choice has finished."""
        if self.mode == "named":
            return "", self._named_delta("") if self._named_id is None else []
        if self.mode == "required":
            calls = _required_calls(self._text)
            if calls is None:
                return self._text, []
            return "", [self._delta(call) for call in calls]
        if self.mode == "llama3_json":
            return self._llama3_step(final=True)
        return self._tagged_step(final=True)

    def _delta(self, call: ToolCall) -> DeltaToolCall:
        self.num_calls += 1
        return DeltaToolCall(index=self.num_calls - 1, id=call.id, type="function",
                             function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))

    def _named_delta(self, text: str) -> list[DeltaToolCall]:
        if self._named_id is None:
            assert self.function_name is not None
            self._named_id = f"call_{uuid.uuid4().hex[:24]}"
            self.num_calls = 1
            return [DeltaToolCall(index=0, id=self._named_id, type="function",
                                  function=DeltaFunctionCall(name=self.function_name, arguments=text))]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))] if text else []

    def _llama3_step(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """An answer that opens with "{" may be calls: held whole, read at the end; any other
        streams as content as it comes."""
        opening = self._text.lstrip()
        if not final and (not opening or opening.startswith("{")):
            return "", []  # nothing but spaces yet, or perhaps calls
        pending, self._sent = self._text[self._sent:], len(self._text)
        if not opening.startswith("{"):
            return pending, []
        content, calls = parse_llama3_json(self._text)
        return content or "", [self._delta(call) for call in calls]

    def _tagged_step(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """Streams the content before each tool-call tag (holding back what could be the start of
        one) and each call once its closing tag (or, at the end, the end of the text) arrives."""
        open_tag, close_tag, read = _tag_reader(self.mode, self.strings)
        content, deltas = "", list[DeltaToolCall]()
        while True:
            pending = self._text[self._sent:]
            start = pending.find(open_tag)
            if start < 0:
                hold = 0 if final else partial_suffix(pending, open_tag)
                content += pending[:len(pending) - hold]
                self._sent += len(pending) - hold
                return content, deltas
            content += pending[:start]
            end = pending.find(close_tag, start)
            if end < 0 and not final:
                self._sent += start
                return content, deltas
            body_end = end if end >= 0 else len(pending)
            calls = read(pending[start + len(open_tag):body_end].strip())
            consumed = body_end + (len(close_tag) if end >= 0 else 0)
            if calls is None:
                content += pending[start:consumed]
            else:
                deltas.extend(self._delta(call) for call in calls)
            self._sent += consumed


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
