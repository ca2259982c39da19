"""The MindIE config-file reader and the CLI's layering: defaults < --config file < flags."""

from __future__ import annotations

import json

import pytest

from serval.entrypoints.cli import build_parser, engine_config, merged_options, server_config
from serval.entrypoints.cli_options import byte_size
from serval.server_config import GIB, ServerConfig, read_mindie_config

MINDIE = {
    "Version": "1.0.0",
    "ServerConfig": {
        "ipAddress": "127.0.0.2",
        "port": 1025,
        "httpsEnabled": False,
        "fullTextEnabled": True,
        "e2eTimeout": 60,
        "tlsCert": "security/certs/server.pem",
        "managementPort": 1026,
    },
    "BackendConfig": {
        "npuDeviceIds": [[0]],
        "ModelDeployConfig": {
            "maxSeqLen": 2560,
            "maxInputTokenLen": 2048,
            "ModelConfig": [{"modelName": "llama_65b", "modelWeightPath": "/data/llama", "npuMemSize": 2}],
        },
        "ScheduleConfig": {
            "maxBatchSize": 200,
            "maxIterTimes": 512,
            "maxPrefillTokens": 8192,
            "cacheBlockSize": 128,
        },
    },
}


def write(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_reads_the_mindie_fields(tmp_path):
    options = read_mindie_config(write(tmp_path, MINDIE))
    assert options == {
        "host": "127.0.0.2",
        "port": 1025,
        "full_text_enabled": True,
        "request_timeout": 60,
        "max_model_len": 2560,
        "max_input_tokens": 2048,
        "max_num_seqs": 200,
        "max_iter_times": 512,
        "max_num_batched_tokens": 8192,
        "block_size": 128,
        "served_model_name": ["llama_65b"],
        "model": "/data/llama",
        "kv_cache_memory_bytes": 2 * GIB,
    }


def test_flat_sections_and_https(tmp_path):
    data = {
        "ServerConfig": {"httpsEnabled": True, "tlsCert": "certs/server.pem", "tlsPk": "/abs/key.pem"},
        "ScheduleConfig": {"maxBatchSize": 4},
    }
    options = read_mindie_config(write(tmp_path, data))
    assert options["ssl_certfile"] == str(tmp_path / "certs/server.pem")  # relative to the file
    assert options["ssl_keyfile"] == "/abs/key.pem"
    assert options["max_num_seqs"] == 4


@pytest.mark.parametrize(
    "data, message",
    [
        ({"ServerConfig": {"port": "80"}}, "port must be an integer"),
        ({"ServerConfig": {"port": True}}, "port must be an integer"),
        ({"ServerConfig": {"httpsEnabled": True}}, "needs ServerConfig.tlsCert"),
        ({"ServerConfig": {"ipAddress": "0.0.0.0"}}, "allowAllZeroIpListening"),
        ({"ModelDeployConfig": {"ModelConfig": []}}, "non-empty list"),
        ([1], "must hold a JSON object"),
    ],
)
def test_bad_files_are_value_errors(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        read_mindie_config(write(tmp_path, data))
    with pytest.raises(ValueError, match="cannot read"):
        read_mindie_config(str(tmp_path / "missing.json"))


def test_flags_override_the_file(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--config", write(tmp_path, MINDIE), "--port", "9000", "--max-num-seqs", "8",
         "--api-key", "a", "--api-key", "b", "--no-full-text-enabled", "--kv-cache-memory-bytes", "512MiB"]
    )  # fmt: skip
    options = merged_options(args)
    server = server_config(options, "unused")
    engine = engine_config(options)
    assert (server.host, server.port, server.full_text_enabled) == ("127.0.0.2", 9000, False)
    assert server.api_keys == ("a", "b") and server.served_model_names == ("llama_65b",)
    assert (server.max_input_tokens, server.max_iter_times, server.request_timeout) == (2048, 512, 60)
    assert engine.scheduler.max_num_seqs == 8 and engine.scheduler.max_num_batched_tokens == 8192
    assert engine.model.max_model_len == 2560 and engine.model.model == "/data/llama"
    assert engine.cache.kv_cache_memory_bytes == 512 * 2**20 and engine.cache.block_size == 128


def test_defaults_without_a_file(monkeypatch):
    monkeypatch.delenv("SERVAL_API_KEY", raising=False)
    options = merged_options(build_parser().parse_args(["serve"]))
    server = server_config(options, "SmolLM2")
    assert (server.host, server.port, server.api_keys, server.served_model_names) == (
        "127.0.0.1", 8000, (), ("SmolLM2",),
    )  # fmt: skip
    assert engine_config(options).scheduler.max_queue_len == 1024
    assert engine_config(options).model.single_sequence_threads == 0  # all threads
    flagged = merged_options(build_parser().parse_args(["serve", "--single-sequence-threads", "1"]))
    assert engine_config(flagged).model.single_sequence_threads == 1
    monkeypatch.setenv("SERVAL_API_KEY", "x,y")
    assert server_config(merged_options(build_parser().parse_args(["serve"])), "m").api_keys == ("x", "y")


def test_byte_size_and_server_config_validation():
    assert byte_size("1024") == 1024 and byte_size("2GiB") == 2 * GIB and byte_size("1.5k") == 1536
    with pytest.raises(ValueError):
        ServerConfig(port=70000)
    with pytest.raises(ValueError):
        ServerConfig(ssl_keyfile="k.pem")
    with pytest.raises(ValueError):
        ServerConfig(api_keys=("",))


def test_chat_template_option(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    options = {"chat_template": str(path)}
    assert server_config(options, "m").chat_template == path.read_text()
    assert server_config({"chat_template": "{{ 1 }}"}, "m").chat_template == "{{ 1 }}"
    with pytest.raises(ValueError, match="not found"):
        server_config({"chat_template": str(tmp_path / "missing.jinja")}, "m")
    with pytest.raises(ValueError, match="does not compile"):
        server_config({"chat_template": "{% for %}"}, "m")


@pytest.mark.parametrize(("argv", "expected"), [([], None), (["--tool-call-parser", "auto"], None),
                                                (["--tool-call-parser", "llama3_json"], "llama3_json")])  # fmt: skip
def test_tool_call_parser_flag_reaches_the_server_config(argv, expected):
    options = merged_options(build_parser().parse_args(["serve", *argv]))
    assert server_config(options, "m").tool_call_parser == expected


def test_unknown_tool_call_parser_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])


