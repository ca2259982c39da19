"""Request: one sequence's state inside the engine, a few counters plus its KV block ids, and what the
batched sampler needs of it each step (`sampling_row`).

`num_computed_tokens` catches up with `num_tokens` (prompt + outputs); there are no prefill or decode phases.
Preemption resets it to zero and the request recomputes its whole context later.
"""

from __future__ import annotations

import dataclasses
import enum
import time

import torch

from serval.engine.constraint import TokenConstraint
from serval.engine.lora import LoraCard
from serval.engine.outputs import StepTiming
from serval.runner.batch import SamplingRow
from serval.runner.media import MediaInput, MediaPrompt
from serval.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        arrival_time: float | None = None,
        constraint: TokenConstraint | None = None,
        lora: LoraCard | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt then outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first scheduled
        # Explicit caching: leading prompt tokens still to pin once computed (zeroed when pinned), and the
        # tokens that pinning newly wrote into the explicit cache.
        self.num_pinned_prompt_tokens = 0
        self.num_newly_pinned_tokens = 0
        self.block_ids: list[int] = []
        self.fixed_sampling_row: SamplingRow | None = None  # sampling_row()'s per-request part, built once
        # Where the request's row of the engine's batch rows (batch_rows.py) sits, and the first index of
        # block_ids the row does not hold yet (None: it holds them all). The block manager lowers the index
        # whenever it changes the list; the rows catch up before the next step.
        self.batch_row: int | None = None
        self.block_ids_changed_from: int | None = 0
        self.block_hashes: list[bytes] = []  # hash chain of this request's full blocks, in order
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None
        self.generator: torch.Generator | None = None
        # Serving's rule on the next token (a grammar's matcher); advanced once per sampled token, in _update.
        self.constraint = constraint
        # Sequences of the same prompt (n / best_of) that wait to fork this request's prompt blocks once
        # they are computed, instead of computing the prompt again.
        self.followers: list[Request] = []
        # Set on the sequences of a beam search: the group that picks their next tokens (engine/beam_search.py).
        self.beam_group = None
        self.lora = lora  # the LoRA adapter it runs with; None: the base model
        # Speculative decoding (engine/speculation/): the tokens proposed to follow token_ids, computed with
        # its next token this step and kept as far as the model agrees; not part of token_ids until then. For a
        # constrained request, the grammar's mask before each draft and after the last (len(drafts) + 1).
        self.draft_token_ids: list[int] = []
        self.draft_bitmasks: list[torch.Tensor | None] = []
        # Its prompt's media items (by offset) and the runner's state of them (ModelRunner.prepare_media),
        # dropped when the request finishes; the items' content hashes key the blocks their rows are in.
        self.media: tuple[MediaInput, ...] = ()
        self.media_prompt: MediaPrompt | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)
        now = time.monotonic() if arrival_time is None else arrival_time
        self.timing = RequestTiming(arrival_time=now)
        self.last_token_time = now  # when the previous token was produced (or arrival)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def block_hash_seed(self) -> bytes:
        """The parent hash of its first block: the adapter's identity, so caches never mix across them."""
        return b"" if self.lora is None else self.lora.block_hash_seed

    def block_media_key(self, block_index: int, block_size: int) -> bytes:
        """The content hashes of the media items with a row in the block (b"" for none): part of its name."""
        start, end = block_index * block_size, (block_index + 1) * block_size
        return b"".join(item.content_hash for item in self.media if item.offset < end and start < item.end)

    @property
    def wants_pin(self) -> bool:
        return 0 < self.num_pinned_prompt_tokens <= self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def num_tokens_with_drafts(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids)

    def keep_drafts(self, num_new_tokens: int) -> None:
        """The step computes only num_new_tokens of its tokens (the token budget ran short): drafts past them
        are dropped, so that the step's last token is still one the sampler follows."""
        num_kept = max(0, num_new_tokens - (self.num_tokens - self.num_computed_tokens))
        if num_kept < len(self.draft_token_ids):
            del self.draft_token_ids[num_kept:]
            del self.draft_bitmasks[num_kept + 1 :]

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_bitmasks = []

    def rollback_tokens(self, num_tokens: int) -> None:
        """Drop the last `num_tokens` output tokens (rejected speculative drafts). Those computed must have
        been forgotten first (BlockManager.rollback): no computed token may lie past the context. Its
        constraint is the caller's to roll back (TokenConstraint.rollback): the drafts may not all have
        been shown to it."""
        if not 0 <= num_tokens <= self.num_output_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of {self.num_output_tokens} output tokens"
            )
        if self.num_computed_tokens > self.num_tokens - num_tokens:
            raise ValueError(
                "the tokens to drop are still computed: roll back the KV cache first (BlockManager.rollback)"
            )
        del self.token_ids[self.num_tokens - num_tokens :]

    def check_stop(self, max_model_len: int) -> bool:
        """Decide after a new token whether the request is done; sets finish_reason."""
        last = self.token_ids[-1]
        under_min = self.num_output_tokens <= self.params.min_tokens
        is_eos = not self.params.ignore_eos and last in self.eos_token_ids
        if not under_min and (is_eos or last in self.stop_token_ids):
            self.finish_reason, self.stop_token_id = "stop", last
        elif self.constraint is not None and self.constraint.is_finished:
            self.finish_reason = "stop"  # the grammar is complete: nothing more may follow
        elif self.num_tokens >= max_model_len or (
            self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens
        ):
            self.finish_reason = "length"
        return self.finish_reason is not None


