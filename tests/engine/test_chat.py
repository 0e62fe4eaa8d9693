"""Chat rendering on the engine (``EngineCore.render_chat``) and ``LLM.chat``: templates, text parts,
``continue_final_message``, custom templates and message validation."""

from __future__ import annotations

from typing import Any

import pytest

from flashpage.engine.llm import LLM
from flashpage.engine.sampling_params import SamplingParams

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def llm(tiny_tok: Any) -> LLM:
    return LLM(model=tiny_tok, kv_cache_bytes=2 << 20)


def test_render_chat_matches_the_template_and_adds_no_special_tokens(llm: LLM) -> None:
    core = llm.engine
    tok = core.tokenizer
    text, ids = core.render_chat(CONV)
    assert text == tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>") == 3
    assert ids == list(tok.encode(text, add_special_tokens=False))
    # Special tokens come from the template only: a template that writes BOS gets exactly one.
    bos_tpl = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    text2, ids2 = core.render_chat(CONV, chat_template=bos_tpl, add_generation_prompt=False)
    assert text2 == f"{tok.bos_token}<system>Be brief.\n<user>Name a colour.\n"
    assert ids2.count(tok.bos_token_id) == 1 and ids2[0] == tok.bos_token_id
    # OpenAI content parts render like the joined string.
    parts = [
        CONV[0],
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}],
        },
    ]
    joined = [CONV[0], {"role": "user", "content": "Name\na colour."}]
    assert core.render_chat(parts) == core.render_chat(joined)


def test_continue_final_message(llm: LLM) -> None:
    core = llm.engine
    conv = [*CONV, {"role": "assistant", "content": "My favourite is"}]
    text, ids = core.render_chat(conv, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nMy favourite is")  # the turn stays open
    closed, _ = core.render_chat(conv, add_generation_prompt=False)
    assert closed.rstrip().endswith("<|im_end|>")
    with pytest.raises(
        ValueError, match=r"^continue_final_message: cannot be combined with add_generation_prompt"
    ):
        llm.chat(conv, continue_final_message=True)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    (out,) = llm.chat(conv, greedy, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    (ref,) = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_chat_batches_conversations_with_a_custom_template(llm: LLM) -> None:
    tpl = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    convs = [CONV, [{"role": "user", "content": "Hi"}]]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=3), chat_template=tpl, use_tqdm=False)
    assert [o.prompt for o in outs] == [
        "[system] Be brief.\n[user] Name a colour.\n[assistant] ",
        "[user] Hi\n[assistant] ",
    ]
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([CONV[0], {"content": "x"}], r"^messages\[1\]: 'role'"),
        ([CONV[0], {"role": "user", "content": 5}], r"^messages\[1\]: 'content'"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
            r"^messages\[0\]: content\[0\]",
        ),
        (["hello"], r"^messages\[0\]: expected a dict"),
        ([], r"^messages: "),
    ],
)
def test_bad_messages_name_the_message(llm: LLM, messages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.engine.render_chat(messages)


def test_bad_template_names_chat_template(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^chat_template: cannot render"):
        llm.chat(CONV, chat_template="{% for m in messages %}", use_tqdm=False)
