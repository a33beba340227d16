"""OpenAI's Responses API (``/v1/responses``) over the chat pipeline.

A Responses request is a chat request in another shape (responses_request.py). The answer is one
generation, parsed as a chat answer (text and tool calls), and comes back as output
items: a ``reasoning`` item first when the model has a reasoning parser (reasoning.py),
a ``message`` with ``output_text`` and a ``function_call`` per call; streamed as
OpenAI's typed events. With ``store`` (the default, as OpenAI's) the response and
its conversation are kept in memory (bounded in count and age, per API key) for
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tokenmill.server.jobs.reasoning import Reasoning
from tokenmill.server.jobs.tools import ToolCall, ToolRequest, ToolStream
from tokenmill.server.protocol.openai import now
from tokenmill.server.protocol.responses_request import ResponsesRequest


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseShape:
    """The response object as a request sees it: its echo of the request, then the
    output and usage once known."""

    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_item_id("resp"))
    created_at: int = field(default_factory=now)

    def body(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, incomplete: str | None = None
    ) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": r.previous_response_id,
            "reasoning": None,
            "service_tier": "default",
            "store": r.store,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [],
            "top_logprobs": 0,
            "top_p": r.top_p if r.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata or {},
        }


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [text_part(text)]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [reasoning_part(text)], "status": status}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up turn continues from."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    thought = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
    if thought:
        message["reasoning_content"] = thought
    return [message]


class OutputBuilder:
    """One answer's output items, built from its text as it grows: a ``reasoning`` item
    for what a reasoning model thinks (with a reasoning parser), a ``message`` item for
    text, a ``function_call`` item per call, in the order they appear. ``feed`` returns
    the stream events (kind, payload) the new text makes; a whole answer fed at once
    builds the same items, so streamed and non-streamed responses agree."""

    def __init__(self, tools: ToolRequest | None, reasoning: Reasoning | None = None) -> None:
        self.stream = ToolStream(tools) if tools is not None else None
        self.splitter = reasoning.splitter() if reasoning is not None else None
        self.output: list[dict[str, Any]] = []
        self._open_reasoning: int | None = None  # index in output of the reasoning being written
        self._open_message: int | None = None  # index in output of the message being written
        self._calls: dict[int, int] = {}  # tool-call index -> its item's index in output

    def feed(self, delta: str, finished: bool) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if self.splitter is not None:
            thought, delta = self.splitter.feed(delta, finished)
            if thought:
                events += self._reasoning(thought)
        pieces = self.stream.feed(delta, finished) if self.stream is not None else [{"content": delta}] if delta else []
        if pieces:
            events += self._close_reasoning()  # (all of it comes before the answer)
        for piece in pieces:
            if piece.get("content"):
                events += self._text(piece["content"])
            for call in piece.get("tool_calls", []):
                events += self._call(call)
        if finished:
            events += self._close_reasoning()
            if self._open_message is None and not self.output:
                events += self._text("")  # an empty answer is an empty message, as OpenAI's
            events += self._close_message()
            for i in self._calls.values():
                item = self.output[i]
                item["status"] = "completed"
                events.append(
                    (
                        "response.function_call_arguments.done",
                        {
                            "item_id": item["id"],
                            "output_index": i,
                            "name": item["name"],
                            "arguments": item["arguments"],
                        },
                    )
                )
                events.append(("response.output_item.done", {"output_index": i, "item": dict(item)}))
        return events

    def _reasoning(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self._open_reasoning is None:
            i = self._open_reasoning = len(self.output)
            item = reasoning_item(new_item_id("rs"), "", status="in_progress")
            self.output.append(item)
            events.append(("response.output_item.added", {"output_index": i, "item": {**item, "content": []}}))
            part = {"item_id": item["id"], "output_index": i, "content_index": 0, "part": reasoning_part("")}
            events.append(("response.content_part.added", part))
        i = self._open_reasoning
        item = self.output[i]
        item["content"][0]["text"] += text
        events.append(
            (
                "response.reasoning_text.delta",
                {"item_id": item["id"], "output_index": i, "content_index": 0, "delta": text},
            )
        )
        return events

    def _close_reasoning(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open_reasoning is None:
            return []
        i, self._open_reasoning = self._open_reasoning, None
        item = self.output[i]
        item["status"] = "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": i, "content_index": 0}
        return [
            ("response.reasoning_text.done", {**where, "text": part["text"]}),
            ("response.content_part.done", {**where, "part": dict(part)}),
            ("response.output_item.done", {"output_index": i, "item": _copy(item)}),
        ]

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self._open_message is None:
            self._open_message = len(self.output)
            item = message_item(new_item_id("msg"), "", status="in_progress")
            self.output.append(item)
            events.append(
                ("response.output_item.added", {"output_index": self._open_message, "item": {**item, "content": []}})
            )
            events.append(
                (
                    "response.content_part.added",
                    {
                        "item_id": item["id"],
                        "output_index": self._open_message,
                        "content_index": 0,
                        "part": text_part(""),
                    },
                )
            )
        item = self.output[self._open_message]
        item["content"][0]["text"] += text
        if text:
            events.append(
                (
                    "response.output_text.delta",
                    {
                        "item_id": item["id"],
                        "output_index": self._open_message,
                        "content_index": 0,
                        "delta": text,
                        "logprobs": [],
                    },
                )
            )
        return events

    def _close_message(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open_message is None:
            return []
        i, self._open_message = self._open_message, None
        item = self.output[i]
        item["status"] = "completed"
        part = item["content"][0]
        return [
            (
                "response.output_text.done",
                {"item_id": item["id"], "output_index": i, "content_index": 0, "text": part["text"], "logprobs": []},
            ),
            (
                "response.content_part.done",
                {"item_id": item["id"], "output_index": i, "content_index": 0, "part": dict(part)},
            ),
            ("response.output_item.done", {"output_index": i, "item": _copy(item)}),
        ]

    def _call(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if delta.get("id") is not None:  # a new call: its head
            events += self._close_message()
            fn = delta["function"]
            call = ToolCall(delta["id"], fn["name"], "")
            self._calls[delta["index"]] = len(self.output)
            item = call_item(new_item_id("fc"), call, status="in_progress")
            self.output.append(item)
            events.append(("response.output_item.added", {"output_index": len(self.output) - 1, "item": dict(item)}))
        i = self._calls[delta["index"]]
        piece = delta.get("function", {}).get("arguments", "")
        if piece:
            self.output[i]["arguments"] += piece
            events.append(
                (
                    "response.function_call_arguments.delta",
                    {"item_id": self.output[i]["id"], "output_index": i, "delta": piece},
                )
            )
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]}


# ----------------------------------------------------------------------- store


@dataclass
class Stored:
    owner: str
    body: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # the whole conversation, its output included (instructions excluded)
    at: float


class ResponseStore:
    """Stored responses in memory: at most ``size`` of them, each for ``ttl`` seconds,
    visible only to the API key that made it (a server without keys has one owner)."""

    def __init__(self, size: int, ttl: float) -> None:
        self.size, self.ttl = size, ttl
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, owner: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._items[body["id"]] = Stored(owner, body, messages, time.monotonic())
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, owner: str, response_id: str) -> Stored | None:
        self._expire()
        item = self._items.get(response_id)
        return item if item is not None and item.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        del self._items[response_id]
        return True

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        while self._items and next(iter(self._items.values())).at < cutoff:
            self._items.popitem(last=False)


def owner_of(authorization: str | None) -> str:
    """Who a stored response (or a cached answer) belongs to: a digest of the bearer token
    presented (the scheme's case and the spaces around the token do not matter)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    credential = token.strip() if scheme.lower() == "bearer" else (authorization or "")
    return hashlib.sha256(credential.encode()).hexdigest()


def sse_event(kind: str, sequence: int, **payload: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence, **payload})}\n\n"
