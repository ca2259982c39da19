"""The `serval` command: argv (and the SERVAL_API_KEY, SERVAL_ADMIN_API_KEY and ALLOWED_MEDIA_DOMAINS_ENV
environment variables) are read here and nowhere else.

Owns turning options into frozen configs. Options come in three layers, later ones winning: the built-in
defaults of the config dataclasses, a MindIE-style config.json given with --config, and the flags themselves
(spelled as vLLM spells them). docs/configuration.md lists every option. `serval chat` and `serval complete`
are terminal_chat.py's (its add_parsers defines their options).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from serval.cli_options import (
    add_cors_options,
    add_grammar_options,
    add_lora_options,
    add_media_options,
    add_parallel_options,
    add_replica_options,
    add_responses_store_options,
    byte_size,
)
from serval.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, ParallelConfig, SchedulerConfig
from serval.model_source import ModelSource, resolve_model
from serval.server_config import (
    ServerConfig,
    cors_config,
    lora_root_directory,
    read_mindie_config,
    split_domains,
)
from serval.serving.chat_template import ChatTemplate


def _add_serve_parser(subparsers: Any) -> None:
    # NOTE: imported here: it imports the engine and torch (~2 s), which `serval chat` never needs.
    from serval.serving.tool_calls import FORMATS as TOOL_CALL_FORMATS

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    p.add_argument("--config", help="a MindIE-style config.json; flags override its values")
    p.add_argument(
        "--model", help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--served-model-name", nargs="+", help="names clients use in `model` (first is reported)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8000)")
    p.add_argument("--api-key", action="append", help="accepted bearer token; repeat for several")
    p.add_argument("--ssl-keyfile", help="TLS private key (PEM)")
    p.add_argument("--ssl-certfile", help="TLS certificate (PEM)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--batch-activations",
        choices=["float32", "int8"],
        help="matmuls over packed 4-bit weights (every batch on AVX2, batches past 8 rows with AVX-512-VNNI): "
        "int8 (default: x rounded per block of 32 as llama.cpp does, outliers "
        "exact; twice the products an instruction, closer to fp32 than llama.cpp on the default model) or "
        "float32 (exact products of the file's weights; docs/benchmarks.md)",
    )
    p.add_argument("--device", help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, help="seed of unseeded sampling")
    p.add_argument(
        "--single-sequence-threads",
        type=int,
        help="CPU threads for a decode step of one lone sequence (default 0: all; 1 leaves the other cores "
        "to HTTP: a lower p99 on a busy machine, a higher median)",
    )
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the model's)")
    p.add_argument("--max-input-tokens", type=int, help="longest prompt accepted (MindIE maxInputTokenLen)")
    p.add_argument("--max-iter-times", type=int, help="default and cap of max_tokens (MindIE maxIterTimes)")
    p.add_argument("--max-num-seqs", type=int, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    p.add_argument("--max-queue-len", type=int, help="most requests waiting; beyond it 429")
    p.add_argument(
        "--max-seqs-per-request",
        type=int,
        help="most sequences (prompts x n) one request may ask for; beyond it 400 (default 256, at most "
        "--max-queue-len)",
    )
    p.add_argument("--kv-cache-memory-bytes", type=byte_size, help="KV-cache memory, e.g. 2GiB")
    p.add_argument("--num-kv-blocks", type=int, help="exact number of KV-cache blocks (overrides memory)")
    p.add_argument("--block-size", type=int, help="tokens per KV-cache block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--max-pinned-kv-fraction", type=float, help="KV cache that cache_control may pin (default 0.25)"
    )
    p.add_argument("--request-timeout", type=float, help="seconds a request may take (default 600)")
    p.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        help="on SIGTERM, how long requests in flight may run before they are cut off (default 20)",
    )
    p.add_argument("--max-request-body-bytes", type=byte_size, help="largest request body (default 4MiB)")
    p.add_argument("--full-text-enabled", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--chat-template", help="a Jinja chat template file (or the template itself)")
    p.add_argument(
        "--tool-call-parser",
        choices=["auto", *TOOL_CALL_FORMATS],
        help="the tool-call format (default auto: from the chat template, else hermes)",
    )
    add_grammar_options(p)
    add_responses_store_options(p)
    add_parallel_options(p)
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    add_cors_options(p)
    add_lora_options(p)
    add_media_options(p)
    add_replica_options(p)


def build_parser(with_serve: bool = True) -> argparse.ArgumentParser:
    """The whole command line; without `serve` (for `serval chat` and `complete`) it needs no model code."""
    from serval import terminal_chat

    parser = argparse.ArgumentParser(prog="serval", description="An LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    if with_serve:
        _add_serve_parser(subparsers)
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
                          "max_model_len": "max_model_len", "batch_activations": "batch_activations"}),
        single_sequence_threads=options.get("single_sequence_threads", 0),
    )  # fmt: skip
    cache = CacheConfig(
        **_pick(options, {"block_size": "block_size", "kv_cache_memory_bytes": "kv_cache_memory_bytes",
                          "num_kv_blocks": "num_blocks", "enable_prefix_caching": "enable_prefix_caching",
                          "max_pinned_kv_fraction": "max_pinned_kv_fraction"})
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
    return EngineConfig(model=model, cache=cache, scheduler=scheduler, lora=lora, parallel=parallel)


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


def start_engine(engine: EngineConfig, source: ModelSource, on_runner_failure=None, replicas=None):
    """The tokenizer and the running engine of `source` (or, with `replicas`, the client of the replica set:
    serval/cluster/); exits with one line when the model can't load.
    on_runner_failure(message): called on another thread if the runner dies under the server."""
    # Heavy imports here: `serval --help` and config errors stay fast.
    from serval.engine.client import EngineClient
    from serval.engine.lora import LoraError
    from serval.serving.media.processor import media_processor_for
    from serval.serving.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.from_source(source)
        # A multimodal checkpoint's processor (its preprocessor_config.json); None for a text-only model.
        media_processor = None if source.is_gguf else media_processor_for(source.path)
        if replicas is not None:
            import importlib.util

            from serval.cluster.cluster import start_replicas

            if importlib.util.find_spec("ray") is None:
                sys.exit("serval: error: --replicas needs Ray Serve: pip install 'serval[replicas]'")
            return tokenizer, start_replicas(engine, replicas), media_processor
        return tokenizer, EngineClient.start(engine, on_runner_failure), media_processor
    except LoraError as e:
        sys.exit(f"serval: error: {e}")
    except (ValueError, OSError) as e:
        # A corrupt file, an unknown architecture or quantization type: one line, not a traceback.
        sys.exit(f"serval: error: cannot load the model {source.path}: {e}")


def build_frontend_app(server: ServerConfig, tokenizer, client, media_processor=None):
    """The Frontend over a running engine, and the app that serves it. media_processor: the model's, for a
    multimodal one (start_engine)."""
    from serval.api.app import build_app
    from serval.serving.frontend import Frontend
    from serval.serving.grammar_pool import GrammarLimits
    from serval.serving.media.limits import media_config

    frontend = Frontend(
        client,
        tokenizer,
        server.chat_template,
        server.max_input_tokens,
        server.max_iter_times,
        tool_call_format=server.tool_call_parser,
        max_seqs_per_request=server.max_seqs_per_request,
        grammar_limits=GrammarLimits(
            server.grammar_compile_timeout,
            server.grammar_compile_memory_bytes,
            server.grammar_compile_workers,
        ),
        media_config=media_config(
            server.allowed_local_media_path,
            server.allowed_media_domains,
            server.max_concurrent_media_fetches,
            server.media_fetch_timeout,
        ),
        media_processor=media_processor,
    )
    return frontend, build_app(server, frontend)


def serve(engine: EngineConfig, server: ServerConfig, source: ModelSource, replicas=None) -> None:
    from serval.api.shutdown import STARTUP_FAILURE, run
    from serval.lifetime import freeze_long_lived_objects

    failures: list[str] = []

    def runner_failed(message: str) -> None:
        # A tensor-parallel worker died (the runner logged it): stop as on SIGTERM (requests in flight have
        # failed already, new ones get 503), then exit non-zero below.
        failures.append(message)
        os.kill(os.getpid(), signal.SIGTERM)

    tokenizer, client, media_processor = start_engine(engine, source, runner_failed, replicas)
    try:
        frontend, app = build_frontend_app(server, tokenizer, client, media_processor)
        freeze_long_lived_objects()
        scheme = "https" if server.ssl_certfile else "http"
        logger = logging.getLogger("serval")

        def started() -> None:
            # The one start-up line, once the port is bound: what runs and how (weights, dtype, kernel variant,
            # threads, KV cache, concurrency) and where, so a slow report names its code path; /version and
            # the serval_model_info metric say the same.
            logger.info(
                "model %s: %s, up to %d sequences at once, serving on %s://%s:%d",
                server.model_name, client.runner_info.describe(), engine.scheduler.max_num_seqs,
                scheme, server.host, server.port,
            )  # fmt: skip

        if not run(app, server, frontend, on_started=started):
            sys.exit(STARTUP_FAILURE)  # the port is taken, ...: uvicorn logged why
    finally:
        if replicas is not None:
            from serval.cluster.cluster import stop_replicas

            stop_replicas(client)
        else:
            client.shutdown()
    if failures:
        sys.exit(f"serval: error: {failures[0]}")


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(with_serve=argv[:1] not in (["chat"], ["complete"]))
    args = parser.parse_args(argv)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if args.command in ("chat", "complete"):
        from serval import terminal_chat

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