def sampling_row(request: Request) -> SamplingRow:
    """What the batched sampler needs of a request for this step (runner/sampler.py).

    Most of it is fixed for the request's life: built once and handed over again each step (the runner only
    reads rows); what changes per token (the outputs for penalties, bans under min_tokens, a grammar's
    mask) is laid over it only for the requests that use it."""
    if request.beam_group is not None:
        # A beam needs its most likely continuations under the raw distribution, nothing sampled.
        num_logprobs = max(request.beam_group.num_candidates, request.params.logprobs or 0)
        return SamplingRow(num_logprobs=num_logprobs)  # greedy, every other transform off
    bitmask = None if request.constraint is None else request.constraint.allowed_token_bitmask()
    return _row_after(request, [], bitmask)


def draft_sampling_rows(request: Request) -> list[SamplingRow]:
    """A speculating request's rows: row j picks the token after its j-th draft (row 0 the token after its
    context), each exactly as plain decoding would once the drafts before it were its outputs."""
    return [
        _row_after(request, request.draft_token_ids[:j], bitmask)
        for j, bitmask in enumerate(request.draft_bitmasks or [None] * (len(request.draft_token_ids) + 1))
    ]


def _row_after(request: Request, drafts: list[int], bitmask: torch.Tensor | None) -> SamplingRow:
    """The request's row for the token after its outputs and then `drafts` (none: its next token)."""
    p = request.params
    if request.fixed_sampling_row is None:
        request.fixed_sampling_row = _fixed_sampling_row(request)
    changes = {}
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        changes["output_token_ids"] = request.output_token_ids + drafts
    if request.num_output_tokens + len(drafts) < p.min_tokens:
        eos = frozenset() if p.ignore_eos else request.eos_token_ids
        changes["banned_token_ids"] = sorted(request.stop_token_ids | eos)
    if bitmask is not None:
        changes["allowed_token_bitmask"] = bitmask
    return (
        dataclasses.replace(request.fixed_sampling_row, **changes) if changes else request.fixed_sampling_row
    )


def _fixed_sampling_row(request: Request) -> SamplingRow:
    p = request.params
    return SamplingRow(
        temperature=p.temperature if not p.is_greedy else 0.0,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        num_logprobs=p.logprobs,
        generator=request.generator,
        prompt_token_ids=request.prompt_token_ids if p.repetition_penalty != 1.0 else [],
        logit_bias=list(p.logit_bias),
    )


class RequestTiming:
    """The engine thread's own running timings of one request (or beam search). Nothing reads them but
    `take_step`, which hands the entries gathered since the previous output over as a frozen StepTiming."""

    def __init__(self, arrival_time: float) -> None:
        self.arrival_time = arrival_time  # time.monotonic() when the engine accepted the request
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.prefill_time_ms = 0.0  # wall time of the steps that computed the prompt
        # Per token made since the previous output (StepTiming says what each is); emptied by take_step.
        self.batch_sizes: list[int] = []
        self.queue_wait_us: list[int] = []
        self.decode_time_ms: list[float] = []

    def take_step(self) -> StepTiming:
        """The timings for the request's next output; the per-token entries leave with it."""
        step = StepTiming(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            prefill_time_ms=self.prefill_time_ms,
            batch_sizes=tuple(self.batch_sizes),
            queue_wait_us=tuple(self.queue_wait_us),
            decode_time_ms=tuple(self.decode_time_ms),
        )
        self.batch_sizes, self.queue_wait_us, self.decode_time_ms = [], [], []
        return step


def record_timing(request, batch_size: int, started: float, elapsed: float, now: float) -> None:
    """A token of `request` (or of a beam search: BeamSearchGroup has the same timing fields) was made by the
    step that started at `started` and took `elapsed` seconds, in a batch of `batch_size` sequences."""
    t = request.timing
    t.batch_sizes.append(batch_size)
    t.queue_wait_us.append(max(0, int((started - request.last_token_time) * 1e6)))
    if request.num_output_tokens == 0:
        t.first_token_time = now
    else:
        t.decode_time_ms.append(elapsed * 1000.0)
    request.last_token_time = now
