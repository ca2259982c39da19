"""ServerConfig: how the HTTP product is deployed, and the reader of MindIE-style config.json files.

A leaf module (like `config`): the CLI builds one ServerConfig at the edge and hands it to `api`. The engine's
own knobs stay in `config.EngineConfig`; `read_mindie_config` returns plain option values keyed by the CLI's
flag names so that the CLI can layer them: built-in defaults < config file < command-line flags.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from serval.config import LoraModule, SpeculativeConfig

MIB = 1 << 20
GIB = 1 << 30

# Request headers a browser may send cross-origin without the server naming them (the Fetch standard's
# CORS-safelisted names; application/json as Content-Type still needs the preflight to allow the name).
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})


@dataclass(frozen=True)
class CorsConfig:
    """Cross-origin access for browsers (api/cors.py), spelled as vLLM's flags. Only exists when origins are
    configured: CORS is off by default."""

    # Exact origins ("https://app.example", scheme://host[:port], no path), or ("*",): any origin.
    allowed_origins: tuple[str, ...]
    # Methods and request headers a preflight may ask for; "*": whichever it asks (answered by naming them,
    # since browsers do not honour a literal * in credentialed requests).
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    # Access-Control-Allow-Credentials: browsers then send cookies and HTTP auth and let the page read the
    # answer. Never with the wildcard origin: any site could then act with a visitor's credentials.
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if not self.allowed_origins:
            raise ValueError('allowed_origins must name at least one origin (or be ["*"])')
        for origin in self.allowed_origins:
            if origin != "*" and not _is_origin(origin):
                raise ValueError(
                    f"allowed origin {origin!r} is not an origin: scheme://host[:port] with no path or "
                    "trailing slash, e.g. https://app.example"
                )
        if "*" in self.allowed_origins and len(self.allowed_origins) > 1:
            raise ValueError('allowed_origins: "*" already allows every origin; give it alone')
        if "*" in self.allowed_origins and self.allow_credentials:
            raise ValueError(
                'allow_credentials with the origin "*" would let any web site send requests with a '
                "visitor's credentials and read the answers; list the origins that may (--allowed-origins "
                "'[\"https://app.example\"]')"
            )
        for kind, values in (("methods", self.allowed_methods), ("headers", self.allowed_headers)):
            if not values or any(not v or any(c in v for c in " ,") for v in values):
                raise ValueError(f"allowed_{kind} must be a non-empty list of names without spaces or commas")

    @property
    def allows_any_origin(self) -> bool:
        return self.allowed_origins == ("*",)


def _is_origin(text: str) -> bool:
    scheme, sep, authority = text.partition("://")
    return bool(scheme and sep and authority) and "/" not in authority and " " not in text


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Names clients may put in "model"; the first is the one /v1/models and responses report.
    served_model_names: tuple[str, ...] = ("default",)
    # Accepted bearer tokens; empty: no authentication.
    api_keys: tuple[str, ...] = ()
    # Bearer tokens for the admin routes (run-time LoRA loading), also accepted as API keys. With no key of
    # either kind the admin routes are open; with API keys but no admin key they are closed.
    admin_api_keys: tuple[str, ...] = ()
    # The directory run-time LoRA loads (/v1/load_lora_adapter) read from, resolved (lora_root_directory);
    # a path that resolves outside it is refused. None: run-time loading is off. Start-up adapters
    # (--lora-modules) are the operator's and may be anywhere.
    lora_root: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # Largest request body accepted (MindIE: messages up to 4 MB); beyond it the answer is 413.
    max_request_body_bytes: int = 4 * MIB
    # Seconds a request may take end to end; when it runs out the request is cut off with what it has so
    # far (finish_reason "length") rather than failed. None: no limit.
    request_timeout: float | None = 600.0
    # On SIGTERM: seconds the requests in flight may still run (new ones are refused) before each is cut off
    # with what it has; the process then exits 0. Under Kubernetes' default 30 s before SIGKILL, with room.
    shutdown_grace_seconds: float = 20.0
    # MindIE's maxInputTokenLen: the longest prompt accepted (also bounded by the context length).
    max_input_tokens: int | None = None
    # MindIE's maxIterTimes: the default and the cap of max_tokens. None: up to the context length.
    max_iter_times: int | None = None
    # Most sequences one request may ask for (its prompts x max(n, best_of)); beyond it a 400 naming `prompt` or
    # `n`. Never more than the engine's max_queue_len (the CLI checks), so a request under it can be admitted.
    max_seqs_per_request: int = 256
    # MindIE's fullTextEnabled: stream deltas carry the whole text so far and the last chunk has full_text.
    full_text_enabled: bool = False
    # A Jinja chat template that replaces the model's own.
    chat_template: str | None = None
    # The tool-call format (serving/tool_calls.py FORMATS); None: chosen from the chat template (vLLM's
    # --tool-call-parser auto).
    tool_call_parser: str | None = None
    # The reasoning format (serving/reasoning_formats.py REASONING_FORMATS); None: chosen from the chat
    # template (vLLM's --reasoning-parser, whose names these are).
    reasoning_parser: str | None = None
    # Grammar compiles (response_format, tools): a new grammar is first compiled in a worker process that is
    # killed after this many seconds, and may add at most this much address space; past either the request
    # is a 400. Workers: how many new grammars compile at once (serving/grammar_pool.py).
    grammar_compile_timeout: float = 10.0
    grammar_compile_memory_bytes: int = GIB
    grammar_compile_workers: int = 2
    # Media parts (serving/media/limits.py has the rest): the directory local files may come from (None:
    # MindIE's /data/multimodal_inputs; "": no local files), the hosts remote media may come from
    # (ALLOWED_MEDIA_DOMAINS_ENV; none: no remote media), downloads at once and seconds per download.
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_concurrent_media_fetches: int = 8
    media_fetch_timeout: float = 60.0
    log_level: str = "info"
    # The Responses API's store (api/responses_store.py): how many responses are kept for GET and
    # previous_response_id, and for how many seconds. 0: off (store: true and previous_response_id are 400s).
    responses_store_size: int = 0
    responses_store_max_age: float = 3600.0
    # Cross-origin access for browsers; None: off (no CORS headers; a preflight is an OPTIONS request like
    # any other: 405, or 401 without a key when keys are configured).
    cors: CorsConfig | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.served_model_names or any(not name for name in self.served_model_names):
            raise ValueError("served model names must be non-empty strings")
        if any(not key for key in self.api_keys + self.admin_api_keys):
            raise ValueError("an API key must not be empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both ssl_keyfile and ssl_certfile")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be positive")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ValueError(f"max_input_tokens must be positive, got {self.max_input_tokens}")
        if self.max_iter_times is not None and self.max_iter_times < 1:
            raise ValueError(f"max_iter_times must be positive, got {self.max_iter_times}")
        if self.shutdown_grace_seconds < 0:
            raise ValueError(f"shutdown_grace_seconds must be >= 0, got {self.shutdown_grace_seconds}")
        if self.max_seqs_per_request < 1:
            raise ValueError(f"max_seqs_per_request must be positive, got {self.max_seqs_per_request}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout}")
        if self.grammar_compile_memory_bytes < 16 * MIB:
            raise ValueError(
                f"grammar_compile_memory_bytes must be at least 16 MiB, got {self.grammar_compile_memory_bytes}"
            )
        if self.grammar_compile_workers < 1:
            raise ValueError(f"grammar_compile_workers must be positive, got {self.grammar_compile_workers}")
        if self.max_concurrent_media_fetches < 1:
            raise ValueError(
                f"max_concurrent_media_fetches must be positive, got {self.max_concurrent_media_fetches}"
            )
        if not 0 < self.media_fetch_timeout < float("inf"):
            raise ValueError(f"media_fetch_timeout must be positive, got {self.media_fetch_timeout}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if not self.responses_store_max_age > 0:
            raise ValueError(f"responses_store_max_age must be positive, got {self.responses_store_max_age}")
        if any(not d or "/" in d or "," in d or d != d.strip() for d in self.allowed_media_domains):
            raise ValueError(
                f"allowed media domains must be bare host names, got {self.allowed_media_domains}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def cors_config(options: dict[str, Any]) -> CorsConfig | None:
    """The CORS settings from option values keyed by the CLI's names (config file and flags merged), or None
    (off) when no origin is given; the other CORS options need one."""
    if "allowed_origins" not in options:
        orphans = [
            name for name in ("allowed_methods", "allowed_headers", "allow_credentials") if options.get(name)
        ]
        if orphans:
            raise ValueError(
                f"--{orphans[0].replace('_', '-')} needs --allowed-origins (CORS is off without it)"
            )
        return None
    return CorsConfig(
        tuple(options["allowed_origins"]),
        **{name: tuple(options[name]) for name in ("allowed_methods", "allowed_headers") if name in options},
        allow_credentials=bool(options.get("allow_credentials")),
    )


def lora_root_directory(path: str | None) -> str | None:
    """--lora-root as ServerConfig holds it: the real path of an existing directory (ValueError otherwise)."""
    if path is None:
        return None
    if not path or not os.path.isdir(path):
        raise ValueError(f"--lora-root {path!r} is not a directory")
    return os.path.realpath(path)


def _section(data: dict[str, Any], name: str, *parents: str) -> dict[str, Any]:
    # MindIE nests ModelDeployConfig and ScheduleConfig under BackendConfig; a flat file is accepted too.
    for parent in parents:
        nested = data.get(parent)
        if isinstance(nested, dict) and isinstance(nested.get(name), dict):
            return nested[name]
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"config file: {name} must be an object")  # noqa: TRY004 - configs raise ValueError
    return value


def _typed(section: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = section.get(key)
    if value is None:
        return None
    # bool is an int in Python; a port of `true` is a mistake, not 1.
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"config file: {where}.{key} must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"config file: {where}.{key} must be a number, got {value!r}")
    if kind in (str, bool) and not isinstance(value, kind):
        raise ValueError(f"config file: {where}.{key} must be a {kind.__name__}, got {value!r}")
    return value


def _string_list(section: dict[str, Any], key: str, where: str) -> list[str] | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"config file: {where}.{key} must be a list of strings, got {value!r}")
    return value


def _relative_to(base_dir: str, path: str | None) -> str | None:
    if path is None or os.path.isabs(path):
        return path
    return os.path.join(base_dir, path)


def read_mindie_config(path: str) -> dict[str, Any]:
    """Read a MindIE config.json into {cli option name: value}; keys the file does not set are absent.

    Only the fields with a meaning here are read (docs/configuration.md lists them); the rest of a MindIE
    file (NPU ids, log settings, management plane, ...) is ignored so that an existing file works unchanged.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a JSON object")  # noqa: TRY004
    base_dir = os.path.dirname(os.path.abspath(path))
    server = _section(data, "ServerConfig")
    deploy = _section(data, "ModelDeployConfig", "BackendConfig")
    options = {**_server_options(server, base_dir), **_deploy_options(data, deploy, base_dir)}
    options.update(_schedule_options(_section(data, "ScheduleConfig", "BackendConfig")))
    return {key: value for key, value in options.items() if value is not None}


