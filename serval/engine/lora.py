"""The engine's table of loaded LoRA adapters: name -> slot, and the errors of loading and unloading one.

Owns which adapter holds which runner slot and each load's identity for the prefix cache. The weights live in
the runner (runner/lora.py); a request carries its adapter's LoraCard. Only the engine thread changes this;
the event loop reads a copy the engine thread publishes (EngineClient.loras).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass


class LoraError(ValueError):
    """An adapter can't be loaded or used as asked (bad files, bad name, LoRA not enabled): a 400."""


class UnknownLoraError(LoraError):
    """No adapter of that name is loaded: a 404."""


class LoraConflictError(LoraError):
    """The request conflicts with the server's state (every slot is taken, the adapter is in use): a 409."""


@dataclass(frozen=True)
class LoraCard:
    """One loaded adapter, as requests and /v1/models see it."""

    name: str
    path: str
    base_model_name: str | None  # the parent it was declared for; None: the served model
    slot: int  # the runner slot holding its weights
    # Seeds the hash chain of its requests' KV blocks (instead of b""), so the prefix cache never shares
    # blocks between adapters, or with the base model, or with an earlier load of the same name.
    block_hash_seed: bytes


class LoraRegistry:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras  # 0: LoRA is not enabled
        self.cards: dict[str, LoraCard] = {}
        self.num_loads = 0  # every load gets a new hash seed, even of a name loaded before

    def get(self, name: str) -> LoraCard:
        card = self.cards.get(name)
        if card is None:
            raise UnknownLoraError(f"the LoRA adapter {name!r} is not loaded")
        return card

    def check_can_add(self, name: str) -> None:
        check_can_add(self.cards, self.max_loras, name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoraCard:
        self.check_can_add(name)
        used = {card.slot for card in self.cards.values()}
        slot = min(s for s in range(self.max_loras) if s not in used)
        self.num_loads += 1
        seed = hashlib.blake2b(f"lora\0{name}\0{self.num_loads}".encode(), digest_size=16).digest()
        card = LoraCard(name, path, base_model_name, slot, seed)
        self.cards[name] = card
        return card

    def remove(self, name: str) -> LoraCard:
        return self.cards.pop(self.get(name).name)


def check_can_add(cards: Mapping[str, LoraCard], max_loras: int, name: str) -> None:
    """LoraError unless an adapter named `name` may join `cards`. A function of the table, so the event loop
    checks its published copy (EngineClient.loras) before reading files; the engine thread checks again."""
    if max_loras == 0:
        raise LoraError("LoRA is not enabled: start the server with --enable-lora or --lora-modules")
    if not name:
        raise LoraError("the adapter's name must not be empty")
    if name in cards:
        raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
    if len(cards) >= max_loras:
        raise LoraConflictError(
            f"all {max_loras} LoRA slots are taken (--max-loras): unload an adapter first"
        )
