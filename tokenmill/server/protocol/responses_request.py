"""A Responses request (``/v1/responses``) as the chat request it becomes: ``input`` (a string
or a list of items) and ``instructions`` become chat messages, flat function tools become chat
tools, ``text.format`` becomes a ``response_format``, vLLM's sampling and request fields pass
through; the Responses fields whose feature this server has not are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol.openai import StrictBody

# Tool types of the Responses API that run on OpenAI's side: refused by name.
HOSTED_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "computer",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)


class ChatFieldsOfResponses(BaseModel):
    """vLLM's fields of its Responses request that mean here what they mean on a chat request:
    passed to the chat request a Responses request becomes, which does what each does there
    (sampling, cache_salt, request_id, ...) or refuses it with why."""

    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    kv_eviction: dict[str, Any] | None = None  # tokenmill's (KVEviction): {"policy": "none"} opts out
    media_io_kwargs: dict[str, Any] | None = None
    mm_payload: Any = None
    return_mm_kwargs: bool | None = None
    vllm_xargs: dict[str, Any] | None = None
    session_id: str | None = None
    watermarking: Any = None


class ResponsesRequest(StrictBody, ChatFieldsOfResponses):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop early turns to fit) is not implemented
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # vLLM's, refused when set (refuse_unsupported says why)
    prompt: dict[str, Any] | None = None
    enable_response_messages: bool | None = None
    previous_input_messages: list[dict[str, Any]] | None = None
    # accepted, no effect here (see protocol.NO_EFFECT)
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def refuse_unsupported(self) -> None:
        """The Responses fields whose feature this server does not have: a 400 by name."""
        if self.background:
            raise InvalidRequestError(
                "background responses are not supported (send background: false)", param="background"
            )
        if self.include:
            raise InvalidRequestError(
                f"include {self.include!r} is not supported (no hosted tools, reasoning or output logprobs here)",
                param="include",
            )
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidRequestError("reasoning is not supported by this model", param="reasoning")
        if self.top_logprobs:
            raise InvalidRequestError(
                "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)", param="top_logprobs"
            )
        if self.prompt:
            raise InvalidRequestError(
                "prompt names a prompt template stored on OpenAI's platform; none is stored here (send input)",
                param="prompt",
            )
        if self.enable_response_messages:
            raise InvalidRequestError(
                "enable_response_messages is not implemented here: the output items are the answer",
                "enable_response_messages",
            )
        if self.previous_input_messages:
            raise InvalidRequestError(
                "previous_input_messages is not implemented here; use previous_response_id (stored responses)",
                param="previous_input_messages",
            )
        if self.max_tool_calls is not None:
            raise InvalidRequestError(
                "max_tool_calls is not supported (use parallel_tool_calls: false for one)", param="max_tool_calls"
            )

    # ------------------------------------------------------------ to a chat request

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The equivalent chat completions body: ``history`` (a stored conversation's
        messages, for previous_response_id) then this request's input."""
        self.refuse_unsupported()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        messages += self.input_messages()
        body: dict[str, Any] = {"messages": messages, "stream": False}
        for name, value in (
            ("model", self.model),
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("parallel_tool_calls", self.parallel_tool_calls),
            *((name, getattr(self, name)) for name in ChatFieldsOfResponses.model_fields),
        ):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format(self.text)
        if response_format is not None:
            body["response_format"] = response_format
        return body

    def input_messages(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages = items_to_messages(self.input) if self.input else []
        if not messages:
            raise InvalidRequestError("input is empty (a reasoning item alone is no turn)", param="input")
        return messages


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls become one assistant
    message's tool_calls; a function call's output, a tool message; a reasoning item (an
    earlier response's), the reasoning_content of the assistant message that follows it."""
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = (thought or "") + _reasoning_text(item, where)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(
                    f"{where}: role must be user, system, developer or assistant, not {role!r}", param="input"
                )
            out.append({"role": role, "content": _item_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = [call]  # text, then the calls it made: one message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _item_text(output, where)
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise InvalidRequestError(
                f"{where}: input items of type {kind!r} are not supported (message, "
                "function_call, function_call_output and reasoning are)",
                param="input",
            )
        if thought is not None and out[-1]["role"] == "assistant":
            out[-1].setdefault("reasoning_content", thought)
        thought = None  # (one before anything but an assistant's turn has nothing to go with)
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequestError(f"{where}: a reasoning item's content must be a list of text parts", param="input")
    return "".join(p["text"] for p in parts)


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}: content must be a string or a list of text parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}: content parts of type {kind!r} are not supported (text only)", param="input"
            )
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}: {key} must be a string", param="input")
    return value


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type")
    if kind in HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith(("web_search", "computer"))):
        raise InvalidRequestError(
            f"tools[{i}]: {kind} tools are not supported by this server (function tools are)", param="tools"
        )
    if kind != "function":
        raise InvalidRequestError(
            f'tools[{i}] must be {{"type": "function", "name": ..., "parameters": ...}}', param="tools"
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        f'tool_choice {choice!r} is not supported: none, auto, required or {{"type": "function", "name": ...}}',
        param="tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    unknown = set(text) - {"format"}
    if unknown:
        raise InvalidRequestError(f"text.{sorted(unknown)[0]} is not supported", param="text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError("text.format json_schema needs a schema object", param="text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise InvalidRequestError(f"text.format type must be text, json_object or json_schema, not {kind!r}", param="text")


# --------------------------------------------------------------------- answers
