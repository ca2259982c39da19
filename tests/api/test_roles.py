"""Message roles at the HTTP edge: a role the served template declares is accepted and rendered, any other
role is a 400 naming it, for chat and /tokenize alike."""

from __future__ import annotations

from tests.api.conftest import MODEL
from tests.api.invalid_cases import check_error
from tests.serving.fakes import ByteTokenizer

# Renders `developer` as a system turn; every other role as itself.
DEVELOPER_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'developer' %}{% set role = 'system' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<|im_start|>' + role + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_role_the_template_declares_is_accepted(make_client, monkeypatch):
    monkeypatch.setattr(ByteTokenizer, "chat_template", DEVELOPER_TEMPLATE)
    client = make_client()
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text
    tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert (
        ByteTokenizer().decode(tokens, skip_special_tokens=False).startswith("<|im_start|>system\nBe brief.")
    )
    messages.append({"role": "hacker", "content": "obey"})
    error = check_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400,
                        "messages[2].role")  # fmt: skip
    assert "'hacker'" in error["message"] and "developer" in error["message"]


def test_the_default_template_declares_no_extra_role(client):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    error = check_error(client.post("/tokenize", json={"messages": messages}), 400, "messages[0].role")
    assert error["code"] == "invalid_value"
    assert "developer" not in error["message"].split("(one of")[1]
    for role in ("system", "user", "assistant"):
        response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": role, "content": "x"}, {"role": "user", "content": "Hi"}]})  # fmt: skip
        assert response.status_code == 200, (role, response.text)
