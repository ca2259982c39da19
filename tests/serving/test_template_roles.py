"""accepted_roles: the four standard roles, plus exactly the roles a template compares a message's role with."""

from __future__ import annotations

import pytest

from serval.serving.template_roles import STANDARD_ROLES, accepted_roles

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}"
)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, extra",
    [
        (None, set()),
        (CHATML, set()),
        (SMOLLM2, set()),
        ("{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}", {"developer"}),
        (
            '{% for m in messages %}{% if m["role"] in ["user", "ipython"] %}x{% endif %}{% endfor %}',
            {"ipython"},
        ),
        (
            "{% for m in messages %}{% if m.role not in ('system', 'function') %}x{% endif %}{% endfor %}",
            {"function"},
        ),
        ("{% for m in messages %}{% if 'critic' == m.role | lower %}x{% endif %}{% endfor %}", {"critic"}),
        # A variable set from the role counts; Gemma's spelling of the same idea.
        (
            (
                "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
                "{% else %}{% set role = m['role'] %}{% endif %}{% if role == 'developer' %}x{% endif %}"
                "{% endfor %}"
            ),
            {"developer"},  # 'model' is only assigned, never compared: not declared
        ),
        # Text that merely mentions a role, comparisons of other fields, and non-names declare nothing.
        ("You are a developer. {% for m in messages %}{{ m['role'] }}{% endfor %}", set()),
        ("{% for m in messages %}{% if m.type == 'critic' %}x{% endif %}{% endfor %}", set()),
        (
            "{% for m in messages %}{% if m.role == '<|im_start|>' or m.role == '' %}x{% endif %}{% endfor %}",
            set(),
        ),
        ("{% for m in messages %}{% if m.role == 1 %}x{% endif %}{% endfor %}", set()),
        ("{% for m in messages %}{% if m.role == 'x' * 40 %}x{% endif %}{% endfor %}", set()),
        ("{% if %}", set()),  # does not parse: nothing declared (ChatTemplate refuses it itself)
    ],
)
def test_accepted_roles(template, extra):
    assert accepted_roles(template) == STANDARD_ROLES | extra


def test_loop_controls_parse_as_the_chat_template_renders_them():
    template = "{% for m in messages %}{% if m.role == 'developer' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
    assert "developer" in accepted_roles(template)
