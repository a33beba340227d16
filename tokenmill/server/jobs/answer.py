"""What a chat or completions answer is made of, from the engine's outputs: each choice
(text or message, tool calls, reasoning, echo, logprobs, vLLM's token ids and prompt
logprobs), best_of's pick, usage and timings, and the whole body. The stream (sse.py) builds
its chunks from the same pieces, so a streamed answer and a whole one agree."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from tokenmill.engine.outputs import RequestOutput
from tokenmill.server.jobs.asked import Asked


class Answer:
    """The answer's pieces for one request (``asked``) under its id, on one model's tokenizer."""

    def __init__(self, asked: Asked, id: str, created: int, model: str, tokenizer: Any) -> None:
        self.asked = asked
        self.id = id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.cached = False  # answered from the response cache: usage says every token was

    def choice_index(self, prompt_index: int, out: RequestOutput) -> int:
        return prompt_index * self.asked.params[prompt_index].n + out.outputs[0].index

    async def body(self, finals: dict[int, RequestOutput]) -> dict:
        """The whole answer (stream false) from each choice's final output."""
        a = self.asked
        choices = [self.final_choice(idx, finals[idx], self.scored(idx, finals)) for idx in sorted(finals)]
        if a.best_of_keep is not None:
            choices = self.best_of(choices, finals)
        body = {
            "id": self.id,
            "object": a.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(finals.values()),
        }
        if a.chat and choices and "prompt_logprobs" in choices[0]:  # vLLM's chat has it once, at the top
            body["prompt_logprobs"] = choices[0]["prompt_logprobs"]
            for c in choices:
                c.pop("prompt_logprobs", None)
        if a.chat and a.extras.token_ids:
            body["prompt_token_ids"] = a.prompts[0]
        if a.chat and a.extras.prompt_text:
            body["prompt_text"] = await self.prompt_text()
        if a.return_timings:
            body["timings"] = [timings(finals[idx]) for idx in sorted(finals)]
        if a.context_shift is not None:
            body["context_shift"] = a.context_shift.as_json()
        return body

    async def prompt_text(self) -> str:
        """The first prompt rendered back to text (vLLM's return_prompt_text), off the event loop."""
        return await asyncio.to_thread(self.tokenizer.decode, self.asked.prompts[0], False)

    def final_choice(self, index: int, out: RequestOutput, scored: RequestOutput | None = None) -> dict:
        """``scored``: the output of the prompt's sequence 0, which carries the prompt's logprobs."""
        a = self.asked
        c = out.outputs[0]
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        lps = self.logprobs(c.token_ids, c.logprobs, c.top_logprobs) if a.logprobs else None
        echo = a.echo(index)
        if a.chat:
            thought, text = a.reasoning.split(c.text) if a.reasoning else (None, c.text)
            content, calls = a.tools.parse(text) if a.tools and text is not None else (text, [])
            choice["message"] = {"role": "assistant", "content": echo + content if content is not None else content}
            if a.reasoning and a.extras.reasoning:  # (include_reasoning false: the content alone)
                choice["message"] |= {"reasoning": thought, "reasoning_content": thought}  # vLLM's name, and the old
            if calls:
                choice["message"]["tool_calls"] = [call.as_openai() for call in calls]
                choice["finish_reason"] = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        else:
            choice["text"] = echo + c.text
            if echo and lps is not None and scored is not None and scored.prompt_logprobs is not None:
                lps = _joined(self.prompt_logprobs_legacy(scored), lps)
        choice["logprobs"] = lps
        if a.extras.token_ids:  # vLLM's return_token_ids (a completion's choice carries its prompt's too)
            choice["token_ids"] = list(c.token_ids)
            if not a.chat:
                choice["prompt_token_ids"] = a.prompts[index // a.per_prompt]
        if scored is not None and scored.prompt_logprobs is not None and a.prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs_vllm(scored)
        return choice

    def prompt_logprobs_legacy(self, out: RequestOutput) -> dict:
        """The prompt's part of an echoed completion's logprobs: its tokens, their logprobs
        and top alternatives, null for the first token (as OpenAI's legacy API)."""
        assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
        texts = [self.token(t) for t in out.prompt_token_ids]
        tops = [None] + [{self.token(t): v for t, v in top} for top in out.prompt_top_logprobs[1:]]
        return {
            "tokens": texts,
            "token_logprobs": list(out.prompt_logprobs),
            "top_logprobs": tops,
            "text_offset": _offsets(texts),
        }

    def prompt_logprobs_vllm(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token, null for the first, then a map of token
        id -> {logprob, rank, decoded_token} holding the token itself and the top k."""
        assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None and out.prompt_ranks is not None
        tok = self.tokenizer
        result: list[dict | None] = [None]
        for j in range(1, len(out.prompt_logprobs)):  # all of the prompt, unless the request failed
            t = out.prompt_token_ids[j]
            entry = {
                str(t): {
                    "logprob": out.prompt_logprobs[j],
                    "rank": out.prompt_ranks[j],
                    "decoded_token": tok.decode([t], skip_special_tokens=False),
                }
            }
            for rank, (alt, v) in enumerate(out.prompt_top_logprobs[j], start=1):
                entry.setdefault(
                    str(alt),
                    {"logprob": v, "rank": rank, "decoded_token": tok.decode([alt], skip_special_tokens=False)},
                )
            result.append(entry)
        return result

    def best_of(self, choices: list[dict], finals: dict[int, RequestOutput]) -> list[dict]:
        """Per prompt, the best_of_keep choices with the highest cumulative logprob, indexed
        afresh (logprobs dropped unless asked: they were asked for the ranking)."""
        per, keep = self.asked.per_prompt, self.asked.best_of_keep
        assert keep is not None
        kept = []
        for i in range(len(self.asked.prompts)):
            group = [c for c in choices if c["index"] // per == i]
            group.sort(
                key=lambda c: sum(lp for lp in finals[c["index"]].outputs[0].logprobs or [] if lp is not None),
                reverse=True,
            )
            for k, c in enumerate(group[:keep]):
                kept.append({**c, "index": i * keep + k, "logprobs": c["logprobs"] if self.asked.logprobs else None})
        return kept

    def scored(self, index: int, finals: dict[int, RequestOutput]) -> RequestOutput | None:
        """The final output of sequence 0 of choice ``index``'s prompt (it has the prompt's logprobs)."""
        return finals.get(index - index % self.asked.per_prompt)

    def usage(self, finals: Iterable[RequestOutput]) -> dict:
        prompt = self.asked.prompt_tokens
        completion = sum(len(o.outputs[0].token_ids) for o in finals)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.cached:  # nothing was computed: every token came from the response cache
            usage["prompt_tokens_details"] = {"cached_tokens": prompt}
            usage["completion_tokens_details"] = {"cached_tokens": completion}
        return usage

    def token(self, t: int) -> str:
        return token_name(self.tokenizer, t, self.asked.tokens_as_ids)

    def logprobs(self, token_ids, logprobs, top_logprobs) -> dict | None:
        """Logprobs of the tokens in the completions or the chat shape."""
        if logprobs is None:
            return None
        return token_logprobs(self.token, self.asked.chat, token_ids, logprobs, top_logprobs)


def timings(out: RequestOutput) -> dict:
    t = out.timings[0]
    return {
        "arrival": t.arrival,
        "first_scheduled": t.first_scheduled,
        "first_token": t.first_token,
        "finished": t.finished,
        "num_tokens": len(out.outputs[0].token_ids),
    }


def _joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs blocks as one (the echoed prompt's, then the completion's)."""
    tokens = first["tokens"] + then["tokens"]
    return {
        "tokens": tokens,
        "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
        "text_offset": _offsets(tokens),
    }


def _offsets(texts: list[str]) -> list[int]:
    out, pos = [], 0
    for t in texts:
        out.append(pos)
        pos += len(t)
    return out


def token_name(tokenizer: Any, t: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{t}" if as_id else tokenizer.decode([t], skip_special_tokens=False)


def token_logprobs(
    name: Callable[[int], str],
    chat: bool,
    ids: list[int],
    lps: list[float],
    tops: list[list[tuple[int, float]]],
) -> dict:
    """Tokens' logprobs in the chat shape (``content``) or the completions one; ``name``
    writes a token as the response shows it."""
    texts = [name(t) for t in ids]
    if chat:
        content = []
        for text, lp, top in zip(texts, lps, tops, strict=True):
            alts = [{"token": name(t), "logprob": v, "bytes": list(name(t).encode())} for t, v in top]
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alts})
        return {"content": content}
    return {
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": [{name(t): v for t, v in top} or None for top in tops],
        "text_offset": _offsets(texts),
    }
