"""Test doubles for serving: a byte tokenizer (one token per UTF-8 byte, so every multi-byte character is split
across tokens) with two ChatML special tokens."""

from __future__ import annotations

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")


class ByteTokenizer:
    vocab_size = 256 + len(SPECIAL_TOKENS)
    bos_token_id = None
    bos_token = None
    eos_token = "<|im_end|>"
    eos_token_ids = (257,)
    special_token_ids = frozenset({256, 257})
    special_token_texts = frozenset(SPECIAL_TOKENS)
    add_bos_token = False
    chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )

    def encode_plain(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for j, special in enumerate(SPECIAL_TOKENS):
                if text.startswith(special, i):
                    ids.append(256 + j)
                    i += len(special)
                    break
            else:
                ids.extend(text[i].encode("utf-8"))
                i += 1
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return SPECIAL_TOKENS[token_id - 256].encode() if token_id >= 256 else bytes([token_id])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(
            self.token_bytes(i) for i in ids if not (skip_special_tokens and i in self.special_token_ids)
        )
        return data.decode("utf-8", errors="replace")


class FakeEngine:
    """An EngineClient double: each request 'generates' the bytes of a scripted text, one token per step,
    then EOS; seeds pick the text, so n choices differ. Records aborted requests, and which LoRA adapter each
    request asked for; `load_lora` takes any existing directory as an adapter. encode: text -> the ids to
    generate (a real tokenizer's, so special tokens are generated as such); default one per UTF-8 byte.
    stall_after: a request generates that many tokens, then nothing until it is closed (so only a deadline or a
    shutdown's cut-off can end it)."""

    def __init__(
        self,
        texts: list[str],
        max_model_len: int = 256,
        delay: float = 0.0,
        encode=None,
        stall_after: int | None = None,
    ) -> None:
        self.texts = texts
        self.encode = encode or (lambda text: list(text.encode()))
        self.max_model_len = max_model_len
        self.delay = delay
        self.stall_after = stall_after
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.is_queue_full = False
        self.num_added = 0  # engine requests admitted
        self.loras: dict = {}  # name -> LoraCard, as EngineClient.loras
        self.max_loras = 2
        self.lora_names: dict[str, str | None] = {}  # request id -> the adapter it asked for
        from serval.engine.client import RunnerInfo

        # Every fact distinct from the others, so a label filled from the wrong field shows.
        self.runner_info = RunnerInfo(
            num_blocks=10, block_size=32, max_model_len=4096, vocab_size=258, dtype="bfloat16", device="cpu",
            architecture="FakeForCausalLM", weight_format="Q4_1+Q8_0", kernel_variant="avx2", num_threads=3,
            attention_backend="native-cpu",
            packed_weights=True, batch_activations="int8",
        )  # fmt: skip

    def add_requests(self, requests, shared_queue=None):
        """As EngineClient.add_requests: every request is checked before any is admitted; with shared_queue
        every request's outputs go there, else each stream is iterated on its own."""
        from serval.engine.client import QueueFullError
        from serval.engine.lora import UnknownLoraError

        for request in requests:
            if request.lora_name is not None and request.lora_name not in self.loras:
                raise UnknownLoraError(f"the LoRA adapter {request.lora_name!r} is not loaded")
            if len(request.prompt_token_ids) + (request.params.max_tokens or 1) > self.max_model_len:
                raise ValueError("the prompt does not fit")
        if self.is_queue_full:
            raise QueueFullError("1 requests are already waiting")
        self.num_added += len(requests)
        for request in requests:
            self.lora_names[request.request_id] = request.lora_name
        streams = [FakeStream(self, request) for request in requests]
        if shared_queue is not None:
            for stream in streams:
                stream.feed(shared_queue)
        return streams

    async def load_lora(self, name, path, base_model_name=None):
        import os

        from serval.engine.lora import LoraCard, LoraConflictError, LoraError

        if name in self.loras:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
        if len(self.loras) >= self.max_loras:
            raise LoraConflictError("all LoRA slots are taken")
        if not os.path.isdir(path):
            raise LoraError(f"{path} is not a PEFT adapter")
        card = LoraCard(name, path, base_model_name, len(self.loras), name.encode())
        self.loras = {**self.loras, name: card}
        return card

    async def unload_lora(self, name):
        from serval.engine.lora import UnknownLoraError

        if name not in self.loras:
            raise UnknownLoraError(f"the LoRA adapter {name!r} is not loaded")
        self.loras = {k: v for k, v in self.loras.items() if k != name}

    def health(self):
        return {"status": "ok"}

    def stats(self):
        from serval.engine.client import EngineStats

        return EngineStats(0, 0, 10, 10, 0, 0, 0, 0, 0)


class FakeStream:
    """A RequestStream double: the scripted outputs of one request; close() before the end records an abort."""

    def __init__(self, engine: FakeEngine, request) -> None:
        self.engine = engine
        self.request = request
        self.request_id = request.request_id
        self.is_finished = False
        self.is_closed = False
        self.task = None

    def feed(self, queue) -> None:
        """Put this request's outputs on `queue` from a task of its own, as the engine thread would."""
        import asyncio

        async def run():
            async for output in self:
                queue.put_nowait(output)

        self.task = asyncio.get_running_loop().create_task(run())

    def note(self, event) -> None:
        self.is_finished = self.is_finished or event.finished

    async def __aiter__(self):
        import asyncio
        import math

        from serval.engine.outputs import RequestOutput, StepTiming, TokenLogprob

        request, engine = self.request, self.engine
        params, eos_token_ids = request.params, request.eos_token_ids
        text = engine.texts[(params.seed or 0) % len(engine.texts)]
        all_ids = engine.encode(text)
        ids = all_ids[: params.max_tokens] if params.max_tokens else list(all_ids)
        stops = not params.max_tokens or len(all_ids) < params.max_tokens
        if stops:
            ids.append(eos_token_ids[0])
        try:
            for step, token_id in enumerate(ids):
                if step == engine.stall_after:
                    await asyncio.Event().wait()  # never set: closing the stream cancels the task feeding it
                await asyncio.sleep(engine.delay)
                last = step == len(ids) - 1
                logprob = -0.1 * ((params.seed or 0) + 1)
                logprobs = None
                if params.logprobs is not None:
                    top = [(token_id, logprob), (0, math.log(0.01))][: params.logprobs]
                    logprobs = [TokenLogprob(token_id, logprob, top)]
                self.is_finished = last
                yield RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[token_id],
                    new_logprobs=logprobs,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=0,
                    num_output_tokens=step + 1,
                    finished=last,
                    finish_reason=("stop" if stops else "length") if last else None,
                    stop_token_id=eos_token_ids[0] if last and stops else None,
                    timing=StepTiming(
                        arrival_time=0.0,
                        first_scheduled_time=None,
                        first_token_time=None,
                        prefill_time_ms=0.0,
                        batch_sizes=(1,),
                        queue_wait_us=(10,),
                    ),
                )
            engine.finished.append(request.request_id)
        finally:
            self.close()

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            if self.task is not None:
                self.task.cancel()
            if not self.is_finished:
                self.engine.aborted.append(self.request.request_id)
