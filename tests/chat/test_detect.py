import copy

import pytest
from families import FAMILIES, family_tokenizer

from turnrl.chat.detect import detect_parser, parser_for
from turnrl.chat.parsers import HermesParser, PythonicParser, Qwen3CoderParser
from turnrl.chat.templates import ChatTemplate, TemplateError


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_published_templates_are_detected(family, smol_tokenizer):
    fam = FAMILIES[family]
    found = detect_parser(ChatTemplate(family_tokenizer(smol_tokenizer, fam)))
    assert found.parser == fam.parser, found.reason
    assert found.reason.startswith(f"the template writes tool calls as {fam.parser}: ")


def test_smollm2_gets_the_injected_hermes_prompt(smol_template):
    found = detect_parser(smol_template)
    assert (found.parser, found.reason) == ("hermes", "the template renders no tools, so turnrl injects its hermes "
                                                      "tool prompt")
    assert isinstance(parser_for("auto", smol_template), HermesParser)
    assert isinstance(parser_for("pythonic", smol_template), PythonicParser)


def test_auto_reads_the_loop_s_parser_from_the_template(smol_tokenizer):
    t = ChatTemplate(family_tokenizer(smol_tokenizer, FAMILIES["qwen3_coder"]))
    assert isinstance(parser_for("auto", t), Qwen3CoderParser)


def test_auto_says_when_it_cannot_tell(chatml_tools, smol_tokenizer):
    # chatml_tools renders tools= but only an assistant message's content, never its tool_calls.
    found = detect_parser(chatml_tools)
    assert found.parser is None and "drops" in found.reason
    with pytest.raises(TemplateError, match=r"rollout.tool_parser=auto cannot tell the tool-call format: .*\. Set "
                                            r"rollout.tool_parser to one of hermes, llama3_json, qwen3_coder"):
        parser_for("auto", chatml_tools)
    # A template that writes calls in a format no parser reads.
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}<|im_start|>"
                         "{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
                         "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% endif %}")
    found = detect_parser(ChatTemplate(tok))
    assert found.parser is None and "'CALL probe_tool_zq'" in found.reason and "no parser reads" in found.reason


def test_check_template_prints_the_format_and_refuses_unread_kwargs(capsys):
    from families import TEMPLATES

    from turnrl.cli import main
    assert main(["check-template", "smollm2-135m-instruct", "--chat-template", str(TEMPLATES / "qwen3_coder.jinja")]) == 0
    out = capsys.readouterr().out
    assert "tool calls: qwen3_coder (the template writes tool calls as qwen3_coder: " in out
    assert out.count("PASS") == 5
    assert main(["check-template", "smollm2-135m-instruct", "--kwarg", "enable_thinking=false"]) == 2
    assert "never reads ['enable_thinking']" in capsys.readouterr().err


def test_model_chat_template_must_be_a_file(tmp_path):
    from turnrl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"'chat_template' must be the path of a Jinja chat template file"):
        load_config(None, [f"model.chat_template={tmp_path / 'nope.jinja'}"])
