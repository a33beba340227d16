"""A chat template's errors are the client's (400s, never a 500), and a request's
template renders within limits that refuse a big value before it is built (issue 57:
``{{ 'a' * 10**9 }}`` grew a server to 16.5 GB). In process, no worker: the renderer
that the workers run (model/chat_template.py); the workers are test_template_sandbox.py's."""

from __future__ import annotations

import tracemalloc

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from tokenmill.errors import InvalidRequestError
from tokenmill.model.chat_template import render_chat_template
from tokenmill.model.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "Hi"}]
LIMIT = 100_000


def tokenizer() -> Tokenizer:
    return Tokenizer(Backend(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")), None, None, "{{ messages }}")


def test_a_range_past_the_sandboxs_is_a_400_not_a_500():
    """Jinja's sandbox refuses range(100001) with an OverflowError: a client's mistake."""
    with pytest.raises(InvalidRequestError, match="Range too big"):
        tokenizer().apply_chat_template(CHAT, chat_template="{% for i in range(100001) %}{% endfor %}x")


def test_a_template_variable_may_be_named_template():
    """chat_template_kwargs are the template's variables, whatever their names."""
    tok = tokenizer()
    assert tok.apply_chat_template(CHAT, template_kwargs={"template": "t"}, chat_template="{{ template }}") == "t"


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{{ 'a' * 10**9 }}", "'\\*' would build a str of 1000000000 items"),
        ("{{ 10**9 * 'a' }}", "'\\*' would build a str"),
        ("{{ [1, 2] * 10**9 }}", "'\\*' would build a list"),
        ("{{ 7 ** 1000000000 }}", "'\\*\\*' would build an integer"),
        ("{% for i in range(100000) %}{% for j in range(100) %}x{% endfor %}{% endfor %}", "more than 100000 char"),
    ],
    ids=["str-times", "times-str", "list-times", "power", "output"],
)
def test_a_request_templates_big_values_are_refused_before_they_are_built(template, needle):
    """With limits, each is a 400 that names it, and no more than about the limit is
    ever allocated (tracemalloc's peak), where each would take a gigabyte or more."""
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequestError, match=needle):
            render_chat_template(template, {"messages": CHAT}, max_chars=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * LIMIT


def test_within_the_limits_a_template_renders_as_without_them():
    template = "{% for m in messages %}{{ m.role }}: {{ m.content * 3 }}{% endfor %}{{ 2 ** 10 }}"
    text = render_chat_template(template, {"messages": CHAT}, max_chars=LIMIT)
    assert text == render_chat_template(template, {"messages": CHAT}) == "user: HiHiHi1024"
