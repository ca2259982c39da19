"""TokenConstraint: the engine's contract for a per-request rule on which token may come next.

`serving` builds one per engine request (a compiled grammar's matcher, a thinking budget that forces the end
of the reasoning) and hands it over with the request; the engine keeps it with the Request, asks it for the
allowed tokens whenever the request samples, and tells it every token sampled. The engine never looks inside.

What must hold: `accept_token` is called exactly once per sampled token, in order. A preempted request
recomputes its KV cache from tokens it already has, and recomputing samples nothing, so the constraint is
never advanced twice for the same token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class TokenConstraint(Protocol):
    def allowed_token_bitmask(self) -> torch.Tensor | None:
        """The tokens allowed next as a packed bitmask: (ceil(vocab_size / 32),) int32, bit j of word i
        allows token 32 * i + j (xgrammar's layout). None: every token is allowed this step (free text).

        The tensor may be reused by the next call: the runner consumes it within the step."""
        ...

    def accept_token(self, token_id: int) -> None:
        """Advance past a token that was sampled for the request."""
        ...

    @property
    def is_finished(self) -> bool:
        """True once the constraint admits nothing more: the request ends with finish_reason "stop"."""
        ...
