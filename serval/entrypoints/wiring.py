"""The wiring of a server: the pieces `serval serve` and the terminal tools' in-process server (local_server.py)
build from frozen configs, in one place: the tokenizer and the running engine (or the client of a replica set),
the Frontend over it and the HTTP app, and `serve`, which runs them until SIGTERM.

Owns the order things start and stop in and how a model that can't load is reported (one line, not a
traceback). Heavy imports (torch, the engine, uvicorn) happen inside the functions: `serval --help` and a config
error stay fast.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from serval.config import EngineConfig
from serval.model_source import ModelSource
from serval.server_config import ServerConfig


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
        reasoning_parser=server.reasoning_parser,
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
