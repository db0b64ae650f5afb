"""Function calling on the chat endpoint, as OpenAI's API defines it: a request's `tools`,
`tool_choice` and `parallel_tool_calls`; the history's tool calls and tool results, made
ready for the chat template; and the reply read back as tool calls.

Which tool calls are read, and how:

- `none`: the reply is text, as without tools;
- `auto`: the model writes its calls in its own format, and the reader finds them in the
  text (vLLM's --tool-call-parser; specd implements `hermes`:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; `llama3_json`: a reply
  that is `{"name": ..., "parameters": {...}}` objects, `; ` apart; `mistral`: `[TOOL_CALLS]`
  and a JSON list of `{"name": ..., "arguments": {...}}`);
- `required`: one call or more (one without `parallel_tool_calls`) in that format,
  generated under a grammar whose calls each name one of the tools and give arguments of
  its schema (llguidance's Lark, with each tool's schema inline as `%json`);
- a named function: its arguments object, generated under its schema.

The two forced choices are structured output (`gateway.grammar`), so they are exact under
speculation for every proposer, as structured output is. A template that does not
render `tools` gets the format's instructions in the prompt instead (`ToolFormat.preamble`,
`tools_as_text`), so that a model whatever its template can be asked for calls.
No gRPC, no model here.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.edge.bodies import HttpError
from gateway.grammar import JSON_OPTIONS, StructureSpec

# OpenAI's rule for a function's name.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function that declares no parameters takes none, as OpenAI reads it.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, its arguments' JSON schema, and the tool as
    the client sent it (what the chat template renders)."""

    name: str
    parameters: dict[str, Any]
    spec: dict[str, Any] = field(compare=False)


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks of tool calls. choice: one of CHOICES, or "named" for the
    function `named`; parallel: whether `required` and `auto` may give several calls."""

    tools: tuple[Tool, ...]
    choice: str
    named: str = ""
    parallel: bool = True
    parser: str = "hermes"

    def structure(self) -> StructureSpec | None:
        """The grammar of a forced call: the named function's arguments, or `required`'s calls."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return StructureSpec("json", json.dumps(tool.parameters))
        if self.choice == "required":
            return StructureSpec("grammar", FORMATS[self.parser].grammar(self.tools, self.parallel))
        return None

    def reader(self) -> ToolReader | None:
        """A fresh reader of one choice's text (None: the text is the reply, unread)."""
        if self.choice == "named":
            return NamedCall(self.named)
        if self.choice == "none":
            return None
        return FORMATS[self.parser].reader(frozenset(t.name for t in self.tools), self.parallel)

    def finish_reason(self, reason: str, calls: int) -> str:
        """"tool_calls" when the reply ended on calls; a named call ends with "stop", as
        OpenAI's (and vLLM's) do, and a reply cut short keeps "length"."""
        if calls and reason != "length" and self.choice != "named":
            return "tool_calls"
        return reason