def _server_options(server: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """ServerConfig: where and how the HTTP server listens (TLS), CORS and media settings."""
    options: dict[str, Any] = {
        "host": _typed(server, "ipAddress", str, "ServerConfig"),
        "port": _typed(server, "port", int, "ServerConfig"),
        "full_text_enabled": _typed(server, "fullTextEnabled", bool, "ServerConfig"),
        "request_timeout": _typed(server, "e2eTimeout", float, "ServerConfig"),
        "shutdown_grace_seconds": _typed(server, "shutdownGraceSeconds", float, "ServerConfig"),
        # Not MindIE keys: CORS (vLLM's --allowed-origins, ...), spelled as MindIE spells its keys.
        "allowed_origins": _string_list(server, "allowedOrigins", "ServerConfig"),
        "allowed_methods": _string_list(server, "allowedMethods", "ServerConfig"),
        "allowed_headers": _string_list(server, "allowedHeaders", "ServerConfig"),
        "allow_credentials": _typed(server, "allowCredentials", bool, "ServerConfig"),
        # Not MindIE keys: serval's media settings, beside the server's own.
        "allowed_local_media_path": _typed(server, "allowedLocalMediaPath", str, "ServerConfig"),
        "allowed_media_domains": _domains(server.get("allowedMediaDomains")),
        "max_concurrent_media_fetches": _typed(server, "maxConcurrentMediaFetches", int, "ServerConfig"),
        "media_fetch_timeout": _typed(server, "mediaFetchTimeout", float, "ServerConfig"),
    }
    if options["host"] == "0.0.0.0" and server.get("allowAllZeroIpListening") is not True:
        # MindIE refuses all-zero listening unless the file opts in; keep that safety.
        raise ValueError("config file: ipAddress 0.0.0.0 needs ServerConfig.allowAllZeroIpListening = true")
    if _typed(server, "httpsEnabled", bool, "ServerConfig"):
        cert = _typed(server, "tlsCert", str, "ServerConfig")
        key = _typed(server, "tlsPk", str, "ServerConfig")
        if not cert or not key:
            raise ValueError("config file: httpsEnabled needs ServerConfig.tlsCert and ServerConfig.tlsPk")
        options["ssl_certfile"] = _relative_to(base_dir, cert)
        options["ssl_keyfile"] = _relative_to(base_dir, key)
    return options


def _schedule_options(schedule: dict[str, Any]) -> dict[str, Any]:
    """ScheduleConfig: the batch, the queue, the KV-cache block."""
    return {
        "max_num_seqs": _typed(schedule, "maxBatchSize", int, "ScheduleConfig"),
        "max_iter_times": _typed(schedule, "maxIterTimes", int, "ScheduleConfig"),
        "max_num_batched_tokens": _typed(schedule, "maxPrefillTokens", int, "ScheduleConfig"),
        "block_size": _typed(schedule, "cacheBlockSize", int, "ScheduleConfig"),
        "max_queue_len": _typed(schedule, "maxQueueLen", int, "ScheduleConfig"),
        "max_seqs_per_request": _typed(schedule, "maxSeqsPerRequest", int, "ScheduleConfig"),
    }


def _deploy_options(data: dict[str, Any], deploy: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """ModelDeployConfig: the context, the model (its first ModelConfig), LoRA adapters and their root."""
    options: dict[str, Any] = {
        "max_model_len": _typed(deploy, "maxSeqLen", int, "ModelDeployConfig"),
        "max_input_tokens": _typed(deploy, "maxInputTokenLen", int, "ModelDeployConfig"),
    }
    models = deploy.get("ModelConfig")
    if models is not None:
        if not isinstance(models, list) or not models or not isinstance(models[0], dict):
            raise ValueError("config file: ModelDeployConfig.ModelConfig must be a non-empty list of objects")
        name = _typed(models[0], "modelName", str, "ModelConfig[0]")
        options["served_model_name"] = [name] if name else None
        options["model"] = _relative_to(base_dir, _typed(models[0], "modelWeightPath", str, "ModelConfig[0]"))
        npu_mem_gib = _typed(models[0], "npuMemSize", int, "ModelConfig[0]")
        if npu_mem_gib is not None and npu_mem_gib > 0:  # -1: automatic
            options["kv_cache_memory_bytes"] = npu_mem_gib * GIB
    # Not a MindIE key: --deterministic, beside the models.
    options["deterministic"] = _typed(deploy, "deterministic", bool, "ModelDeployConfig")
    lora_modules = deploy.get("LoraModules", data.get("LoraModules"))
    if lora_modules is not None:
        options["lora_modules"] = _lora_modules(lora_modules, base_dir)
    # Not a MindIE key: serval's --lora-root, beside LoraModules (or at the top level).
    lora_root = _typed(deploy, "LoraRoot", str, "ModelDeployConfig")
    if lora_root is None:
        lora_root = _typed(data, "LoraRoot", str, "config")
    if lora_root is not None:
        options["lora_root"] = _relative_to(base_dir, lora_root)
    # Not a MindIE key: --speculative-config's object, beside LoraModules (or at the top level).
    speculative = deploy.get("SpeculativeConfig", data.get("SpeculativeConfig"))
    if speculative is not None:
        config = SpeculativeConfig.from_dict(speculative)
        if config.model is not None:
            config = dataclasses.replace(config, model=_relative_to(base_dir, config.model))
        options["speculative_config"] = config
    return options


def split_domains(text: str) -> list[str]:
    """ALLOWED_MEDIA_DOMAINS_ENV's spelling: host names separated by commas (blanks ignored)."""
    return [d.strip() for d in text.split(",") if d.strip()]


def _domains(value: Any) -> list[str] | None:
    # allowedMediaDomains: a list of host names, or one comma-separated string as the environment variable.
    if value is None:
        return None
    if isinstance(value, str):
        return split_domains(value)
    if isinstance(value, list) and all(isinstance(d, str) for d in value):
        return [d.strip() for d in value if d.strip()]
    raise ValueError("config file: ServerConfig.allowedMediaDomains must be a string or a list of strings")


def _lora_modules(entries: Any, base_dir: str) -> list[LoraModule]:
    # MindIE: [{"name", "path", "baseModelName"}]; vLLM's JSON spelling base_model_name is accepted too.
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("config file: LoraModules must be a list of objects with name and path")
    modules = []
    for i, entry in enumerate(entries):
        where = f"LoraModules[{i}]"
        name, path = _typed(entry, "name", str, where), _typed(entry, "path", str, where)
        if not name or not path:
            raise ValueError(f"config file: {where} needs a name and a path")
        base = _typed(entry, "baseModelName", str, where) or _typed(entry, "base_model_name", str, where)
        modules.append(LoraModule(name, _relative_to(base_dir, path), base))
    return modules
