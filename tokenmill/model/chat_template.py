"""Chat templates rendered: jinja2's sandbox configured as transformers configures it,
and, for a template a request brings (``--trust-request-chat-template``), the same
sandbox with limits in a worker process that the server can stop (``serve_renders``;
the server's pool of them is server/jobs/template_sandbox.py).

Why limits, and why a process: a request's template is a program its client wrote.
Jinja's sandbox keeps it from Python's internals, not from the server's time and
memory: ``{{ 'a' * 10**9 }}`` grew a server to 16.5 GB until the OOM killer ended it,
and seven ``range(100000)`` loops nested in pairs held every tokenising thread for good
(issue 57). A thread cannot be stopped; a process can. Within the worker:

- an operator that would build a big value at once is refused before it runs: a string
  or list multiplied past ``max_chars`` items, an integer power past ``POW_BITS`` bits
  (the sandbox's intercepted operators);
- the output stops at ``max_chars`` characters (rendered as a stream and counted);
- the address space is capped ``memory`` bytes above what the worker held at its start
  (RLIMIT_AS), for the values the rules above do not foresee: a ``MemoryError``, after
  which the worker answers and exits;
- what loops is stopped by the server, which kills the worker after its timeout.

Every breach is the client's: an ``InvalidRequestError`` (a 400) that names it.
"""

from __future__ import annotations

import json
import os
import resource
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.errors import InvalidRequestError
from tokenmill.host.lifetime import exit_with_parent

POW_BITS = 1 << 16  # the largest integer a template's ``**`` may build, in bits


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a request's template may take."""

    timeout: float  # seconds (the server's: it stops the worker)
    memory: int  # bytes of address space a worker may add to what it held at its start
    max_chars: int  # characters of output, and items of a string or list built by ``*``


@dataclass(frozen=True)
class RenderJob:
    """A template to render in a worker, with its variables (the request's values)."""

    template: str
    context: dict[str, Any]


@dataclass(frozen=True)
class Rendered:
    """A worker's answer: the text, or the client's mistake said for a 400."""

    text: str = ""
    error: str | None = None
    exiting: bool = False  # the worker ends after this answer (its memory ran out)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the operators that build a big value in one step checked first."""

    intercepted_binops = frozenset({"*", "**"})  # (and so never folded at compile time)

    def __init__(self, max_chars: int, **options: Any) -> None:
        super().__init__(**options)
        self.max_chars = max_chars

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for value, times in ((left, right), (right, left)):
                if isinstance(value, str | list | tuple) and isinstance(times, int):
                    if len(value) * times > self.max_chars:
                        raise SecurityError(
                            f"'*' would build a {type(value).__name__} of {len(value) * times} items, "
                            f"over the {self.max_chars} a render may build"
                        )
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0 and right * left.bit_length() > POW_BITS:
                raise SecurityError(f"'**' would build an integer of over {POW_BITS} bits")
        return super().call_binop(context, operator, left, right)


def render_chat_template(template: str, context: Mapping[str, Any], max_chars: int | None = None) -> str:
    """``template`` rendered with the variables ``context``; a template's error (its own
    ``raise_exception``, or one it meets on a client's values) is an ``InvalidRequestError``.
    ``max_chars``: the limits of a request's template (the module's docstring)."""
    options: dict[str, Any] = dict(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env = ImmutableSandboxedEnvironment(**options) if max_chars is None else _BoundedSandbox(max_chars, **options)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
        if max_chars is None:
            return compiled.render(dict(context))
        return _joined(compiled.generate(dict(context)), max_chars)
    except InvalidRequestError:
        raise
    except TemplateError as e:
        raise InvalidRequestError(f"chat template error: {e}") from e
    # the template on a client's values; ArithmeticError: the sandbox's "Range too big" is an OverflowError
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
        raise InvalidRequestError(f"chat template error: {type(e).__name__}: {e}") from e


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template error: {message}")


def _joined(chunks: Iterable[str], max_chars: int) -> str:
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > max_chars:
            raise InvalidRequestError(
                f"chat_template renders more than {max_chars} characters (--request-template-max-chars)"
            )
        out.append(chunk)
    return "".join(out)


# ------------------------------------------------------------- the worker process


def serve_renders(conn: Connection, limits: TemplateLimits, parent_pid: int) -> None:
    """A render worker (spawned by server/jobs/template_sandbox.py): says it is ready (an empty
    ``Rendered``), then answers each ``RenderJob`` with a ``Rendered`` until its pipe
    closes. It ends with the server however the server ends (host/lifetime.py)."""
    exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it stops us
    _limit_memory(limits.memory)
    # A render is one client's input; the engine's steps are everyone's. At the lowest CPU
    # priority a template that loops until its timeout takes only the time the engine leaves
    # (two such renders at normal priority took a core each from the engine's two threads:
    # its steps went from ~0.1 to ~0.5 s in bench/soak.py --mix abuse).
    _lowest_cpu_priority()
    conn.send(Rendered())
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the server closed the pipe: done
            return
        answer = _render(job, limits.max_chars)
        conn.send(answer)
        if answer.exiting:
            os._exit(0)


def _lowest_cpu_priority() -> None:
    try:
        os.nice(19 - os.nice(0))
    except (AttributeError, OSError):  # no nice() here: the timeout still bounds a render
        pass


def _render(job: RenderJob, max_chars: int) -> Rendered:
    try:
        return Rendered(render_chat_template(job.template, job.context, max_chars))
    except InvalidRequestError as e:
        return Rendered(error=str(e))
    except MemoryError:
        return Rendered(
            error="chat_template needs more memory than a render may take (--request-template-memory)", exiting=True
        )
    except Exception as e:  # anything else a client's template can raise is still the client's
        return Rendered(error=f"chat template error: {type(e).__name__}: {e}")


def _limit_memory(budget: int) -> None:
    """Cap this process's address space ``budget`` bytes above what it maps now (Linux's
    /proc; elsewhere the timeout alone bounds a render)."""
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = mapped + budget if hard == resource.RLIM_INFINITY else min(mapped + budget, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
