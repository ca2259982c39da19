"""The `serval serve` command's option types and its groups of related flags (grammars, CORS, LoRA, media), for
cli.py.

Owns how a flag's text becomes a value (sizes such as `4GiB`, `NAME=PATH` adapters, vLLM's JSON lists) and
the help each group prints; cli.py turns the parsed options into configs.
"""

from __future__ import annotations

import argparse
import json
import re

from serval.config import KV_CACHE_DTYPES, LoraModule, SpeculativeConfig
from serval.server_config import split_domains

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """'1073741824', '4GiB', '512M', '1.5G' -> bytes (k/M/G/T are powers of 1024 either way, as in vLLM)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** "_kmgt".index(unit.lower() or "_"))


def lora_module(text: str) -> LoraModule:
    """vLLM's --lora-modules forms: 'name=path', or JSON {"name", "path", "base_model_name"}."""
    try:
        if text.lstrip().startswith("{"):
            fields = json.loads(text)
            if not isinstance(fields, dict) or set(fields) - {"name", "path", "base_model_name"}:
                raise ValueError('the JSON form has the keys "name", "path" and "base_model_name"')
            return LoraModule(
                fields.get("name") or "", fields.get("path") or "", fields.get("base_model_name")
            )
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError("expected name=path")
        return LoraModule(name.strip(), path.strip())
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(f"bad LoRA module {text!r}: {e}") from None


def speculative_config(text: str) -> SpeculativeConfig:
    """vLLM's --speculative-config: a JSON object of SpeculativeConfig's keys."""
    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(f"bad --speculative-config {text!r}: {e}") from None


def json_list(text: str) -> list[str]:
    """vLLM's spelling of --allowed-origins and its siblings: a JSON list of strings."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(
            f"expected a JSON list of strings, e.g. '[\"https://app.example\"]', got {text!r}"
        )
    return value


def add_cors_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-origins", type=json_list, metavar="JSON",
        help='turn CORS on for these origins: a JSON list, e.g. \'["https://app.example"]\' or \'["*"]\' (default: off)',
    )  # fmt: skip
    p.add_argument("--allowed-methods", type=json_list, metavar="JSON", help='CORS methods (default ["*"])')
    p.add_argument(
        "--allowed-headers", type=json_list, metavar="JSON", help='CORS request headers (default ["*"])'
    )
    p.add_argument(
        "--allow-credentials", action=argparse.BooleanOptionalAction, default=None,
        help="CORS: let browsers send credentials (never with the origin *)",
    )  # fmt: skip


def add_lora_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reserve LoRA adapter slots (implied by --lora-modules)",
    )
    p.add_argument(
        "--lora-modules",
        type=lora_module,
        nargs="+",
        action="extend",
        metavar="NAME=PATH",
        help='adapters to load at start: name=path or {"name": .., "path": .., "base_model_name": ..}',
    )
    p.add_argument("--max-loras", type=int, help="adapters loaded at once (default 4)")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default 16)")
    p.add_argument("--admin-api-key", action="append", help="bearer token of the admin routes; repeatable")
    p.add_argument(
        "--lora-root", help="directory /v1/load_lora_adapter may load from (default: no run-time loads)"
    )


def add_media_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-local-media-path",
        help="directory local media files (file://, bare paths) may come from (default /data/multimodal_inputs; "
        "'' turns local files off)",
    )
    p.add_argument(
        "--allowed-media-domains",
        type=split_domains,
        help="comma-separated hosts http(s) media may come from (default: ALLOWED_MEDIA_DOMAINS_ENV, else none)",
    )
    p.add_argument("--max-concurrent-media-fetches", type=int, help="media downloads at once (default 8)")
    p.add_argument(
        "--media-fetch-timeout", type=float, help="seconds one media download may take (default 60)"
    )


def add_grammar_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        help="seconds a new grammar (response_format, tools) may take to compile; past it a 400 (default 10)",
    )
    p.add_argument(
        "--grammar-compile-memory",
        type=byte_size,
        help="memory one grammar compile may take, e.g. 512MiB; past it a 400 (default 1GiB)",
    )
    p.add_argument(
        "--grammar-compile-workers", type=int, help="processes compiling new grammars at once (default 2)"
    )


def add_responses_store_options(p: argparse.ArgumentParser) -> None:
    """The Responses API's store (api/responses_store.py): off unless given a size."""
    p.add_argument(
        "--responses-store-size",
        type=int,
        metavar="N",
        help="keep the last N responses in memory for GET /v1/responses/{id} and previous_response_id "
        "(default 0: off; store and previous_response_id are then refused)",
    )
    p.add_argument(
        "--responses-store-max-age",
        type=float,
        metavar="SECONDS",
        help="forget a stored response this long after it was made (default 3600)",
    )


