"""A request's prompt as the engine takes it: text tokenised off the event loop, a chat
rendered through its template (tools too), truncated when asked, and checked against
the model's context (``ContextLengthError``, the 400 that sends a router's request to
its large model). Shared by every route that generates or embeds, and the gateway.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import TypeVar

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.gateway.models import Target
from tokenmill.server.jobs.reasoning import Reasoning, reasoning_for
from tokenmill.server.jobs.template_sandbox import RequestTemplates
from tokenmill.server.jobs.tools import ToolRequest, parse_tool_request, render_messages
from tokenmill.server.protocol.error_responses import ContextLengthError
from tokenmill.server.protocol.openai import ChatCompletionRequest, CompletionRequest

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int, side: str | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens (-1: as many as
    the context holds), or its first with ``side`` "right" (vLLM's truncation_side: the
    side cut off); None: the prompt as it is."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len - 1  # the context's worth, with room for the first token
    if not isinstance(keep, int) or keep < 1:
        raise InvalidRequestError(
            "truncate_prompt_tokens must be -1 or a positive integer", param="truncate_prompt_tokens"
        )
    return ids[:keep] if side == "right" else ids[-keep:]


async def encode(target: Target, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A text prompt's ids (with the tokenizer's special tokens, a BOS, unless told not to); ids as they are."""
    if isinstance(prompt, str):
        return await asyncio.to_thread(target.tokenizer.encode, prompt, add_special_tokens)
    return list(prompt)


