"""build_app: the FastAPI app, assembled from its route modules and middleware.

Owns the assembly only: one ServerContext (config, Frontend, metrics) shared by the route modules
(generation_routes.py: chat and completions; responses_routes.py: OpenAI's Responses API; anthropic_routes.py: Anthropic's Messages API;
embeddings_routes.py: /v1/embeddings;
info_routes.py: models, tokenize, metrics, version;
lora_routes.py: adapters at run time; playground_routes.py: the web page at /), the error handlers (errors.py: every failure in the OpenAI error
shape), and the middleware in order: status counting, CORS when configured (cors.py), API keys, the shutdown
gate. Everything the app needs comes in through build_app; there is no module state.
"""

from __future__ import annotations

from fastapi import FastAPI

from serval.api.anthropic_routes import PATHS as ANTHROPIC_PATHS
from serval.api.anthropic_routes import add_anthropic_routes
from serval.api.auth import OPEN_PATHS, APIKeyAuth
from serval.api.context import ServerContext
from serval.api.cors import CORS
from serval.api.embeddings_routes import PATHS as EMBEDDINGS_PATHS
from serval.api.embeddings_routes import add_embeddings_routes
from serval.api.errors import install_error_handlers
from serval.api.generation_routes import add_generation_routes
from serval.api.info_routes import add_info_routes
from serval.api.lora_routes import ADMIN_PATHS, add_lora_routes
from serval.api.metrics import StatusCounter
from serval.api.playground_routes import PATHS as PLAYGROUND_PATHS
from serval.api.playground_routes import add_playground_routes
from serval.api.responses_routes import PATHS as RESPONSES_PATHS
from serval.api.responses_routes import add_responses_routes
from serval.api.shutdown import DrainGate
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend

ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/tokenize",
        "/detokenize",
        "/metrics",
        "/version",
        *RESPONSES_PATHS,
        *ANTHROPIC_PATHS,
        *EMBEDDINGS_PATHS,
        *ADMIN_PATHS,
        *PLAYGROUND_PATHS,
    }
)


def build_app(config: ServerConfig, frontend: Frontend) -> FastAPI:
    app = FastAPI(title="serval", docs_url=None, redoc_url=None, openapi_url=None)
    ctx = ServerContext.build(config, frontend)
    install_error_handlers(app)
    add_generation_routes(app, ctx)
    add_responses_routes(app, ctx)
    add_anthropic_routes(app, ctx)
    add_embeddings_routes(app, ctx)
    add_info_routes(app, ctx)
    add_lora_routes(app, config, frontend)
    add_playground_routes(app)
    app.state.metrics = ctx.metrics
    app.state.frontend = frontend
    # Outermost first: count every status (401s included), answer preflights and grant origins (before
    # authentication: a preflight carries no key; a 401 carries the grant so a page can read it),
    # authenticate, then refuse while shutting down.
    app.add_middleware(DrainGate, drain=frontend.drain)
    app.add_middleware(
        APIKeyAuth, api_keys=config.api_keys, admin_keys=config.admin_api_keys, admin_paths=ADMIN_PATHS,
        open_paths=OPEN_PATHS | PLAYGROUND_PATHS,
    )  # fmt: skip
    if config.cors is not None:
        app.add_middleware(CORS, config=config.cors)
    app.add_middleware(StatusCounter, metrics=ctx.metrics, known_paths=ROUTES)
    return app
