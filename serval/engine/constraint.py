"""TokenConstraint: the engine's contract for a per-request rule on which token may come next.

`serving` builds one per engine request (a compiled grammar's matcher, a thinking budget that forces the end
of the reasoning) and hands it over with the request; the engine keeps it with the Request, asks it for the
allowed tokens whenever the request samples, and tells it every token sampled. The engine never looks inside.

What must hold: `accept_token` is called exactly once per sampled token, in order. A preempted request
recomputes its KV cache from tokens it already has, and recomputing samples nothing, so the constraint is
never advanced twice for the same token.

Speculative decoding shows a constraint draft tokens that may then be rejected: `rollback` takes back the last
few accepted tokens, up to a bounded window (MAX_ROLLBACK_TOKENS unless the implementation is told another),
and leaves the constraint exactly as it was before them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# How many of its last accepted tokens a constraint can take back: more than a speculative step's drafts,
# which are all it ever rolls back. Each implementation keeps that much history (a bounded cost per request).
MAX_ROLLBACK_TOKENS = 16


def check_rollback(num_tokens: int, num_kept: int, max_rollback_tokens: int) -> None:
    """ValueError unless the last `num_tokens` accepted tokens can be taken back: num_kept is how many the
    constraint remembers (those accepted, up to its window of max_rollback_tokens)."""
    if num_tokens < 0:
        raise ValueError(f"cannot roll back a negative number of tokens ({num_tokens})")
    if num_tokens > max_rollback_tokens:
        raise ValueError(
            f"cannot roll back {num_tokens} tokens: a constraint takes back at most the last "
            f"{max_rollback_tokens} (max_rollback_tokens)"
        )
    if num_tokens > num_kept:
        raise ValueError(f"cannot roll back {num_tokens} tokens: only {num_kept} were accepted")


class TokenConstraint(Protocol):
    def allowed_token_bitmask(self) -> torch.Tensor | None:
        """The tokens allowed next as a packed bitmask: (ceil(vocab_size / 32),) int32, bit j of word i
        allows token 32 * i + j (xgrammar's layout). None: every token is allowed this step (free text).

        The tensor may be reused by the next call: the runner consumes it within the step."""
        ...

    def accept_token(self, token_id: int) -> None:
        """Advance past a token that was sampled for the request."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens (rejected speculative drafts): afterwards the
        constraint allows, and is finished, exactly as it was before them. ValueError (and nothing changed)
        for more than it accepted or more than its window (see check_rollback)."""
        ...

    @property
    def is_finished(self) -> bool:
        """True once the constraint admits nothing more: the request ends with finish_reason "stop"."""
        ...
