"""Engine: token ids in, token-id deltas out. One `step()` = schedule, run the model, update requests.

Single-threaded by design; `client.py` runs it on its own thread (for the server and the offline LLM alike).
Beam searches run their beams here as ordinary requests; which beams live on is beam_searches.py's to carry
out. The admission rules that need no engine state are admission.py's, run by the caller before adding.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from serval.config import EngineConfig
from serval.engine.beam_search import BeamSearchGroup
from serval.engine.beam_searches import BeamSearches
from serval.engine.block_manager import BlockManager
from serval.engine.constraint import TokenConstraint
from serval.engine.embedding import embed_prompts
from serval.engine.lora import LoraCard, LoraConflictError, LoraError, LoraRegistry
from serval.engine.outputs import RequestOutput, TokenLogprob
from serval.engine.request import Request, draft_sampling_rows, record_timing, sampling_row
from serval.engine.scheduler import Scheduler, SchedulerOutput
from serval.engine.speculation.proposers import make_speculator
from serval.model_source import ModelSource, resolve_model
from serval.runner.batch import Batch, SamplerOutput, SamplingRow
from serval.runner.lora import LoraAdapter
from serval.runner.media import MediaInput, MediaPrompt
from serval.runner.parallel.runner import make_runner
from serval.sampling import SamplingParams


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        # clock: what pin expiry is measured against; tests pass a fake one to skip five minutes.
        self.config = config
        self.source = source or resolve_model(config.model.model)
        self.runner = make_runner(config.model, config.cache, self.source, config.lora, config.parallel)
        info = self.runner.info
        cache = config.cache
        max_num_pinned = (
            int(info.num_blocks * cache.max_pinned_kv_fraction) if cache.enable_prefix_caching else 0
        )
        # A request can never hold more tokens than the cache leaves unpinned, whatever the model's context:
        # so a lone request always fits, however many blocks explicit caching holds.
        self.max_model_len = min(info.max_model_len, (info.num_blocks - max_num_pinned) * info.block_size)
        self.block_manager = BlockManager(
            info.num_blocks, info.block_size, cache.enable_prefix_caching, max_num_pinned, clock
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.requests: dict[str, Request] = {}
        # Beam searches run their beams as ordinary requests; which beams live on is theirs to say.
        self.beams = BeamSearches(self.scheduler, self.block_manager, self.max_model_len)
        # Speculative decoding (engine/speculation/); None: a token a step.
        self.speculator = make_speculator(config, self.max_model_len, info.vocab_size)
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        # n / best_of sequences parked on their leader until its prompt is computed: waiting, though not in
        # the scheduler's queue (num_waiting counts them, so the queue limit does).
        self.num_parked_followers = 0
        self.loras = LoraRegistry(info.max_loras)
        for module in config.lora.lora_modules:
            try:
                adapter = self.runner.read_lora(module.path)
            except ValueError as e:
                raise LoraError(f"cannot load the LoRA adapter {module.name!r}: {e}") from e
            self.add_lora(module.name, adapter, module.base_model_name)

    # ---- requests in and out

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        constraint: TokenConstraint | None = None,
        num_pinned_prompt_tokens: int = 0,
        share_prompt_with: str | None = None,
        lora_name: str | None = None,
        media: tuple[MediaInput, ...] = (),
    ) -> None:
        """num_pinned_prompt_tokens: the leading prompt tokens to pin in the explicit cache once computed.
        share_prompt_with: a request with the same prompt (another of n / best_of sequences) whose prompt
        blocks this one forks once they are computed, instead of computing the prompt itself.
        lora_name: a loaded LoRA adapter to run with (UnknownLoraError if none is); None: the base model.
        media: the prompt's media items for a multimodal model's encoder (ValueError if it can't take
        them)."""
        if request_id in self.requests or request_id in self.beams.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not 0 <= num_pinned_prompt_tokens <= len(prompt_token_ids):
            raise ValueError("num_pinned_prompt_tokens must be between 0 and the prompt's length")
        vocab_size = self.runner.info.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if any(t >= vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        lora = None if lora_name is None else self.loras.get(lora_name)
        media_prompt = None
        if media:  # checked, and its positions computed, before anything is added
            max_num_tokens = min(
                self.max_model_len, len(prompt_token_ids) + (params.max_tokens or self.max_model_len)
            )
            media_prompt = self.runner.prepare_media(prompt_token_ids, media, max_num_tokens)
        if params.use_beam_search:
            if constraint is not None:
                raise ValueError("beam search can't follow a grammar (one constraint per beam is not kept)")
            root = self.beams.add(request_id, prompt_token_ids, params, eos_token_ids, lora)
            _attach_media(root, media_prompt)
            return
        request = Request(
            request_id, prompt_token_ids, params, eos_token_ids, constraint=constraint, lora=lora
        )
        _attach_media(request, media_prompt)
        request.num_pinned_prompt_tokens = num_pinned_prompt_tokens
        self.requests[request_id] = request
        leader = self.requests.get(share_prompt_with) if share_prompt_with else None
        if (
            leader is not None
            and leader.num_computed_tokens < leader.num_prompt_tokens
            and leader.prompt_token_ids == request.prompt_token_ids
        ):
            leader.followers.append(request)  # scheduled when the leader's prompt is computed
            self.num_parked_followers += 1
        else:
            self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id in self.beams.groups:
            return self.beams.abort(request_id)
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request)
        if self.speculator is not None:
            self.speculator.forget(request)
        self.num_parked_followers -= len(request.followers)
        for follower in request.followers:
            if follower.request_id in self.requests:  # not aborted meanwhile
                self.scheduler.add(follower)  # they compute the prompt themselves now
        request.followers = []
        request.finish_reason = "abort"
        return self._output(request, [], None)

    # ---- LoRA adapters (engine/lora.py); the weights go into runner slots

    def add_lora(self, name: str, adapter: LoraAdapter, base_model_name: str | None = None) -> LoraCard:
        """Load an adapter read by `runner.read_lora` (on any thread) into a free slot."""
        card = self.loras.add(name, adapter.path, base_model_name)
        self.runner.load_lora(card.slot, adapter)
        return card

    def remove_lora(self, name: str) -> LoraCard:
        """Unload an adapter. NOTE: refused while a request uses it (LoraConflictError) rather than
        finishing them first: an unload never cuts a generation short, and the caller decides when to retry."""
        card = self.loras.get(name)
        num_using = sum(1 for request in self.requests.values() if request.lora is card)
        num_using += self.beams.num_using(card)
        if num_using:
            raise LoraConflictError(
                f"the LoRA adapter {name!r} is in use by {num_using} request(s); retry once they finish"
            )
        self.runner.unload_lora(card.slot)
        return self.loras.remove(name)

    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """An embedding model's vectors of whole prompts, computed now (engine/embedding.py)."""
        return embed_prompts(
            self.block_manager, self.runner, prompts, self.config.scheduler.max_num_batched_tokens
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's queue and the followers parked on a leader."""
        return len(self.scheduler.waiting) + self.num_parked_followers

    # ---- the step

    def step(self) -> list[RequestOutput]:
        # Expired pins first, so this step's allocations may already evict their blocks.
        self.block_manager.release_expired_pins()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        self.num_steps += 1
        self.num_preemptions += len(scheduled.preempted)
        batch, samplers = self._build_batch(scheduled)
        started = time.monotonic()
        sampled = self.runner.execute(batch)
        elapsed = time.monotonic() - started
        return self._update(scheduled, samplers, sampled, started, elapsed)

    def _build_batch(self, scheduled: SchedulerOutput) -> tuple[Batch, list[tuple[Request, int]]]:
        """The step's batch, and the requests that sample in it, each with how many of the sampler's rows
        (in order) are its: one, or a speculating request's drafts + 1."""
        token_ids: list[int] = []
        num_new_tokens: list[int] = []
        num_computed_tokens: list[int] = []
        sequences: list[Request] = []  # the batch's sequences' requests (a speculating one's several times)
        sample_indices: list[int] = []
        rows: list[SamplingRow] = []
        samplers: list[tuple[Request, int]] = []
        for request, num_new, num_computed in zip(
            scheduled.requests, scheduled.num_new_tokens, scheduled.num_computed_tokens
        ):
            drafts = request.draft_token_ids
            if drafts:
                # Its next input and each draft as a decode sequence of its own, at consecutive positions
                # over the same blocks: every row's K/V is written before any row attends, so row j sees the
                # inputs before it, and the step stays a decode step (the fused path; the same bits as the
                # tokens decoded one a step, since a row's numbers do not depend on its batch).
                inputs = [request.token_ids[-1], *drafts]
                for j, token_id in enumerate(inputs):
                    sample_indices.append(len(sequences))
                    sequences.append(request)
                    token_ids.append(token_id)
                    num_new_tokens.append(1)
                    num_computed_tokens.append(num_computed + j)
                rows.extend(draft_sampling_rows(request))
                samplers.append((request, len(inputs)))
                continue
            token_ids.extend(request.token_ids[num_computed : num_computed + num_new])
            if num_computed + num_new == request.num_tokens:
                sample_indices.append(len(sequences))
                rows.append(sampling_row(request))
                samplers.append((request, 1))
            sequences.append(request)
            num_new_tokens.append(num_new)
            num_computed_tokens.append(num_computed)
        lora_slots = []
        if any(r.lora is not None for r in sequences):
            lora_slots = [-1 if r.lora is None else r.lora.slot for r in sequences]
        media = []
        if any(r.media_prompt is not None for r in sequences):
            media = [r.media_prompt for r in sequences]
        batch = Batch(
            token_ids=token_ids,
            num_new_tokens=num_new_tokens,
            num_computed_tokens=num_computed_tokens,
            block_tables=self.scheduler.rows.step_tables(sequences),
            sample_indices=sample_indices,
            sampling=rows,
            block_copies=self.block_manager.take_copies(),
            lora_slots=lora_slots,
            media=media,
        )
        return batch, samplers

    def _update(
        self,
        scheduled: SchedulerOutput,
        samplers: list[tuple[Request, int]],
        sampled: SamplerOutput,
        started: float,
        elapsed: float,
    ) -> list[RequestOutput]:
        now = time.monotonic()
        batch_size = len(scheduled.requests)
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens):
            request.num_computed_tokens += num_new
            # Drafts computed this step may yet be rejected: the blocks they are in stay unnamed until kept.
            self.block_manager.cache_full_blocks(request, len(request.draft_token_ids))
            if request.wants_pin:
                # Pinned once, as soon as the prefix is computed (a preempted request does not pin again).
                request.num_newly_pinned_tokens = self.block_manager.pin(
                    request, request.num_pinned_prompt_tokens
                )
                request.num_pinned_prompt_tokens = 0
            if request.followers and request.num_computed_tokens >= request.num_prompt_tokens:
                self._release_followers(request)
            if request.timing.first_scheduled_time is None:
                request.timing.first_scheduled_time = started
            if request.num_output_tokens == 0:
                request.timing.prefill_time_ms += elapsed * 1000.0
        outputs = []
        reported: dict[str, BeamSearchGroup] = {}
        end_row = 0
        for request, num_rows in samplers:
            first_row, end_row = end_row, end_row + num_rows
            if request.beam_group is not None:
                request.beam_group.report(request, sampled.top_logprobs[first_row])
                reported[request.beam_group.request_id] = request.beam_group
                continue
            if request.draft_token_ids:
                new_token_ids = self._settle_drafts(request, sampled.token_ids[first_row:end_row])
            else:
                new_token_ids = [sampled.token_ids[first_row]]
            outputs.append(
                self._emit(request, new_token_ids, sampled, first_row, (batch_size, started, elapsed, now))
            )
        for group in reported.values():
            if group.all_reported:
                record_timing(group, batch_size, started, elapsed, now)
                output = self.beams.advance(group)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _settle_drafts(self, request: Request, sampled_ids: list[int]) -> list[int]:
        """A speculating request's new tokens: the drafts its sampled rows confirm and the token sampled after
        the last of them. The rejected drafts' KV rows are forgotten (their blocks given back or unnamed)."""
        num_accepted = self.speculator.accepted_length(request, sampled_ids)
        self.block_manager.rollback(request, len(request.draft_token_ids) - num_accepted)
        request.clear_drafts()
        return sampled_ids[: num_accepted + 1]

    def _emit(
        self, request: Request, new_token_ids: list[int], sampled: SamplerOutput, first_row: int, step: tuple
    ) -> RequestOutput:
        """Append a request's new tokens (row first_row on of the sampler's output) up to a stop, and report
        them. Tokens after the one that finishes it (accepted drafts past a stop) are dropped."""
        batch_size, started, elapsed, now = step
        wants_logprobs = sampled.logprobs is not None and request.params.logprobs is not None
        logprobs = [] if wants_logprobs else None
        emitted = 0
        for row, token_id in enumerate(new_token_ids, start=first_row):
            # A step's tokens share its time: each is charged an equal part of it.
            record_timing(request, batch_size, started, elapsed / len(new_token_ids), now)
            request.append_token(token_id)
            if request.constraint is not None:
                # NOTE: only here, for a freshly sampled token: recomputing after preemption samples nothing.
                request.constraint.accept_token(token_id)
            self.num_generated_tokens += 1
            emitted += 1
            if wants_logprobs:
                logprobs.append(TokenLogprob(token_id, sampled.logprobs[row], sampled.top_logprobs[row]))
            if request.check_stop(self.max_model_len):
                break
        if request.finish_reason is not None:
            self._finish(request)
        elif emitted > 1:
            self.block_manager.cache_full_blocks(request)  # the blocks the kept drafts filled get their names
        return self._output(request, new_token_ids[:emitted], logprobs)

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        del self.requests[request.request_id]
        if self.speculator is not None:
            self.speculator.forget(request)

    def _release_followers(self, leader: Request) -> None:
        """The leader's prompt is computed: each follower takes its blocks by reference and recomputes only
        the last prompt token, which yields its own first logits (copy on write keeps the leader's block)."""
        max_num_seqs = self.config.scheduler.max_num_seqs
        self.num_parked_followers -= len(leader.followers)
        for follower in leader.followers:
            if follower.request_id not in self.requests:
                continue  # aborted meanwhile
            if len(self.scheduler.running) < max_num_seqs:
                self.block_manager.fork(leader, follower, leader.num_prompt_tokens - 1)
                self.scheduler.add_running(follower)
            else:
                self.scheduler.add(follower)  # no room in the batch: it queues, and finds the prefix cached
        leader.followers = []

    def _output(self, request: Request, new_token_ids: list[int], logprobs) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_newly_pinned_tokens=request.num_newly_pinned_tokens,
            num_output_tokens=request.num_output_tokens,
            finished=request.finish_reason is not None,
            finish_reason=request.finish_reason,
            stop_token_id=request.stop_token_id,
            timing=request.timing.take_step(),
        )


def _attach_media(request: Request, media_prompt: MediaPrompt | None) -> None:
    if media_prompt is not None:
        request.media = media_prompt.items
        request.media_prompt = media_prompt
