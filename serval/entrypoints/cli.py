"""The `serval` command: argv (and the SERVAL_API_KEY, SERVAL_ADMIN_API_KEY and ALLOWED_MEDIA_DOMAINS_ENV
environment variables) are read here and nowhere else.

Owns turning options into frozen configs. Options come in three layers, later ones winning: the built-in
defaults of the config dataclasses, a MindIE-style config.json given with --config, and the flags themselves
(spelled as vLLM spells them). docs/configuration.md lists every option; cli_options.py defines the flags.
`serval chat` and `serval complete` are terminal_chat.py's (its add_parsers defines their options); wiring.py
builds and runs the server from the configs made here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from serval.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from serval.entrypoints import terminal_chat
from serval.entrypoints.cli_options import add_serve_parser
from serval.entrypoints.wiring import serve
from serval.model_source import resolve_model
from serval.server_config import (
    ServerConfig,
    cors_config,
    lora_root_directory,
    read_mindie_config,
    split_domains,
)
from serval.serving.chat_template import ChatTemplate


def build_parser(with_serve: bool = True) -> argparse.ArgumentParser:
    """The whole command line; without `serve` (for `serval chat` and `complete`) it needs no model code."""
    parser = argparse.ArgumentParser(prog="serval", description="An LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    if with_serve:
        add_serve_parser(subparsers)
    terminal_chat.add_parsers(subparsers)  # `chat` and `complete`
    return parser


def merged_options(args: argparse.Namespace) -> dict[str, Any]:
    """Flags over the config file: {option name: value}, unset options absent."""
    options = read_mindie_config(args.config) if args.config else {}
    if args.model_tag is not None and args.model is None:
        args.model = args.model_tag
    for name, value in vars(args).items():
        if value is not None and name not in ("command", "config", "model_tag"):
            options[name] = value
    for name, variable in (("api_key", "SERVAL_API_KEY"), ("admin_api_key", "SERVAL_ADMIN_API_KEY")):
        if name not in options and os.environ.get(variable):
            options[name] = [k for k in os.environ[variable].split(",") if k]
    if "allowed_media_domains" not in options and os.environ.get("ALLOWED_MEDIA_DOMAINS_ENV"):
        options["allowed_media_domains"] = split_domains(os.environ["ALLOWED_MEDIA_DOMAINS_ENV"])
    return options


def _pick(options: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    # Only the options that were set, renamed to the dataclass fields: unset ones keep the field defaults.
    return {field: options[name] for name, field in mapping.items() if name in options}


def engine_config(options: dict[str, Any]) -> EngineConfig:
    model = ModelConfig(
        **_pick(options, {"model": "model", "dtype": "dtype", "device": "device", "seed": "seed",
                          "max_model_len": "max_model_len", "batch_activations": "batch_activations",
                          "attention_backend": "attention_backend",
                          "cuda_graph_max_batch": "cuda_graph_max_batch",
                          "deterministic": "deterministic"}),
        single_sequence_threads=options.get("single_sequence_threads", 0),
    )  # fmt: skip
    cache = CacheConfig(
        **_pick(options, {"block_size": "block_size", "kv_cache_memory_bytes": "kv_cache_memory_bytes",
                          "num_kv_blocks": "num_blocks", "enable_prefix_caching": "enable_prefix_caching",
                          "max_pinned_kv_fraction": "max_pinned_kv_fraction",
                          "kv_cache_dtype": "kv_cache_dtype"})
    )  # fmt: skip
    scheduler = SchedulerConfig(
        **_pick(options, {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                          "max_queue_len": "max_queue_len"})
    )  # fmt: skip
    lora = LoraConfig(
        **_pick(options, {"enable_lora": "enable_lora", "max_loras": "max_loras",
                          "max_lora_rank": "max_lora_rank"}),
        lora_modules=tuple(options.get("lora_modules") or ()),
    )  # fmt: skip
    parallel = ParallelConfig(**_pick(options, {"tensor_parallel_size": "tensor_parallel_size"}))
    speculative = options.get("speculative_config") or SpeculativeConfig()
    return EngineConfig(
        model=model, cache=cache, scheduler=scheduler, lora=lora, parallel=parallel, speculative=speculative
    )


def server_config(options: dict[str, Any], default_model_name: str) -> ServerConfig:
    fields = _pick(
        options,
        {"host": "host", "port": "port", "ssl_keyfile": "ssl_keyfile", "ssl_certfile": "ssl_certfile",
         "request_timeout": "request_timeout", "max_request_body_bytes": "max_request_body_bytes",
         "max_input_tokens": "max_input_tokens", "max_iter_times": "max_iter_times",
         "full_text_enabled": "full_text_enabled", "log_level": "log_level",
         "shutdown_grace_seconds": "shutdown_grace_seconds",
         "grammar_compile_timeout": "grammar_compile_timeout",
         "grammar_compile_memory": "grammar_compile_memory_bytes",
         "grammar_compile_workers": "grammar_compile_workers",
         "allowed_local_media_path": "allowed_local_media_path",
         "max_concurrent_media_fetches": "max_concurrent_media_fetches",
         "media_fetch_timeout": "media_fetch_timeout",
         "responses_store_size": "responses_store_size", "responses_store_max_age": "responses_store_max_age"},
    )  # fmt: skip
    fields["allowed_media_domains"] = tuple(options.get("allowed_media_domains") or ())
    fields["served_model_names"] = tuple(options.get("served_model_name") or (default_model_name,))
    fields["max_seqs_per_request"] = max_seqs_per_request(options)
    fields["api_keys"] = tuple(options.get("api_key") or ())
    fields["admin_api_keys"] = tuple(options.get("admin_api_key") or ())
    fields["lora_root"] = lora_root_directory(options.get("lora_root"))
    fields["cors"] = cors_config(options)
    for module in options.get("lora_modules") or ():
        if module.name in fields["served_model_names"]:
            raise ValueError(f"the LoRA module {module.name!r} has the base model's name")
    template = options.get("chat_template")
    if template is not None:
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        elif "{" not in template:
            raise ValueError(f"chat template file not found: {template}")
        ChatTemplate(template)  # a template that does not compile fails now, not at the first request
    fields["chat_template"] = template
    parser = options.get("tool_call_parser", "auto")
    fields["tool_call_parser"] = None if parser == "auto" else parser
    reasoning = options.get("reasoning_parser", "auto")
    fields["reasoning_parser"] = None if reasoning == "auto" else reasoning
    return ServerConfig(**fields)


def replica_config(options: dict[str, Any]):
    """The replica set of --replicas, or None: one engine in this process (Ray is never imported)."""
    if "replicas" not in options:
        for name in ("replica_threads", "ray_address", "replica_routing"):
            if name in options:
                raise ValueError(f"--{name.replace('_', '-')} needs --replicas")
        return None
    if options.get("tensor_parallel_size", 1) > 1:
        # Each replica would spawn its own tensor-parallel workers inside a Ray actor: not built or tested.
        raise ValueError("--replicas with --tensor-parallel-size > 1 is not supported yet")
    from serval.cluster.config import ReplicaConfig

    return ReplicaConfig(
        **_pick(options, {"replicas": "num_replicas", "replica_threads": "threads_per_replica",
                          "ray_address": "ray_address", "replica_routing": "routing"})
    )  # fmt: skip


def max_seqs_per_request(options: dict[str, Any]) -> int:
    """The per-request cap on sequences; no larger than the waiting queue, or a request under it could never be
    admitted (admission is all or nothing). Unset, the default shrinks to fit a smaller queue."""
    max_queue_len = options.get("max_queue_len", SchedulerConfig.max_queue_len)
    cap = options.get("max_seqs_per_request")
    if cap is None:
        return min(ServerConfig.max_seqs_per_request, max_queue_len)
    if cap > max_queue_len:
        raise ValueError(
            f"max_seqs_per_request ({cap}) is more than max_queue_len ({max_queue_len}): a request of that many "
            "sequences could never be admitted"
        )
    return cap


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(with_serve=argv[:1] not in (["chat"], ["complete"]))
    args = parser.parse_args(argv)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if args.command in ("chat", "complete"):
        # Quiet but for what a first start must explain (the kernel compile, a slow weight load).
        logging.basicConfig(level=logging.WARNING, format=log_format)
        for name in ("serval.runner.kernels", "serval.progress"):
            logging.getLogger(name).setLevel(logging.INFO)
        if args.api_key is None and os.environ.get("SERVAL_API_KEY"):
            args.api_key = os.environ["SERVAL_API_KEY"].split(",")[0]
        sys.exit(terminal_chat.main(args))
    logging.basicConfig(level=logging.INFO, format=log_format)
    if args.command == "serve":
        # Everything is validated, and the model found, before the model loads.
        try:
            options = merged_options(args)
            engine = engine_config(options)
            source = resolve_model(engine.model.model)
            server = server_config(options, options.get("model") or source.name)
            replicas = replica_config(options)
        except (ValueError, OSError) as e:
            parser.error(str(e))
        serve(engine, server, source, replicas)


if __name__ == "__main__":
    main(sys.argv[1:])