def add_replica_options(p: argparse.ArgumentParser) -> None:
    """Replicas on Ray Serve (serval/cluster/, docs/deploy/replicas.md)."""
    p.add_argument(
        "--replicas",
        type=int,
        help="engine replicas on Ray Serve behind this server's one endpoint (default: one engine in this "
        "process, no Ray); each loads the model and has the KV cache the usual flags set",
    )
    p.add_argument("--replica-threads", type=int, help="CPU threads of each replica (default 1)")
    p.add_argument(
        "--ray-address", help="join this Ray cluster (e.g. auto, host:6379) instead of starting a local one"
    )
    p.add_argument(
        "--replica-routing",
        choices=["prefix", "round_robin"],
        help="prefix (default): a prompt head seen before goes to the replica caching it while load allows, "
        "else to the least-loaded replica; round_robin: in turn",
    )


def add_parallel_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        metavar="N",
        help="split the model over N processes, each holding 1/N of the attention heads and of the MLP "
        "(default 1; docs/deploy/tensor-parallel.md)",
    )


def add_serve_parser(subparsers) -> None:
    """The `serve` sub-command and every flag of it, in the order --help lists them."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_server_options(p)
    _add_model_options(p)
    _add_limit_options(p)
    _add_request_options(p)
    add_grammar_options(p)
    add_responses_store_options(p)
    add_parallel_options(p)
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    add_cors_options(p)
    add_lora_options(p)
    add_media_options(p)
    add_replica_options(p)


def _add_server_options(p: argparse.ArgumentParser) -> None:
    """What is served, where, to whom."""
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


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """How the model runs."""
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--batch-activations",
        choices=["auto", "float32", "int8"],
        help="matmuls over packed 4-bit weights, one way at every row count: "
        "int8 (x rounded per block of 32 as llama.cpp does, outliers "
        "exact; twice the products an instruction, closer to fp32 than llama.cpp on the default model), "
        "float32 (int16 x: near-exact products of the file's weights) or auto (default: int8 wherever "
        "AVX2 is, float32 in the portable build; docs/configuration.md)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="bf16 dense weights too through the batch-invariant matmul (fp32, F16 and packed weights always "
        "are): a request's answer the same alone and in any batch, at ~0.86x the decode throughput of "
        "64 streams (docs/configuration.md)",
    )
    p.add_argument("--device", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--attention-backend",
        choices=["auto", "native-cpu", "sdpa", "triton"],
        help="attention over the paged KV cache (default auto: native-cpu on the CPU with its kernels built, "
        "triton on CUDA, sdpa otherwise; docs/cuda.md)",
    )
    p.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        help="CUDA: decode steps of up to this many sequences replay captured graphs (default 256; 0: none)",
    )
    p.add_argument("--seed", type=int, help="seed of unseeded sampling")
    p.add_argument(
        "--single-sequence-threads",
        type=int,
        help="CPU threads for a decode step of one lone sequence (default 0: all; 1 leaves the other cores "
        "to HTTP: a lower p99 on a busy machine, a higher median)",
    )
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the model's)")
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 8, "prompt_lookup_min": 2}\' (drafts copied from the prompt and output) or '
        '\'{"method": "draft_model", "model": PATH}\' (a smaller model with the same vocabulary); each '
        'sequence\'s draft length adapts up to num_speculative_tokens ("adaptive_draft_length": false: fixed); '
        "greedy answers are unchanged, sampled ones keep their distribution (default: off; docs/speculative.md)",
    )


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    """The context, the batch, the queue and the KV cache."""
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
    p.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        help="what the KV cache holds (default auto: the model's dtype; bfloat16: half an fp32 cache's bytes "
        "where the compute dtype is fp32; a byte a value, about twice a bf16 cache's tokens: int8, rows of "
        "codes and a scale each, or fp8_e5m2 (fp8 as vLLM's CPU backend takes it), coarser; "
        "docs/configuration.md)",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--max-pinned-kv-fraction", type=float, help="KV cache that cache_control may pin (default 0.25)"
    )


def _add_request_options(p: argparse.ArgumentParser) -> None:
    """A request's time, body and answer shape."""
    # NOTE: imported here: it imports the engine and torch (~2 s), which `serval chat` never needs.
    from serval.serving.reasoning_formats import REASONING_FORMATS
    from serval.serving.tool_calls import FORMATS as TOOL_CALL_FORMATS

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
    p.add_argument(
        "--reasoning-parser",
        choices=["auto", *REASONING_FORMATS],
        help="the reasoning markup split into reasoning_content (default auto: from the chat template; none "
        "when it has no <think>)",
    )
