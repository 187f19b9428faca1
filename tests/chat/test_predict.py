"""Guessed template deltas: the skeleton of a shape of new messages, filled, against full renders."""

import copy

from turnrl.chat.predict import Guesses, shape
from turnrl.chat.templates import ChatTemplate

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4"}]


def full_delta(template, messages, new):
    return template.render(messages + new, add_generation_prompt=True)[len(template.render(messages)):]


def test_chatml_guesses_equal_the_full_render_for_user_and_tool_messages(smol_template):
    guesses = Guesses(smol_template)
    for new in ([{"role": "user", "content": "And 3+3?  "}],
                [{"role": "user", "content": "a"}, {"role": "user", "content": "TURNRL b {{ c }}"}],
                [smol_template.tool_message("calculator", "391", "call_1")]):
        assert guesses.delta("", None, new) == full_delta(smol_template, CONVO, new)
    # one skeleton per shape, reused for other contents
    assert len(guesses.known) == 3
    assert guesses.delta("", None, [{"role": "user", "content": "x"}]) == \
        full_delta(smol_template, CONVO, [{"role": "user", "content": "x"}])
    assert len(guesses.known) == 3


def test_a_template_that_trims_guesses_wrong_and_the_shape_can_be_forgotten(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    template = ChatTemplate(tok)
    guesses = Guesses(template)
    new = [{"role": "user", "content": " padded "}]
    guess = guesses.delta("", None, new)
    assert guess is not None and guess != full_delta(template, CONVO, new)   # only a guess: the gateway checks
    guesses.forget("", new)
    assert guesses.delta("", None, new) is None


def test_fields_that_are_not_text_are_not_guessed(smol_template):
    assert shape([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) is None
    assert Guesses(smol_template).delta("", None, [{"role": "user", "content": None}]) is None
