"""LoRA adapters as the front end sees them: which `model` names are adapters, and loading and unloading
them at run time, with the engine's errors turned into serving's (which the HTTP layer maps to statuses).

Also owns where a run-time load may read: only under the server's LoRA root (--lora-root), checked after
every symlink and `..` is resolved, and without ever naming a server path back to the client.
"""

from __future__ import annotations

import os

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

    async def load_from_root(
        self, root: str | None, name: str, path: str, base_model_name: str | None = None
    ) -> LoraCard:
        """A client's load: `path` must lead to a directory under `root` (resolve_adapter_path)."""
        resolved = resolve_adapter_path(root, path)
        try:
            return await self.load(name, resolved, base_model_name)
        except InvalidRequestError as e:
            # The runner's messages name the directory it read; the client gets back the path it sent.
            raise InvalidRequestError(str(e).replace(resolved, path), e.param) from e

    async def unload(self, name: str) -> LoraCard:
        try:
            return await self.engine.unload_lora(name)
        except UnknownLoraError as e:
            raise ModelNotFoundError(str(e), "lora_name") from e
        except LoraConflictError as e:
            raise ConflictError(str(e)) from e


def resolve_adapter_path(root: str | None, path: str) -> str:
    """The real directory a client's `path` (absolute, or relative to `root`) names; InvalidRequestError
    (param lora_path) unless it and every entry in it resolve to somewhere under `root`. None: no root, so
    no run-time loads. Messages name no server path (not even the root), so a refusal reveals nothing about
    the file system beyond the path the client sent."""
    if root is None:
        raise InvalidRequestError(
            "loading LoRA adapters at run time is off: the server was started without --lora-root",
            "lora_path",
        )
    try:
        real_root = os.path.realpath(root)
        resolved = os.path.realpath(os.path.join(real_root, path))
        is_inside = _is_under(resolved, real_root)
        is_directory = is_inside and os.path.isdir(resolved)
        # NOTE: the adapter's files are checked too: one linked from elsewhere would be read from outside.
        is_inside = is_inside and not (is_directory and _links_outside(resolved, real_root))
    except (OSError, ValueError):  # a NUL byte, a name too long, a directory it may not list
        raise InvalidRequestError("lora_path cannot be read as an adapter directory", "lora_path") from None
    if not is_inside:
        raise InvalidRequestError(
            "lora_path leads outside the LoRA root; adapters load only from under --lora-root", "lora_path"
        )
    if not is_directory:
        raise InvalidRequestError("lora_path: there is no adapter directory at that path", "lora_path")
    return resolved


def _links_outside(directory: str, root: str) -> bool:
    with os.scandir(directory) as entries:
        return any(not _is_under(os.path.realpath(entry.path), root) for entry in entries)


def _is_under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root
