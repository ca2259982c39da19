"""ServerContext: what every route module shares, built once by build_app: the config, the Frontend, the
metrics, the model's facts, and the two questions most routes ask (which model a request names, and whether
that is a LoRA adapter). No module state: each app has its own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from serval.api.body import read_body
from serval.api.errors import APIError, shown
from serval.api.metrics import Metrics
from serval.api.version import model_facts
from serval.api.vllm_metrics import cache_config_labels
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.template_roles import accepted_roles


@dataclass
class ServerContext:
    config: ServerConfig
    frontend: Frontend
    facts: dict[str, Any]  # what /metrics labels serval_model_info with and /version reports
    metrics: Metrics
    # What a request may name: the roles the chat template accepts, and token ids (logit_bias) that both the
    # tokenizer can decode and the model's logits hold.
    roles: frozenset[str]
    vocab_size: int
    started: int = field(default_factory=lambda: int(time.time()))  # the models' `created`

    @classmethod
    def build(cls, config: ServerConfig, frontend: Frontend) -> ServerContext:
        facts = model_facts(config.model_name, frontend.runner_info, frontend.max_model_len)
        return cls(
            config,
            frontend,
            facts,
            Metrics(frontend.stats, facts, cache_config_labels(frontend.runner_info)),
            accepted_roles(frontend.template_source),
            min(frontend.tokenizer.vocab_size, frontend.runner_info.vocab_size),
        )

    async def body(self, request: Request) -> bytes:
        """The request's body, or 413 past --max-request-body-bytes."""
        return await read_body(request, self.config.max_request_body_bytes)

    def check_model(self, name: str | None) -> str:
        """The model a request names (the base model's or a loaded LoRA adapter's), or 404."""
        if (
            name is not None
            and name not in self.config.served_model_names
            and name not in self.frontend.loras
        ):
            raise APIError(404, f"the model {shown(name)} does not exist here", "model", "model_not_found")
        return name or self.config.model_name

    @property
    def is_embedding_model(self) -> bool:
        return self.frontend.runner_info.pooling is not None

    def check_generates(self) -> None:
        """A 400 for a generation route when the served model is an embedding model (it has no head)."""
        if self.is_embedding_model:
            raise APIError(
                400,
                f"the model {shown(self.config.model_name)} is an embedding model: it serves /v1/embeddings "
                "only",
                "model",
                "model_not_generative",
            )

    def lora_of(self, model: str) -> str | None:
        """The LoRA adapter a (checked) model name means; None for the base model."""
        return None if model in self.config.served_model_names else model
