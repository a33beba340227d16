"""Tool calling for chat: OpenAI's ``tools`` / ``tool_choice`` in, ``tool_calls`` out.

Two formats, picked by the chat template:

* **Hermes** (the template takes a ``tools`` variable, as Qwen2.5's and Hermes'
  do): the template describes the tools; the model writes
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
* **Generic JSON** (templates that know nothing of tools, such as SmolLM2's; what
  llama.cpp does for such models): a system message describes the tools and the
  answer is one JSON object, either ``{"tool_calls": [{"name", "arguments"}, ...]}``
  or ``{"response": "..."}``; the grammar enforces that shape and each tool's
  parameter schema.

``tool_choice``: ``none`` (no tools offered), ``auto`` (the model chooses),
``required`` (at least one call) or a named function (exactly that one). With
``required`` or a named function the output is constrained to the call's JSON
schema in both formats; with ``auto`` the generic format is constrained to "a call
or a reply", the Hermes format is left free and parsed afterwards.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.structured.constraint import StructuredOutputs
from tokenmill.structured.grammar import JSON_OPTIONS

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, after validation."""

    tools: tuple[Tool, ...]
    choice: str  # "auto" | "required" | "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True
    hermes: bool = False  # the chat template renders tools itself

    # -------------------------------------------------------------- the prompt

    def render_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages for the chat template: assistant tool calls and tool results in the
        format's text form; for the generic format, the tools in a system message."""
        out = [_render_message(m, self.hermes) for m in messages]
        if self.hermes:
            return out
        prompt = self._system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out

    def _system_prompt(self) -> str:
        tools = "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in self.offered)
        if self.choice == "auto":
            shape = (
                'either with "tool_calls" (a list of calls, each {"name": ..., "arguments": {...}}) '
                'or with "response" (your reply to the user)'
            )
        else:
            shape = 'with "tool_calls": a list of calls, each {"name": ..., "arguments": {...}}'
        return f"You can call these tools:\n{tools}\nRespond in JSON format, {shape}."

    @property
    def offered(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.named is None or t.name == self.named)

    @property
    def single_call(self) -> bool:
        """At most one call per answer (parallel_tool_calls false, or a named function)."""
        return not self.parallel or self.named is not None

    # ----------------------------------------------------------- the constraint

    def constraint(self) -> StructuredOutputs | None:
        """What the output must match (None: free text, parsed afterwards)."""
        one_call = {"anyOf": [_call_schema(t) for t in self.offered]}
        if self.hermes:
            if self.choice == "auto":
                return None
            # JSON_OPTIONS inside the Lark grammar too: no free whitespace to loop on
            block = f'"<tool_call>\\n" %json {json.dumps({**one_call, "x-guidance": JSON_OPTIONS})} "\\n</tool_call>"'
            repeat = "" if self.single_call else f' ("\\n" {block})*'
            return StructuredOutputs(grammar=f"start: {block}{repeat}\n")
        calls = {"type": "array", "items": one_call, "minItems": 1, **({"maxItems": 1} if self.single_call else {})}
        with_calls = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        if self.choice != "auto":
            return StructuredOutputs(json=with_calls)
        reply = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        return StructuredOutputs(json={"anyOf": [with_calls, reply]})

    # ------------------------------------------------------------ the answer

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished answer: what streaming it sends, so that
        streamed and whole answers carry the same calls wherever the answer was cut.
        The format's wrapper is never content; text that is not in the format is."""
        stream = ToolStream(self)
        content = "".join(d.get("content", "") for d in stream.feed(text, finished=True))
        if stream.calls:
            return content.strip() or None, stream.calls
        return content, []


