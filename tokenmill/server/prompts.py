"""A request's prompt as the engine takes it: text tokenised off the event loop, a chat
rendered through its template (tools too), truncated when asked, and checked against
the model's context (``ContextLengthError``, the 400 that sends a router's request to
its large model). Shared by every route that generates or embeds, and the gateway.
"""

from __future__ import annotations

import asyncio
import functools

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import ContextLengthError
from tokenmill.server.models import Target
from tokenmill.server.protocol import ChatCompletionRequest, truncate_prompt
from tokenmill.server.reasoning import reasoning_for
from tokenmill.server.template_sandbox import RequestTemplates
from tokenmill.server.tools import ToolRequest, parse_tool_request, render_messages


async def encode(target: Target, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A text prompt's ids (with the tokenizer's special tokens, a BOS, unless told not to); ids as they are."""
    if isinstance(prompt, str):
        return await asyncio.to_thread(target.tokenizer.encode, prompt, add_special_tokens)
    return list(prompt)


def max_tokens_for(target: Target, prompt_ids: list[int], requested: int | None) -> int:
    """The request's max_tokens, or all the room left; 400 when it does not fit."""
    limit = target.max_model_len
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


async def chat_prompt(
    target: Target,
    body: ChatCompletionRequest,
    allow_special_tokens: bool = False,
    request_templates: RequestTemplates | None = None,
) -> tuple[list[int], SamplingParams, ToolRequest | None]:
    """A chat request's prompt ids (``render_chat``), truncated when asked, its sampling
    parameters (a constraint starts after the reasoning of a model with a reasoning parser:
    reasoning.py) and its tools."""
    ids, tools = await render_chat(target, body, allow_special_tokens, request_templates)
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, target.max_model_len, body.truncation_side)
    params = body.sampling_params(max_tokens_for(target, ids, body.requested_max_tokens), tools and tools.constraint())
    reasoning = reasoning_for(target, body)
    if reasoning is not None:
        params = reasoning.constrain(params)
    return ids, params.with_bad_word_ids(target.tokenizer), tools


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
