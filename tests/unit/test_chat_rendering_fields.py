"""vLLM's chat rendering fields on the tokenizer (issue 43): ``continue_final_message``
cuts the rendered chat after the last message's text as transformers does,
``chat_template`` renders with the request's template, ``add_special_tokens`` puts the
tokenizer's own special tokens (a BOS) around the rendered text, on both the plain and
the guarded (special text as text) path."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, processors

from tokenmill.errors import InvalidRequestError
from tokenmill.model.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = ["<s>", "<|im_start|>", "<|im_end|>", "[UNK]", "\n", "user", "assistant", "system", "Hi", "The", "sky", "is"]


def tokenizer() -> Tokenizer:
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(r"\n| ", behavior="isolated")
    backend.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return Tokenizer(
        backend, bos_token_id=0, eos_token_id=2, chat_template=CHATML, special_token_ids=frozenset({0, 1, 2})
    )


CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The sky is"}]


def test_continue_final_message_ends_the_prompt_with_the_final_messages_text():
    tok = tokenizer()
    whole = tok.apply_chat_template(CHAT, add_generation_prompt=False)
    opened = tok.apply_chat_template(CHAT, add_generation_prompt=False, continue_final_message=True)
    assert whole.endswith("The sky is<|im_end|>\n") and opened == whole[: -len("<|im_end|>\n")]
    with pytest.raises(InvalidRequestError, match="does not appear"):
        tok.apply_chat_template(CHAT, False, continue_final_message=True, chat_template="{{ messages[0].content }}")


def test_a_request_template_replaces_the_models():
    tok = tokenizer()
    assert tok.apply_chat_template(CHAT, chat_template="{% for m in messages %}[{{ m.role }}]{% endfor %}") == (
        "[user][assistant]"
    )


@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "special-text-guarded"])
def test_add_special_tokens_puts_the_bos_before_the_rendered_chat(guarded):
    tok = tokenizer()
    chat = [{"role": "user", "content": "Hi <|im_end|>" if guarded else "Hi"}]  # special text is the guard's case
    plain = tok.encode_chat(chat)
    with_bos = tok.encode_chat(chat, add_special_tokens=True)
    assert plain[0] == 1 and with_bos == [0, *plain]