@pytest.mark.parametrize(("argv", "expected"), [([], None), (["--reasoning-parser", "auto"], None),
                                                (["--reasoning-parser", "glm45"], "glm45"),
                                                (["--tool-call-parser", "kimi_k2"], None)])  # fmt: skip
def test_reasoning_parser_flag_reaches_the_server_config(argv, expected):
    options = merged_options(build_parser().parse_args(["serve", *argv]))
    assert server_config(options, "m").reasoning_parser == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "nope"])


def test_grammar_compile_flags_reach_the_server_config():
    defaults = server_config(merged_options(build_parser().parse_args(["serve"])), "m")
    assert (defaults.grammar_compile_timeout, defaults.grammar_compile_memory_bytes) == (10.0, GIB)
    assert defaults.grammar_compile_workers == 2
    argv = [
        "--grammar-compile-timeout",
        "2.5",
        "--grammar-compile-memory",
        "256MiB",
        "--grammar-compile-workers",
        "3",
    ]
    server = server_config(merged_options(build_parser().parse_args(["serve", *argv])), "m")
    assert (server.grammar_compile_timeout, server.grammar_compile_memory_bytes) == (2.5, 256 * 2**20)
    assert server.grammar_compile_workers == 3
    for bad in (
        {"grammar_compile_timeout": 0},
        {"grammar_compile_memory_bytes": 2**20},
        {"grammar_compile_workers": 0},
    ):
        with pytest.raises(ValueError, match="grammar_compile"):
            ServerConfig(**bad)


def test_media_settings_from_flags_file_and_environment(tmp_path, monkeypatch):
    from serval.serving.media.limits import DEFAULT_MEDIA_ROOT, media_config

    monkeypatch.delenv("ALLOWED_MEDIA_DOMAINS_ENV", raising=False)

    def settings(*argv: str) -> ServerConfig:
        return server_config(merged_options(build_parser().parse_args(["serve", *argv])), "m")

    def media(server: ServerConfig):
        return media_config(server.allowed_local_media_path, server.allowed_media_domains,
                            server.max_concurrent_media_fetches, server.media_fetch_timeout)  # fmt: skip

    defaults = media(settings())
    assert (defaults.local_media_root, defaults.allowed_domains) == (DEFAULT_MEDIA_ROOT, ())
    assert not defaults.allow_loopback_for_tests  # no flag, key or variable reaches it
    monkeypatch.setenv("ALLOWED_MEDIA_DOMAINS_ENV", "upload.media.org, CDN.example.com,,10.1.2.3")
    assert media(settings()).allowed_domains == ("upload.media.org", "cdn.example.com", "10.1.2.3")
    flagged = media(settings("--allowed-media-domains", "a.org", "--allowed-local-media-path", "",
                             "--max-concurrent-media-fetches", "3", "--media-fetch-timeout", "9"))  # fmt: skip
    assert flagged.allowed_domains == ("a.org",) and flagged.local_media_root is None
    assert (flagged.max_concurrent_fetches, flagged.fetch_timeout) == (3, 9.0)
    file = {"ServerConfig": {"allowedMediaDomains": ["b.org"], "allowedLocalMediaPath": "/srv/media"}}
    from_file = media(settings("--config", write(tmp_path, file)))
    assert from_file.allowed_domains == ("b.org",) and from_file.local_media_root == "/srv/media"
    with pytest.raises(ValueError, match="bare host names"):
        ServerConfig(allowed_media_domains=("http://x.org",))
    with pytest.raises(ValueError, match="max_concurrent_media_fetches"):
        ServerConfig(max_concurrent_media_fetches=0)


