"""LoRA options: vLLM's --lora-modules (both forms), MindIE's LoraModules in the config file, the slot flags,
and admin keys (flag and environment)."""

from __future__ import annotations

import json

import pytest

from serval.config import LoraConfig, LoraModule
from serval.entrypoints.cli import build_parser, engine_config, merged_options, server_config
from serval.server_config import read_mindie_config


def options(*argv: str) -> dict:
    return merged_options(build_parser().parse_args(["serve", *argv]))


def test_lora_modules_flag_forms():
    config = engine_config(
        options(
            "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}',
            "--lora-modules", "third=/a/3", "--max-loras", "3", "--max-lora-rank", "64",
        )
    ).lora  # fmt: skip
    assert config.lora_modules == (
        LoraModule("sql", "/adapters/sql"),
        LoraModule("chat", "/a/chat", "m"),
        LoraModule("third", "/a/3"),
    )
    assert config.is_enabled and config.max_loras == 3 and config.max_lora_rank == 64


def test_lora_is_off_unless_asked_for():
    assert not engine_config(options()).lora.is_enabled
    assert engine_config(options("--enable-lora")).lora.is_enabled


@pytest.mark.parametrize(
    "value", ["sql", "=/path", "sql=", '{"name": "x"}', '{"name": "x", "path": "/p", "r": 8}', "{"]
)
def test_bad_lora_modules_are_refused(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", value])
    assert "LoRA module" in capsys.readouterr().err


def test_lora_config_validation():
    with pytest.raises(ValueError, match="unique"):
        LoraConfig(lora_modules=(LoraModule("a", "/1"), LoraModule("a", "/2")))
    with pytest.raises(ValueError, match="max_loras is 1"):
        LoraConfig(max_loras=1, lora_modules=(LoraModule("a", "/1"), LoraModule("b", "/2")))
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine_config(options("--max-lora-rank", "0"))
    with pytest.raises(ValueError, match="base model's name"):
        server_config(options("--lora-modules", "m=/p"), "m")


def test_mindie_lora_modules(tmp_path):
    data = {
        "BackendConfig": {
            "ModelDeployConfig": {
                "ModelConfig": [{"modelName": "llama", "modelWeightPath": "/w"}],
                "LoraModules": [
                    {"name": "sql", "path": "adapters/sql", "baseModelName": "llama"},
                    {"name": "abs", "path": "/abs/chat", "base_model_name": "llama"},
                    {"name": "plain", "path": "/p"},
                ],
            }
        }
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    modules = read_mindie_config(str(path))["lora_modules"]
    assert modules == [
        LoraModule("sql", str(tmp_path / "adapters/sql"), "llama"),
        LoraModule("abs", "/abs/chat", "llama"),
        LoraModule("plain", "/p"),
    ]
    # The flag replaces the file's list, as every flag overrides its field.
    assert engine_config(options("--config", str(path), "--lora-modules", "x=/x")).lora.lora_modules == (
        LoraModule("x", "/x"),
    )


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        ({"name": "a"}, "list of objects"),
        ([{"name": "a"}], "name and a path"),
        ([{"name": 3, "path": "/p"}], "must be a str"),
    ],
)
def test_bad_mindie_lora_modules(tmp_path, modules, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"LoraModules": modules}))
    with pytest.raises(ValueError, match=message):
        read_mindie_config(str(path))


def test_admin_keys_from_flags_and_environment(monkeypatch):
    monkeypatch.delenv("SERVAL_ADMIN_API_KEY", raising=False)
    assert server_config(options(), "m").admin_api_keys == ()
    assert server_config(options("--admin-api-key", "a", "--admin-api-key", "b"), "m").admin_api_keys == (
        "a",
        "b",
    )
    monkeypatch.setenv("SERVAL_ADMIN_API_KEY", "x,y")
    assert server_config(options(), "m").admin_api_keys == ("x", "y")
    assert server_config(options("--admin-api-key", "z"), "m").admin_api_keys == ("z",)


def test_lora_root_from_the_flag_and_the_file(tmp_path):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "adapters")
    assert server_config(options(), "m").lora_root is None  # no run-time loads unless asked for
    # Held resolved, so a later symlink swap of the root itself changes nothing.
    assert server_config(options("--lora-root", str(tmp_path / "link")), "m").lora_root == str(
        (tmp_path / "adapters").resolve()
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {"LoraRoot": "adapters"}}}))
    assert read_mindie_config(str(path))["lora_root"] == str(tmp_path / "adapters")
    assert server_config(options("--config", str(path)), "m").lora_root == str(
        (tmp_path / "adapters").resolve()
    )
    with pytest.raises(ValueError, match="not a directory"):
        server_config(options("--lora-root", str(tmp_path / "missing")), "m")
    path.write_text(json.dumps({"LoraRoot": 3}))
    with pytest.raises(ValueError, match="must be a str"):
        read_mindie_config(str(path))
