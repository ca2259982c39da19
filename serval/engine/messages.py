"""What crosses the seam between the event loop and the engine thread (engine/client.py), as typed values.

Commands go in on one queue, the engine thread dispatches them by type; per request, events come back on
that request's own queue (a `RequestOutput` delta, or one `RequestFailed`); and after every step and every
batch of commands the engine thread publishes an `EngineStats` snapshot, the only engine state the event
loop reads. Plain values only, except the futures LoRA and Embed commands answer on.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from serval.engine.constraint import TokenConstraint
from serval.engine.lora import UnknownLoraError
from serval.runner.lora import LoraAdapter
from serval.runner.media import MediaInput
from serval.sampling import SamplingParams


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine has stopped, or a step failed and took the requests in flight with it."""


@dataclass(frozen=True)
class NewRequest:
    """One engine request to add: what `Engine.add_request` takes, as one value (filled by serving)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    constraint: TokenConstraint | None = None  # serving's grammar matcher, one per request
    num_pinned_prompt_tokens: int = 0  # leading prompt tokens to pin in the explicit cache
    # Another request of the same add_requests call with the same prompt (n / best_of) whose prompt blocks
    # this one forks instead of computing them again.
    share_prompt_with: str | None = None
    lora_name: str | None = None  # a loaded LoRA adapter; None: the base model
    # The prompt's media items, as the served model's MediaProcessor prepared them for its encoder; their
    # runs of placeholder ids are in prompt_token_ids already (serving/media/processor.py).
    media: tuple[MediaInput, ...] = ()


# ---- commands: event loop -> engine thread, handled in the order sent, between steps


@dataclass(frozen=True)
class AddRequests:
    """Every sequence of one API request: added together, or (one refused) none of them."""

    requests: tuple[NewRequest, ...]


@dataclass(frozen=True)
class AbortRequest:
    """Finish a request and free its blocks; an id the engine doesn't hold (finished already) is ignored."""

    request_id: str


@dataclass(frozen=True)
class LoadLora:
    name: str
    adapter: LoraAdapter  # read and checked off the engine thread (runner.read_lora); copied into a slot here
    base_model_name: str | None
    reply: asyncio.Future  # settled on its own loop with the LoraCard, or a LoraError


@dataclass(frozen=True)
class UnloadLora:
    name: str
    reply: asyncio.Future  # settled on its own loop with the LoraCard, or a LoraError


def answer(reply: asyncio.Future, result: object, error: Exception | None) -> None:
    """Settle a LoRA or Embed command's reply from the engine thread, on the loop that awaits it."""

    def settle() -> None:
        if reply.done():
            return  # the caller went away
        if error is not None:
            reply.set_exception(error)
        else:
            reply.set_result(result)

    try:
        reply.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: nobody is waiting any more


@dataclass(frozen=True)
class Embed:
    """An embedding model's prompts to embed now, between steps (engine/embedding.py)."""

    prompts: tuple[list[int], ...]
    reply: asyncio.Future  # settled on its own loop with one vector per prompt, or a ValueError


@dataclass(frozen=True)
class Flush:
    """Answered (with None) once every command sent before it is handled: a synchronous caller's aborts are
    done when it returns (the offline LLM)."""

    reply: asyncio.Future


@dataclass(frozen=True)
class Stop:
    """The last command: the requests in flight fail with EngineDeadError and the engine thread ends."""


Command = AddRequests | AbortRequest | LoadLora | UnloadLora | Embed | Flush | Stop


# ---- events: engine thread -> one request's stream (besides engine/outputs.py's RequestOutput)


class FailureKind(enum.Enum):
    INVALID = "invalid"  # the engine refused the request as asked (a check add_requests can't make)
    UNKNOWN_LORA = "unknown_lora"  # its adapter was unloaded before the engine thread added it
    ENGINE_DEAD = "engine_dead"  # a step failed, or the engine stopped, with the request in flight
    # The waiting queue had no room: raised by add_requests in one process, but an event when the engine runs
    # in another (a replica, serval/cluster/), whose admission happens there.
    QUEUE_FULL = "queue_full"


@dataclass(frozen=True)
class RequestFailed:
    """The request's last event: it produced no more output. Its reader raises `error()`."""

    request_id: str
    message: str
    kind: FailureKind

    def error(self) -> Exception:
        """What the reader raises: the error add_requests raises for the same cause, so callers handle a
        refusal the same way whichever side of the seam made it."""
        match self.kind:
            case FailureKind.INVALID:
                return ValueError(self.message)
            case FailureKind.UNKNOWN_LORA:
                return UnknownLoraError(self.message)
            case FailureKind.QUEUE_FULL:
                return QueueFullError(self.message)
            case FailureKind.ENGINE_DEAD:
                return EngineDeadError(self.message)


# ---- the snapshot: engine thread -> event loop


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters after one step or batch of commands. Built on the engine thread and swapped in
    whole, so a reader on another thread never sees one half-updated (or mid-step) engine."""

    num_running: int
    num_waiting: int  # the scheduler's queue and parked n / best_of followers (EngineClient adds the sent)
    num_free_blocks: int
    num_total_blocks: int
    num_prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int  # of those, tokens found
    num_steps: int
    num_preemptions: int
    num_generated_tokens: int
    num_pinned_blocks: int = 0  # blocks held by explicit-cache pins (cache_control)
    num_refused_pin_blocks: int = 0  # blocks pins asked for past --max-pinned-kv-fraction, left unpinned
    # Speculative decoding (engine/speculation/speculator.py's counters); an empty per-position tuple: off.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks
