"""BeamSearches: the beam searches in flight, a collaborator beside the Engine (which runs their beams).

Owns the engine side of beam search: admitting a search (all its beams must fit the cache together), its live
beams as ordinary Requests in the scheduler, carrying out the plan `BeamSearchGroup.advance` makes once every
beam has reported (fork a beam that continues more than once, its blocks shared by reference; drop the rest),
aborting a search, and the one RequestOutput a search answers with at its end. The scores and the rules of
which beams live on are beam_search.py's; the step itself is engine.py's.
"""

from __future__ import annotations

from serval.engine.admission import PromptTooLongError
from serval.engine.beam_search import BeamSearchGroup
from serval.engine.block_manager import BlockManager
from serval.engine.lora import LoraCard
from serval.engine.outputs import RequestOutput
from serval.engine.request import Request, RequestStatus
from serval.engine.scheduler import Scheduler
from serval.sampling import SamplingParams


class BeamSearches:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.groups: dict[str, BeamSearchGroup] = {}  # by the search's request id

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        lora: LoraCard | None,
    ) -> Request:
        """Start a search: its first beam (the prompt alone) is scheduled; PromptTooLongError if its beams
        could not all fit the cache at once."""
        max_new_tokens = self.max_model_len - len(prompt)
        if params.max_tokens is not None:
            max_new_tokens = min(max_new_tokens, params.max_tokens)
        # A group advances only when all its beams are computed at once, so all must fit together even
        # unshared (after preemption a beam may recompute into blocks of its own); else it could never finish.
        block_size = self.block_manager.block_size
        needed = params.beam_width * -(-(len(prompt) + max_new_tokens) // block_size)
        usable = self.max_model_len // block_size
        if needed > usable:
            raise PromptTooLongError(
                f"beam search with {params.beam_width} beams of up to {len(prompt) + max_new_tokens} tokens "
                f"needs {needed} KV blocks; the cache has {usable}: use fewer beams or a smaller max_tokens"
            )
        group = BeamSearchGroup(request_id, params, eos_token_ids, len(prompt), max_new_tokens)
        root = Request(group.next_beam_id(), prompt, params, eos_token_ids, lora=lora)
        group.add_root(root)
        self.groups[request_id] = group
        self.scheduler.add(root)
        return root

    def abort(self, request_id: str) -> RequestOutput:
        """End the search now: its beams' blocks are freed, and it answers with no beams."""
        group = self.groups.pop(request_id)
        for beam in group.running:
            self.scheduler.finish(beam)
        return _output(group, "abort")

    def num_using(self, card: LoraCard) -> int:
        """How many searches run with the adapter."""
        return sum(1 for group in self.groups.values() if group.root.lora is card)

    def advance(self, group: BeamSearchGroup) -> RequestOutput | None:
        """Every beam of the group has reported: carry out its choice (fork beams that continue more than
        once, drop the rest); the search's output once it is done, else None."""
        plan = group.advance()
        if plan.done:
            for beam, _ in plan.continuations:
                self.scheduler.finish(beam)  # finish() of a beam already finished is a no-op
            for beam in plan.dropped:
                self.scheduler.finish(beam)
            del self.groups[group.request_id]
            return _output(group, None)
        for beam in plan.dropped:
            self.scheduler.finish(beam)
        beams, parents = [], set()
        for parent, _ in plan.continuations:
            beams.append(self._fork(group, parent) if parent.request_id in parents else parent)
            parents.add(parent.request_id)
        for beam, (_, token_id) in zip(beams, plan.continuations):
            beam.append_token(token_id)  # after every fork: a fork copies its parent's context as it was
        group.adopt(beams)
        return None

    def _fork(self, group: BeamSearchGroup, parent: Request) -> Request:
        child = Request(
            group.next_beam_id(),
            parent.prompt_token_ids,
            parent.params,
            tuple(parent.eos_token_ids),
            lora=parent.lora,  # its blocks and its hash chain are the adapter's
        )
        child.token_ids = list(parent.token_ids)
        # The same prompt: the same items (block keys) and runner state (positions, encoder rows).
        child.media, child.media_prompt = parent.media, parent.media_prompt
        if parent.status == RequestStatus.RUNNING:
            self.block_manager.fork(parent, child, parent.num_computed_tokens)
            self.scheduler.add_running(child)
        else:
            self.scheduler.add(child)  # the parent was preempted: the fork computes its context anew
        return child


def _output(group: BeamSearchGroup, finish_reason: str | None) -> RequestOutput:
    beams = group.results() if finish_reason is None else []
    return RequestOutput(
        request_id=group.request_id,
        new_token_ids=[],
        new_logprobs=None,
        num_prompt_tokens=group.num_prompt_tokens,
        num_cached_tokens=group.root.num_cached_tokens,
        num_output_tokens=sum(len(b.token_ids) for b in beams),
        finished=True,
        finish_reason=finish_reason or (beams[0].finish_reason if beams else "length"),
        timing=group.timing.take_step(),  # every token's entries: a search has this one output
        beams=beams,
    )
