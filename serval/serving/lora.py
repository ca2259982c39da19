"""LoRA adapters as the front end sees them: which `model` names are adapters, and loading and unloading
them at run time, with the engine's errors turned into serving's (which the HTTP layer maps to statuses).
"""

from __future__ import annotations

from serval.engine.client import EngineClient
from serval.engine.lora import LoraCard, LoraConflictError, LoraError, UnknownLoraError
from serval.serving.errors import ConflictError, InvalidRequestError, ModelNotFoundError


class LoraAdapters:
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def cards(self) -> list[LoraCard]:
        return sorted(self.engine.loras.values(), key=lambda card: card.name)

    def __contains__(self, name: str) -> bool:
        return name in self.engine.loras

    def get(self, name: str) -> LoraCard | None:
        return self.engine.loras.get(name)

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoraCard:
        try:
            return await self.engine.load_lora(name, path, base_model_name)
        except LoraConflictError as e:
            raise ConflictError(str(e)) from e
        except LoraError as e:
            raise InvalidRequestError(str(e)) from e

    async def unload(self, name: str) -> LoraCard:
        try:
            return await self.engine.unload_lora(name)
        except UnknownLoraError as e:
            raise ModelNotFoundError(str(e), "lora_name") from e
        except LoraConflictError as e:
            raise ConflictError(str(e)) from e