class ToolStream:
    """Streams one answer of a ``ToolRequest`` as OpenAI's deltas, as it is generated;
    ``parse`` is this stream run over a whole answer.

    Generic format: ``{"response": "...`` streams the reply's text as it decodes;
    ``{"tool_calls": [{"name": "f", "arguments": ...`` sends each call's id, type and
    name once its name is whole, then its arguments' JSON text piece by piece (a call
    cut by ``max_tokens`` keeps the arguments it has, as OpenAI's do). The wrapper is
    never content, even cut short. Hermes format: text outside the blocks streams as
    content (holding back what could start ``<tool_call>``); each call is sent whole at
    its ``</tool_call>``; one that is not a call is content. In both formats a call cut
    short by ``max_tokens`` is kept with the arguments it has (not valid JSON; the
    finish_reason says ``length``) once its name is whole, and dropped before that, as is
    a tag cut short. ``feed`` takes the new text and returns the deltas to send
    (``{"content": ...}`` or ``{"tool_calls": [...]}``).
    """

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.text = ""
        self.calls: list[ToolCall] = []  # announced, with the arguments sent so far
        self._sent_content = 0  # characters of content sent
        self._next_call = len(_CALLS)  # generic format: where the first call not yet complete starts
        self._complete = 0  # generic format: calls whose arguments are whole (not scanned again)

    def feed(self, delta: str, finished: bool = False) -> list[dict[str, Any]]:
        self.text += delta
        if self.request.hermes:
            return self._hermes(finished)
        return self._generic(finished)

    # ---------------------------------------------------------------- generic

    def _generic(self, finished: bool) -> list[dict[str, Any]]:
        text = self.text
        if text.startswith(_REPLY):
            return self._content(_partial_string(text[len(_REPLY) :]))
        if not text.startswith(_CALLS):
            if _REPLY.startswith(text) or _CALLS.startswith(text):
                return []  # the wrapper so far (all there is, if cut short here)
            return self._content(text)  # not in the format: the text as it is
        out, i = [], self._complete
        while (head := _CALL_HEAD.match(text, self._next_call)) is not None:
            if i == len(self.calls):
                self.calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", head.group(1), ""))
                call = self.calls[i]
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": i,
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            start = head.end()
            end = _json_value_end(text, start)
            args = text[start : end + 1 if end is not None else len(text)]
            call = self.calls[i]
            if len(args) > len(call.arguments):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[len(call.arguments) :]}}]})
                self.calls[i] = ToolCall(call.id, call.name, args)
            if end is None or not text.startswith(_CALL_SEP, end + 1):
                break
            self._next_call = end + 1 + len(_CALL_SEP)  # this call is whole: the next one's head
            self._complete = i = i + 1
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        new = text[self._sent_content :]
        self._sent_content = len(text)
        return [{"content": new}] if new else []

    # ----------------------------------------------------------------- hermes

    def _hermes(self, finished: bool) -> list[dict[str, Any]]:
        text, visible, calls, pos = self.text, [], [], 0
        while True:
            start = text.find(_OPEN, pos)
            if start < 0:
                visible.append(_before_possible_tag(text[pos:], _OPEN))  # at the end: a tag cut short
                break
            visible.append(text[pos:start])
            end = text.find(_CLOSE, start)
            if end < 0:  # a call still being written; cut short if finished: kept once its name is whole
                cut = _cut_call(text[start + len(_OPEN) :]) if finished else None
                if cut is not None:
                    calls.append(cut)
                break
            call = _parse_call(text[start + len(_OPEN) : end].strip())
            if call is None:
                visible.append(text[start : end + len(_CLOSE)])  # a block that is not a call: content
            else:
                calls.append(call)
            pos = end + len(_CLOSE)
        out = self._content("".join(visible))
        for call in calls[len(self.calls) :]:
            self.calls.append(call)
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": len(self.calls) - 1,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ]
                }
            )
        return out


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_REPLY = '{"response": "'
_CALLS = '{"tool_calls": ['
_CALL_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
_CALL_SEP = "}, "  # a call's closing brace, then the next call


def _partial_string(body: str) -> str:
    """The decoded text of a JSON string body that may be cut anywhere (up to its
    closing quote; an escape cut in the middle waits for the next piece)."""
    i, end = 0, len(body)
    while i < len(body):
        c = body[i]
        if c == '"':
            end = i
            break
        if c == "\\":
            width = 6 if body[i + 1 : i + 2] == "u" else 2
            if i + width > len(body):
                end = i
                break
            i += width
            continue
        i += 1
    else:
        end = len(body)
    piece = body[:end]
    if re.search(r"\\u[dD][89abAB][0-9a-fA-F]{2}$", piece):  # half of a surrogate pair
        piece = piece[:-6]
    return json.loads(f'"{piece}"')


def _json_value_end(text: str, start: int) -> int | None:
    """Index of the last character of the JSON object or array starting at ``start``,
    or None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i
    return None


def _before_possible_tag(text: str, tag: str) -> str:
    """text without a tail that could be the start of ``tag``."""
    for k in range(min(len(tag), len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return text[:-k]
    return text


def render_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages without tools on offer, earlier tool calls and results still rendered."""
    return [_render_message(m, hermes=False) for m in messages]


def parse_tool_request(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, template: str | None
) -> ToolRequest | None:
    """Validate OpenAI's fields; None when no tool may be called (no tools, or "none")."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    parsed = tuple(_parse_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", param="tools")
    named = None
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in names:
            raise InvalidRequestError(
                f"tool_choice names function {named!r}, which is not in tools", param="tool_choice"
            )
        choice = "named"
    else:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if choice == "none":
        return None
    hermes = template is not None and "tools" in template and "<tool_call>" in template
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    return ToolRequest(parsed, choice, named, parallel, hermes)


def _parse_tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, _ or -", param="tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object", param="tools")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string", param="tools")
    return Tool(name, description, params)


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _parse_call(text: str) -> ToolCall | None:
    """A Hermes block's call, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _call(obj) if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None


_CUT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)


def _cut_call(text: str) -> ToolCall | None:
    """A Hermes block cut short (``max_tokens``): the call, with the arguments it has (JSON
    cut short, as the generic format and OpenAI's keep them), once its name is whole; None
    before that."""
    head = _CUT_HEAD.match(text)
    if head is None:
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", head.group(1), head.group(2).rstrip())


def _call(obj: dict[str, Any]) -> ToolCall:
    args = obj.get("arguments", {})
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(obj["name"]), json.dumps(args, ensure_ascii=False))


def _render_message(m: dict[str, Any], hermes: bool) -> dict[str, Any]:
    """An assistant message with tool_calls, or a tool result, as the format's text (an
    assistant's reasoning_content kept for the template)."""
    calls = m.get("tool_calls")
    kept = {"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") else {}
    if m.get("role") == "assistant" and calls:
        parsed = [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))} for c in calls
        ]
        if hermes:
            text = "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in parsed)
            content = f"{m.get('content') or ''}{text}"
        else:
            content = json.dumps({"tool_calls": parsed}, ensure_ascii=False)
        return {"role": "assistant", "content": content, **kept}
    if m.get("role") == "tool":
        if hermes:
            return {"role": "tool", "content": m.get("content") or ""}
        result = {"tool_call_id": m.get("tool_call_id"), "content": m.get("content") or ""}
        return {"role": "tool", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    return {"role": m["role"], "content": m.get("content") or "", **kept}


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}