def tool_calling(body: dict[str, Any], parser: str) -> ToolCalling | None:
    """The request's tool fields, checked (400 naming what is wrong); None without `tools`."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None:
        for name, value in (("tool_choice", choice), ("parallel_tool_calls", parallel)):
            if value is not None:
                raise HttpError(400, f"'{name}' is only allowed with 'tools'", param=name)
        return None
    if not isinstance(tools, list) or not tools:
        raise HttpError(400, "'tools' must be a non-empty list of {type: 'function', function: {name, "
                             "description, parameters}}", param="tools")
    read = tuple(_tool(i, tool) for i, tool in enumerate(tools))
    names = [t.name for t in read]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise HttpError(400, f"'tools' names {twice} more than once; each function needs a name of its own",
                        param="tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise HttpError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    named = ""
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    elif isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or set(choice) != {"type", "function"} or not isinstance(function, dict) \
                or set(function) != {"name"} or not isinstance(function["name"], str):
            raise HttpError(400, "'tool_choice' names a function as {type: 'function', function: {name}}",
                            param="tool_choice")
        named = function["name"]
        if named not in names:
            raise HttpError(400, f"'tool_choice' names the function {named[:64]!r}, which is not in 'tools' "
                                 f"({', '.join(names)[:200]})", param="tool_choice")
        choice = "named"
    elif choice not in CHOICES:
        raise HttpError(400, f"'tool_choice' is one of {list(CHOICES)} or {{type: 'function', function: {{name}}}}, "
                             f"got {json.dumps(choice)[:60]}", param="tool_choice")
    return ToolCalling(read, choice, named, parallel is not False, parser)


def _tool(index: int, tool: Any) -> Tool:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function":
        raise HttpError(400, f"{where} must be {{type: 'function', function: {{name, description, parameters}}}}",
                        param="tools")
    for keys, known, what in ((tool, _TOOL_KEYS, where), (function, _FUNCTION_KEYS, f"{where}.function")):
        unknown = sorted(set(keys) - known)
        if unknown:
            raise HttpError(400, f"{what} holds fields specd does not know: {unknown}; it knows {sorted(known)}",
                            param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise HttpError(400, f"{where}.function needs a 'name' of 1 to 64 letters, digits, '_' or '-', got "
                             f"{json.dumps(name)[:80]}", param="tools")
    if not isinstance(function.get("description", ""), str):
        raise HttpError(400, f"{where}.function.description must be a string", param="tools")
    if not isinstance(function.get("strict", False), bool):
        raise HttpError(400, f"{where}.function.strict must be true or false", param="tools")
    parameters = function.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise HttpError(400, f"{where}.function.parameters must be a JSON schema (an object)", param="tools")
    return Tool(name, parameters, tool)


# -- the history and the prompt ---------------------------------------------------------------

def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation, checked, in the shapes chat templates read (transformers' and
    vLLM's): text content; an assistant's `tool_calls` with their arguments as an object
    where their text is one; a `tool` message's `tool_call_id`; `name` where given."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    return [_message(i, message) for i, message in enumerate(messages)]


_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise HttpError(400, f"{where} must be {{role, content}} with text content", param="messages")
    unknown = sorted(set(message) - _MESSAGE_KEYS)
    if unknown:
        raise HttpError(400, f"{where} holds fields specd does not know: {unknown}", param="messages")
    role, content, calls = message["role"], message.get("content"), message.get("tool_calls")
    if isinstance(content, list):  # OpenAI's content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise HttpError(400, f"{where}: only text content parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    plain: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise HttpError(400, f"{where}: 'tool_calls' is a list, on an assistant message", param="messages")
        plain["tool_calls"] = [_history_call(f"{where}.tool_calls[{j}]", call) for j, call in enumerate(calls)]
        if content is not None and not isinstance(content, str):
            raise HttpError(400, f"{where}: an assistant's content beside its tool calls is text or null",
                            param="messages")
    elif not isinstance(content, str):
        raise HttpError(400, f"{where} must be {{role, content}} with text content", param="messages")
    call_id = message.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str):
            raise HttpError(400, f"{where}: a tool message needs the 'tool_call_id' of the call it answers",
                            param="messages")
        plain["tool_call_id"] = call_id
    elif call_id is not None:
        raise HttpError(400, f"{where}: 'tool_call_id' belongs on a tool message", param="messages")
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise HttpError(400, f"{where}: 'name' must be a string", param="messages")
        plain["name"] = name
    return plain


def _history_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function" \
            or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str) \
            or not isinstance(call.get("id", ""), str):
        raise HttpError(400, f"{where} must be {{id, type: 'function', function: {{name, arguments}}}} with "
                             f"arguments as JSON text", param="messages")
    arguments: Any = function["arguments"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    # Templates write the arguments with `tojson`: an object, as vLLM hands them over. Text
    # that is not an object's (a model's broken call sent back) stays text.
    if isinstance(parsed, dict):
        arguments = parsed
    return {"id": call.get("id", ""), "type": "function", "function": {"name": function["name"],
                                                                       "arguments": arguments}}


# What tells a template that renders `tools` from one that does not: a tool it would list.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe",
                                                "parameters": NO_PARAMETERS}}


def renders_tools(render: Callable[..., str]) -> bool:
    """Whether a chat template writes the tools into the prompt: `render(messages, **kwargs)`
    renders the same conversation differently with a tool than without. A template that
    fails the probe is taken not to render them."""
    probe = [{"role": "user", "content": "hello"}]
    try:
        return render(probe, tools=[_PROBE_TOOL]) != render(probe)
    except Exception:  # the template's own checks raise anything
        return False


def hermes_preamble(tools: tuple[Tool, ...], parallel: bool) -> str:
    """The system text that asks for hermes calls (the wording of Qwen 2.5's and Hermes 2
    Pro's templates, which models of that format were trained on)."""
    listed = "\n".join(json.dumps(t.spec, ensure_ascii=False) for t in tools)
    many = "one or more functions" if parallel else "one function"
    return (f"# Tools\n\nYou may call {many} to assist with the user query.\n\nYou are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, "
            f"return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            f"<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def llama3_preamble(tools: tuple[Tool, ...], parallel: bool) -> str:
    """The system text that asks for Llama 3 JSON calls (the instruction Llama 3.1's own
    template gives with tools)."""
    listed = "\n\n".join(json.dumps(t.spec, ensure_ascii=False, indent=4) for t in tools)
    many = " Several calls are written one after another, separated by '; '." if parallel else ""
    return ("Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
            f"\"parameters\": dictionary of argument name and its value}}. Do not use variables.{many}\n\n{listed}")


def mistral_preamble(tools: tuple[Tool, ...], parallel: bool) -> str:
    """The system text that asks for Mistral calls: the tools as Mistral's templates list
    them, and the form of a call."""
    many = "a JSON list of one or more calls" if parallel else "a JSON list of one call"
    return (f"[AVAILABLE_TOOLS]{json.dumps([t.spec for t in tools], ensure_ascii=False)}[/AVAILABLE_TOOLS]\n\n"
            f"To call a function, reply with [TOOL_CALLS] followed by {many}, each "
            "{\"name\": <function-name>, \"arguments\": <args-json-object>}.")


def with_preamble(messages: list[dict[str, Any]], preamble: str) -> list[dict[str, Any]]:
    """The conversation with `preamble` at the end of its system message, or as one first."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{preamble}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def tools_as_text(messages: list[dict[str, Any]], parser: str) -> list[dict[str, Any]]:
    """The conversation in text a template that knows no tools renders: an assistant's calls
    written in the parser's format after its text, and each run of tool results as one user
    message of `<tool_response>` blocks (Qwen 2.5's template does the same)."""
    write_calls = FORMATS[parser].write_calls
    plain: list[dict[str, Any]] = []
    results = False  # whether the last message made is a run of tool results
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if results:
                plain[-1] = {**plain[-1], "content": f"{plain[-1]['content']}\n{response}"}
            else:
                plain.append({"role": "user", "content": response})
            results = True
            continue
        results = False
        if "tool_calls" in message:
            calls = write_calls([call["function"] for call in message["tool_calls"]])
            text = "\n".join(([message["content"]] if message["content"] else []) + [calls])
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
        plain.append(message)
    return plain


def _hermes_calls(functions: list[dict[str, Any]]) -> str:
    return "\n".join(f"{HermesCalls.START}\n{_call_json(f, 'arguments')}\n{HermesCalls.END}" for f in functions)


def _llama3_calls(functions: list[dict[str, Any]]) -> str:
    return Llama3Calls.SEPARATOR.join(_call_json(f, "parameters") for f in functions)


def _mistral_calls(functions: list[dict[str, Any]]) -> str:
    return MistralCalls.START + json.dumps([{"name": f["name"], "arguments": f["arguments"]} for f in functions],
                                           ensure_ascii=False)


def _call_json(function: dict[str, Any], key: str) -> str:
    return json.dumps({"name": function["name"], key: function["arguments"]}, ensure_ascii=False)


# -- reading the reply ------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """A piece of a reply: text outside the tool calls (call None), or arguments text of the
    call numbered `call`. A call's first piece names its function and carries its id."""

    text: str
    call: int | None = None
    id: str = ""
    name: str = ""


class ToolReader(ABC):
    """Reads one choice's text, piece by piece as it is generated, into `Piece`s; `calls`:
    how many calls it has found so far."""

    calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces the text read so far makes certain."""

    @abstractmethod
    def end(self) -> list[Piece]:
        """The pieces still held once the text is whole."""


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class NamedCall(ToolReader):
    """A named tool_choice: the whole text is that function's arguments, sent as it comes."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> list[Piece]:
        if self.calls == 0:
            self.calls = 1
            return [Piece("", 0, _call_id(), self.name), Piece(text, 0)]
        return [Piece(text, 0)]

    def end(self) -> list[Piece]:
        return self.feed("")


class _TextAndCalls(ToolReader):
    """A reader whose text may hold calls: the whitespace around a call is not the reply's
    text, so trailing whitespace is held until more text follows."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.space = ""  # whitespace held after the text read: it is sent only if text follows
        self.after_call = False  # the whitespace right after a call is not the reply's text

    def _text(self, text: str, pieces: list[Piece]) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        body = text.rstrip()
        if body:
            pieces.append(Piece(self.space + body))
            self.space = ""
        self.space += text[len(body):]

    def _flush(self, pieces: list[Piece]) -> None:
        if self.space:
            pieces.append(Piece(self.space))
            self.space = ""

    def _parts(self, value: Any, keys: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
        """The name and arguments of `value` if it is a call: a JSON object naming one of the
        tools, with its arguments, an object, under the first of `keys` it holds (none: {})."""
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        arguments: Any = next((value[key] for key in keys if key in value), {})
        if not isinstance(arguments, dict) or not isinstance(name, str) or name not in self.names:
            return None
        return name, arguments

    def _call(self, value: Any, keys: tuple[str, ...], pieces: list[Piece]) -> bool:
        """Take `value` as the next call if it is one (with `parallel` false, only while no
        call was taken). The call is sent whole: its name, then its arguments in one piece,
        written back with `json.dumps` as vLLM's parsers do."""
        parts = self._parts(value, keys)
        if parts is None or self.calls and not self.parallel:
            return False
        index = self.calls
        self.calls += 1
        pieces += [Piece("", index, _call_id(), parts[0]), Piece(json.dumps(parts[1], ensure_ascii=False), index)]
        self.after_call = True
        return True


class HermesCalls(_TextAndCalls):
    """vLLM's `hermes` parser: `<tool_call>` JSON `</tool_call>` blocks in the text, each
    `{"name": ..., "arguments": {...}}`. A block is a call when its JSON names one of the
    tools (with `parallel` false, only the first block is); any other block stays text, as
    does the rest of the text, less the whitespace around the calls. A call is sent once its
    block closes. A block the text ends inside (EOS or max_tokens before `</tool_call>`) is
    read as if closed there."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__(names, parallel)
        self.pending = ""  # text not yet read: a block still open, or what may begin one
        self.inside = False  # whether `pending` is inside a block

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while True:
            if self.inside:
                close = self.pending.find(self.END)
                if close < 0:
                    return pieces
                self._block(self.pending[:close], pieces)
                self.pending, self.inside = self.pending[close + len(self.END):], False
            else:
                start = self.pending.find(self.START)
                if start < 0:
                    kept = _partial_suffix(self.pending, self.START)
                    self._text(self.pending[:len(self.pending) - kept], pieces)
                    self.pending = self.pending[len(self.pending) - kept:]
                    return pieces
                self._text(self.pending[:start], pieces)
                self.space = ""  # the whitespace before a call is not the reply's text
                self.pending, self.inside = self.pending[start + len(self.START):], True

    def end(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self.inside:
            self._block(self.pending, pieces, closed=False)
        else:
            self._text(self.pending, pieces)
        self.pending = ""
        self._flush(pieces)
        return pieces

    def _block(self, block: str, pieces: list[Piece], closed: bool = True) -> None:
        try:
            value = json.loads(block)
        except ValueError:
            value = None
        if not self._call(value, ("arguments",), pieces):
            self._text(self.START + block + (self.END if closed else ""), pieces)


class Llama3Calls(_TextAndCalls):
    """vLLM's `llama3_json` parser: a reply that begins (after whitespace, and Llama's
    `<|python_tag|>` where the text keeps special tokens) with `{` is read as calls: JSON
    objects `{"name": ..., "parameters": {...}}` ("arguments" is read too), `; ` apart. Such
    a reply is held until it is whole. When every object is a call of one of the tools they
    are the calls (with `parallel` false the first, the rest text); otherwise the whole
    reply is text, as vLLM returns it. Any other reply is text, sent as it comes."""

    TAG, SEPARATOR = "<|python_tag|>", "; "

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__(names, parallel)
        self.held = ""  # the reply so far, while it may still be calls
        self.text = False  # the reply is text

    def feed(self, text: str) -> list[Piece]:
        if self.text:
            return [Piece(text)] if text else []
        self.held += text
        head = self.held.lstrip()
        if not head or self.TAG.startswith(head) or head.startswith((self.TAG, "{")):
            return []
        self.text, held, self.held = True, self.held, ""
        return [Piece(held)]

    def end(self) -> list[Piece]:
        held, self.held = self.held, ""
        if self.text or not held:
            return []
        body = held.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        objects = _json_run(body, self.SEPARATOR.strip())
        keys = ("parameters", "arguments")
        if not objects or any(self._parts(value, keys) is None for value, _ in objects):
            return [Piece(held)]
        pieces: list[Piece] = []
        for value, _ in objects:
            self._call(value, keys, pieces)
        if self.calls < len(objects):  # parallel_tool_calls false: the calls after the first stay text
            pieces.append(Piece(body[objects[0][1]:].lstrip().removeprefix(self.SEPARATOR.strip()).lstrip()))
        return pieces


class MistralCalls(_TextAndCalls):
    """vLLM's `mistral` parser: the text before `[TOOL_CALLS]` is text, sent as it comes;
    after it, a JSON list of `{"name": ..., "arguments": {...}}`, held until the reply is
    whole. When every entry is a call of one of the tools they are the calls (with
    `parallel` false the first; the rest, as a JSON list, text); otherwise the marker and
    all after it stay text."""

    START = "[TOOL_CALLS]"

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__(names, parallel)
        self.pending = ""  # text not yet read: what may begin the marker, or all after it
        self.inside = False  # whether the marker was read

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        if self.inside:
            return pieces
        at = self.pending.find(self.START)
        if at >= 0:
            self._text(self.pending[:at], pieces)
            self.space = ""  # the whitespace before the calls is not the reply's text
            self.pending, self.inside = self.pending[at + len(self.START):], True
            return pieces
        kept = _partial_suffix(self.pending, self.START)
        self._text(self.pending[:len(self.pending) - kept], pieces)
        self.pending = self.pending[len(self.pending) - kept:]
        return pieces

    def end(self) -> list[Piece]:
        pieces: list[Piece] = []
        pending, self.pending = self.pending, ""
        if not self.inside:
            self._text(pending, pieces)
            self._flush(pieces)
            return pieces
        try:
            entries = json.loads(pending)
        except ValueError:
            entries = None
        if not isinstance(entries, list) or not entries or \
                any(self._parts(entry, ("arguments",)) is None for entry in entries):
            self._text(self.START + pending, pieces)
        else:
            rest = [entry for entry in entries if not self._call(entry, ("arguments",), pieces)]
            if rest:  # parallel_tool_calls false: the calls after the first stay text
                self._text(json.dumps(rest, ensure_ascii=False), pieces)
        self._flush(pieces)
        return pieces


def _json_run(text: str, separator: str) -> list[tuple[Any, int]] | None:
    """The JSON values `text` holds one after another, `separator` (and whitespace) apart,
    each with the index just past it; None when it holds anything else."""
    decoder = json.JSONDecoder()
    values: list[tuple[Any, int]] = []
    at = 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append((value, at))
        rest = text[at:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            return None
        at = len(text) - len(rest[len(separator):].lstrip())


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may yet become it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _calls_grammar(tools: tuple[Tool, ...], parallel: bool, head: Callable[[str], str], tail: str, separator: str,
                   before: str = "", after: str = "") -> str:
    """llguidance Lark for `required`: `before`, one call (with `parallel` one or more,
    `separator` apart), `after`. A call of tool t is `head(t.name)`, arguments of its
    schema, `tail`. The schema is its own root under `%json`, so its `$ref`s resolve as the
    client wrote them."""
    calls = [f"call_{i}: {json.dumps(head(tool.name))} %json {_inline_schema(tool.parameters)} {json.dumps(tail)}"
             for i, tool in enumerate(tools)]
    more = f" ({json.dumps(separator)} call)*" if parallel else ""
    start = " ".join(part for part in (json.dumps(before) if before else "", f"call{more}",
                                       json.dumps(after) if after else "") if part)
    return "\n".join([f"start: {start}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools))), *calls]) + "\n"


def _call_head(key: str, before: str = "") -> Callable[[str], str]:
    """The text of a call up to its arguments: `before`, then the JSON object's name and `key`."""
    return lambda name: f'{before}{{"name": {json.dumps(name)}, "{key}": '


def hermes_grammar(tools: tuple[Tool, ...], parallel: bool) -> str:
    """`required` as hermes blocks, a line apart."""
    return _calls_grammar(tools, parallel, _call_head("arguments", HermesCalls.START + "\n"),
                          "}\n" + HermesCalls.END, "\n")


def llama3_grammar(tools: tuple[Tool, ...], parallel: bool) -> str:
    """`required` as Llama 3 JSON objects, `; ` apart."""
    return _calls_grammar(tools, parallel, _call_head("parameters"), "}", Llama3Calls.SEPARATOR)


def mistral_grammar(tools: tuple[Tool, ...], parallel: bool) -> str:
    """`required` as `[TOOL_CALLS]` and a JSON list of calls."""
    return _calls_grammar(tools, parallel, _call_head("arguments"), "}", ", ", MistralCalls.START + "[", "]")


def _inline_schema(schema: dict[str, Any]) -> str:
    """A schema as `%json` text: compact JSON output, as gateway.grammar's JSON structures.
    gateway.grammar reads a grammar holding "::=" as GBNF: written `\\u003a:=` in the JSON
    (only a string can hold it), it reads the same and is not taken for GBNF."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}).replace("::=", "\\u003a:=")


@dataclass(frozen=True)
class ToolFormat:
    """A --tool-call-parser: the grammar of `required` calls, the reader of a reply, and for
    a template that does not render tools, the system text that asks for calls and how an
    assistant's calls are written in the history."""

    grammar: Callable[[tuple[Tool, ...], bool], str]
    reader: Callable[[frozenset[str], bool], ToolReader]
    preamble: Callable[[tuple[Tool, ...], bool], str]
    write_calls: Callable[[list[dict[str, Any]]], str]


FORMATS = {"hermes": ToolFormat(hermes_grammar, HermesCalls, hermes_preamble, _hermes_calls),
           "llama3_json": ToolFormat(llama3_grammar, Llama3Calls, llama3_preamble, _llama3_calls),
           "mistral": ToolFormat(mistral_grammar, MistralCalls, mistral_preamble, _mistral_calls)}


# -- the reply's objects ----------------------------------------------------------------------

def chunk_delta(pieces: list[Piece]) -> dict[str, Any]:
    """A stream chunk's delta of these pieces: `content`, and `tool_calls` entries as the
    official client joins them (index; id, type and function.name in a call's first entry;
    function.arguments in pieces)."""
    out: dict[str, Any] = {}
    text = "".join(p.text for p in pieces if p.call is None)
    if text:
        out["content"] = text
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if piece.call is None:
            continue
        entry = calls.get(piece.call)
        if entry is None:
            entry = calls[piece.call] = {"index": piece.call}
            if piece.id:
                entry |= {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}
            else:
                entry["function"] = {"arguments": ""}
        entry["function"]["arguments"] += piece.text
    if calls:
        out["tool_calls"] = list(calls.values())
    return out


def reply_message(pieces: list[Piece]) -> dict[str, Any]:
    """The assistant message of a whole reply: `content` is the text outside the calls (null
    when there is none beside them), `tool_calls` is there when there are calls."""
    whole = chunk_delta(pieces)
    calls = [{k: v for k, v in entry.items() if k != "index"} for entry in whole.get("tool_calls", [])]
    reply: dict[str, Any] = {"role": "assistant", "content": whole.get("content", None if calls else "")}
    if calls:
        reply["tool_calls"] = calls
    return reply