def max_tokens_for(target: Target, prompt_ids: list[int], requested: int | None, streams: bool = False) -> int:
    """The request's max_tokens, or all the room left; 400 when it does not fit. A request that
    streams (``kv_eviction`` by StreamingLLM) is bounded by its cache, not the context: any prompt and
    max_tokens (without one: as many tokens as the context holds)."""
    limit = target.max_model_len
    if streams:
        return limit if requested is None else requested
    if requested is None:
        if len(prompt_ids) >= limit:
            raise ContextLengthError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt is {len(prompt_ids)} tokens, leaving no room for the completion.",
                "messages",
            )
        return limit - len(prompt_ids)
    if isinstance(requested, int) and requested >= 1 and len(prompt_ids) + requested > limit:
        raise ContextLengthError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + requested} tokens ({len(prompt_ids)} in the prompt, {requested} for the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
    return requested


def with_eviction_default(body: B, window: int | None, sinks: int, policy: str = "streaming") -> B:
    """The request, with the server's KV eviction (``--kv-eviction-window``) where it names none
    (beam search excepted: its beams share their blocks, which eviction would move)."""
    if window is None or body.kv_eviction is not None or body.use_beam_search:
        return body
    ev = {"policy": policy, "window": window} | ({"sinks": sinks} if policy == "streaming" else {})
    return body.model_copy(update={"kv_eviction": ev})


@dataclass(frozen=True)
class ContextShift:
    """What a chat's context shift dropped (the server's ``--context-shift``): its oldest turns,
    whole, so that the rest fits the model's context; the answer carries it (``context_shift``)."""

    dropped_messages: int
    dropped_prompt_tokens: int

    def as_json(self) -> dict[str, int]:
        return {"dropped_messages": self.dropped_messages, "dropped_prompt_tokens": self.dropped_prompt_tokens}


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request made ready for the engine, each part decided once (``chat_prompt``)."""

    ids: list[int]
    params: SamplingParams
    tools: ToolRequest | None  # with tools: answers parsed into tool calls
    reasoning: Reasoning | None  # the model's reasoning parser (--reasoning-parser), where it has one
    shift: ContextShift | None  # what a context shift dropped (None: nothing)


async def chat_prompt(
    target: Target,
    body: ChatCompletionRequest,
    allow_special_tokens: bool = False,
    request_templates: RequestTemplates | None = None,
    context_shift: bool = False,
) -> ChatPrompt:
    """A chat request's prompt ids (``render_chat``), truncated when asked, its sampling
    parameters (a constraint starts after the reasoning of a model with a reasoning parser:
    reasoning.py), its tools, its reasoning parser, and, with ``context_shift``, what
    ``shift_context`` dropped where the chat would not fit (None: nothing)."""
    ids, tools = await render_chat(target, body, allow_special_tokens, request_templates)
    shift = None
    fits = body.streams or _fits(target, ids, body.requested_max_tokens)  # a streaming chat needs no shift
    if context_shift and body.truncate_prompt_tokens is None and not fits:
        shifted = await shift_context(target, body, allow_special_tokens, request_templates)
        if shifted is not None:
            (short, tools), kept = shifted
            shift = ContextShift(len(body.messages) - kept, len(ids) - len(short))
            ids = short
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, target.max_model_len, body.truncation_side)
    max_tokens = max_tokens_for(target, ids, body.requested_max_tokens, body.streams)
    params = body.sampling_params(max_tokens, tools and tools.constraint())
    reasoning = reasoning_for(target, body)
    if reasoning is not None:
        params = reasoning.constrain(params)
    return ChatPrompt(ids, params.with_bad_word_ids(target.tokenizer), tools, reasoning, shift)


def _fits(target: Target, ids: list[int], max_tokens: int | None) -> bool:
    """The prompt leaves room for ``max_tokens``, or without it, for a quarter of the context
    (what a shifted chat is left for its answer; an unshifted one needs a token)."""
    room = max_tokens if max_tokens is not None else max(1, target.max_model_len // 4)
    return len(ids) + room <= target.max_model_len


async def shift_context(
    target: Target,
    body: ChatCompletionRequest,
    allow_special_tokens: bool = False,
    request_templates: RequestTemplates | None = None,
) -> tuple[tuple[list[int], ToolRequest | None], int] | None:
    """llama.cpp's context shift, at turn boundaries: the chat's leading system (developer)
    messages kept, then as few of its oldest turns (a user message and what answers it) dropped
    as make the rest fit (``_fits``), the latest turn always kept. Returns the rendering and how
    many messages it kept, or None where even the latest turn alone does not fit (the request's
    400 then says why)."""
    messages = body.messages
    keep = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    turns = [i for i in range(keep, len(messages)) if messages[i].role == "user"]

    async def render(k: int) -> tuple[list[int], ToolRequest | None]:  # the k oldest turns dropped
        kept = [*messages[:keep], *messages[turns[k] :]]
        return await render_chat(
            target, body.model_copy(update={"messages": kept}), allow_special_tokens, request_templates
        )

    lo, hi, best = 1, len(turns) - 1, None  # the fewest turns dropped that fit: fewer dropped, longer prompt
    while lo <= hi:
        mid = (lo + hi) // 2
        rendered = await render(mid)
        if _fits(target, rendered[0], body.requested_max_tokens):
            best, hi = (rendered, mid), mid - 1
        else:
            lo = mid + 1
    if best is None:
        return None
    rendered, k = best
    return rendered, keep + len(messages) - turns[k]


async def render_chat(
    target: Target,
    body: ChatCompletionRequest,
    allow_special_tokens: bool = False,
    request_templates: RequestTemplates | None = None,
) -> tuple[list[int], ToolRequest | None]:
    """A chat's prompt ids through the chat template (tools rendered and
    ``chat_template_kwargs`` given to it; special-token text in the messages tokenised as
    text unless ``allow_special_tokens``) and its tools: what a chat request runs and what
    /tokenize with messages counts. vLLM's rendering fields: ``documents`` (a template
    variable), ``continue_final_message``, ``add_special_tokens``, and ``chat_template``
    where the server takes request templates (``request_templates``: rendered there, in a
    worker process with limits; the model's own template renders here, off the event loop)."""
    if body.chat_template is not None and request_templates is None:
        raise InvalidRequestError(
            "chat_template is passed with the request, but the server does not take request templates "
            "(start it with --trust-request-chat-template)",
            param="chat_template",
        )
    tokenizer = target.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    tools = parse_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, template)
    messages = [m.as_dict() for m in body.messages]
    messages = tools.render_messages(messages) if tools else render_messages(messages)
    described = None
    if tools and tools.hermes:  # the template describes the tools itself
        described = [t.as_openai() for t in tools.offered]
    variables = {
        **({"documents": body.documents} if body.documents is not None else {}),
        # vLLM passes reasoning_effort to the template (gpt-oss's and others' read it)
        **({"reasoning_effort": body.reasoning_effort} if body.reasoning_effort is not None else {}),
        **(body.chat_template_kwargs or {}),
    }
    rendering = {  # only what the request sets: the tokenizer's defaults are the plain chat
        "template_kwargs": variables or None,
        "continue_final_message": body.continue_final_message,
        "chat_template": body.chat_template,
        "add_special_tokens": body.add_special_tokens,
    }
    encode = functools.partial(
        tokenizer.encode_chat,
        messages,
        body.add_generation_prompt,
        described,
        allow_special_tokens,
        **{k: v for k, v in rendering.items() if v},
    )
    if body.chat_template is not None and request_templates is not None:
        ids = await request_templates.run(lambda render: encode(render=render))
    else:
        ids = await asyncio.to_thread(encode)
    return ids, tools