def test_speculative_config_from_the_flag_and_the_file(tmp_path):
    flag = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5, "adaptive_draft_length": false}'
    options = merged_options(build_parser().parse_args(["serve", "--speculative-config", flag]))
    spec = engine_config(options).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (
        "ngram", 6, 5, 2,
    )  # fmt: skip
    assert not spec.adaptive_draft_length and spec.describe().startswith("ngram (6 drafts, n-grams of 2-5")
    assert engine_config(merged_options(build_parser().parse_args(["serve"]))).speculative.method is None
    data = {**MINDIE, "SpeculativeConfig": {"method": "draft_model", "model": "draft.gguf"}}
    spec = engine_config(
        merged_options(build_parser().parse_args(["serve", "--config", write(tmp_path, data)]))
    )
    assert spec.speculative.model == str(tmp_path / "draft.gguf")
    # The method's measured limit on speculating sequences, unless the config names one.
    assert spec.speculative.max_speculating_seqs == 1 and "up to 1 sequences" in spec.speculative.describe()
    assert engine_config(options).speculative.max_speculating_seqs == 16
    flag = '{"method": "ngram", "max_num_seqs": 4}'
    options = merged_options(build_parser().parse_args(["serve", "--speculative-config", flag]))
    assert engine_config(options).speculative.max_speculating_seqs == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "eagle"}', "speculative method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "between 1 and 15"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "1 <= min <= max"),
        ('{"method": "draft_model"}', "a draft model is given exactly when"),
        ('{"method": "ngram", "adaptive_draft_length": "yes"}', "must be true or false"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 2}', "unknown speculative config key"),
        ("[1]", "must be a JSON object"),
        ("{not json", "Expecting property name"),
    ],
)
def test_bad_speculative_configs_are_refused_at_start(text, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", text])
    assert message in capsys.readouterr().err


def test_a_bad_speculative_config_in_the_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown speculative config key"):
        read_mindie_config(write(tmp_path, {"SpeculativeConfig": {"method": "ngram", "k": 1}}))


def test_attention_backend_and_cuda_graph_flags_reach_the_model_config():
    def model_config(*argv: str):
        return engine_config(merged_options(build_parser().parse_args(["serve", *argv]))).model

    assert (model_config().attention_backend, model_config().cuda_graph_max_batch) == ("auto", 256)
    chosen = model_config("--attention-backend", "triton", "--cuda-graph-max-batch", "0")
    assert (chosen.attention_backend, chosen.cuda_graph_max_batch) == ("triton", 0)
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        model_config("--cuda-graph-max-batch", "-1")


def test_the_kv_cache_dtype_flag_reaches_the_cache_config(capsys):
    def cache_config(*argv: str):
        return engine_config(merged_options(build_parser().parse_args(["serve", *argv]))).cache

    assert cache_config().kv_cache_dtype == "auto"
    assert cache_config("--kv-cache-dtype", "fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    assert cache_config("--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"  # e5m2, as vLLM's CPU backend
    assert cache_config("--kv-cache-dtype", "bfloat16").kv_cache_dtype == "bfloat16"  # vLLM's name
    with pytest.raises(SystemExit):
        cache_config("--kv-cache-dtype", "fp8_e4m3")
    assert "invalid choice" in capsys.readouterr().err


def test_deterministic_from_the_flag_and_the_file(tmp_path):
    def deterministic(argv: list[str]) -> bool:
        return engine_config(merged_options(build_parser().parse_args(["serve", *argv]))).model.deterministic

    assert deterministic([]) is False  # bf16 dense weights keep oneDNN's faster GEMM
    assert deterministic(["--deterministic"]) is True
    deploy = {**MINDIE["BackendConfig"]["ModelDeployConfig"], "deterministic": True}
    data = {**MINDIE, "BackendConfig": {**MINDIE["BackendConfig"], "ModelDeployConfig": deploy}}
    assert deterministic(["--config", write(tmp_path, data)]) is True
    deploy["deterministic"] = "yes"
    with pytest.raises(ValueError, match="ModelDeployConfig.deterministic must be a bool"):
        read_mindie_config(write(tmp_path, data))
