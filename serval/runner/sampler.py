"""The token sampler: every sampled sequence of a step in one batched pass over (num_rows, vocab) logits.

Order of operations follows vLLM, with OpenAI's logit_bias first: the bias is added to the model's logits and
logprobs are taken from the biased logits (what `logprobs` reports: as OpenAI's, they include the bias but no
penalty, temperature or truncation), then come penalties, bans, the allowed-token masks of constrained rows
(grammars), temperature, top-k, top-p, min-p, and the draw. The draw is a race of exponentials (argmax
p_i / E_i with E_i ~ Exp(1) is a sample from p), so a seeded row only needs its own vector of noise from its
own generator: its tokens don't depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from serval.runner.batch import SamplerOutput, SamplingRow


class Sampler:
    def __init__(self, generator: torch.Generator, argmax_rows=None):
        # Noise for rows without a seed; owned by the runner so runs are reproducible from ModelConfig.seed.
        self.generator = generator
        # Each row's argmax of (num_rows, vocab) fp32 logits on the CPU: kernels.argmax_rows (torch.argmax's
        # answer; 0.25 against 0.85 ms over a 64-row decode step's logits), where the runner has the kernels.
        self.argmax_rows = argmax_rows

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # logits: (num_rows, vocab_size) float32
        vocab_size = logits.shape[1]
        device = logits.device
        want_logprobs = any(r.num_logprobs is not None for r in rows)
        logits = _apply_logit_bias(logits, rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        logits = self._apply_penalties(logits, rows)
        logits = _apply_allowed_masks(self._apply_bans(logits, rows), logits, rows)

        greedy_ids = logits.argmax(dim=-1) if self.argmax_rows is None else self.argmax_rows(logits)
        # Decided from the rows on the host: on a GPU, a test of a device tensor would wait for the step.
        if all(r.temperature == 0.0 for r in rows):
            token_ids = greedy_ids
        else:
            temperature = torch.tensor([r.temperature for r in rows], device=device)
            is_greedy = temperature == 0.0
            scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
            scaled = _apply_top_k_top_p(scaled, rows)
            probs = torch.softmax(scaled, dim=-1)
            probs = _apply_min_p(probs, rows)
            noise = self._exponential_noise(rows, vocab_size, device)
            sampled_ids = (probs / noise).argmax(dim=-1)
            token_ids = torch.where(is_greedy, greedy_ids, sampled_ids)

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None, top_logprobs=None)
        return _with_logprobs(token_ids, raw_logprobs, rows)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        has_additive = any(r.presence_penalty or r.frequency_penalty for r in rows)
        has_repetition = any(r.repetition_penalty != 1.0 for r in rows)
        if not (has_additive or has_repetition):
            return logits
        vocab_size = logits.shape[1]
        device = logits.device
        # Counts of each vocabulary id among the outputs: (num_rows, vocab_size); padding goes to a spare column.
        output_counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)
        logits = logits.clone()
        if has_additive:
            presence = torch.tensor([r.presence_penalty for r in rows], device=device).unsqueeze(1)
            frequency = torch.tensor([r.frequency_penalty for r in rows], device=device).unsqueeze(1)
            logits -= frequency * output_counts + presence * (output_counts > 0)
        if has_repetition:
            prompt_counts = _token_counts([r.prompt_token_ids for r in rows], vocab_size, device)
            seen = (output_counts + prompt_counts) > 0
            penalty = torch.tensor([r.repetition_penalty for r in rows], device=device).unsqueeze(1)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        return logits

    def _apply_bans(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any(r.banned_token_ids for r in rows):
            return logits
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.banned_token_ids:
                logits[i, r.banned_token_ids] = float("-inf")
        return logits

    def _exponential_noise(self, rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor:
        noise = torch.empty(len(rows), vocab_size, device=device)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                # Request generators live on the CPU (the engine makes them, and knows no device): draw
                # there, so the stream of a seed is the same on every device, then move.
                noise[i] = torch.empty(vocab_size).exponential_(generator=r.generator).to(device)
        return noise


def _with_logprobs(
    token_ids: torch.Tensor, raw_logprobs: torch.Tensor, rows: list[SamplingRow]
) -> SamplerOutput:
    """The ids, each chosen token's logprob and each row's top k, read back in one transfer (on a GPU, one
    wait for the step, not three): as float64 columns, which hold the ids and the fp32 logprobs exactly."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # (num_rows, 1)
    max_k = max(r.num_logprobs or 0 for r in rows)
    columns = [token_ids.unsqueeze(1).double(), chosen.double()]
    if max_k > 0:
        top_vals, top_ids = raw_logprobs.topk(max_k, dim=-1)
        columns += [top_ids.double(), top_vals.double()]
    table = torch.cat(columns, dim=1).tolist()
    top = []
    for r, values in zip(rows, table):
        k = r.num_logprobs or 0
        top.append([(int(i), v) for i, v in zip(values[2 : 2 + k], values[2 + max_k : 2 + max_k + k])])
    return SamplerOutput(
        token_ids=[int(values[0]) for values in table],
        logprobs=[values[1] for values in table],
        top_logprobs=top,
    )


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's biases added to its logits, every row's in one scatter."""
    if not any(r.logit_bias for r in rows):
        return logits
    row_index = [i for i, r in enumerate(rows) for _ in r.logit_bias]
    token_ids = [token_id for r in rows for token_id, _ in r.logit_bias]
    biases = [bias for r in rows for _, bias in r.logit_bias]
    device = logits.device
    index = (torch.tensor(row_index, device=device), torch.tensor(token_ids, device=device))
    # Out of place: the caller's logits stay as the model produced them.
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def _apply_allowed_masks(
    logits: torch.Tensor, unbanned: torch.Tensor, rows: list[SamplingRow]
) -> torch.Tensor:
    """-inf outside each constrained row's bitmask. A grammar outranks a ban: where the bans (min_tokens)
    leave a constrained row no allowed token, the row keeps its grammar's tokens without the bans."""
    constrained = [i for i, r in enumerate(rows) if r.allowed_token_bitmask is not None]
    if not constrained:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    words = torch.stack([rows[i].allowed_token_bitmask for i in constrained]).to(device)  # (k, num_words)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # (k, num_words * 32)
    if bits.shape[1] < vocab_size:  # ids past the tokenizer's vocabulary are never allowed
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
    bits = bits[:, :vocab_size]
    index = torch.tensor(constrained, device=device)
    # Only the constrained rows are touched; a select, not `if dead.any()`: no wait for the device on a GPU.
    chosen = logits[index].masked_fill(~bits, float("-inf"))
    dead = torch.isinf(chosen).all(dim=-1) & bits.any(dim=-1)
    fallback = unbanned[index].masked_fill(~bits, float("-inf"))
    return logits.index_copy(0, index, torch.where(dead.unsqueeze(1), fallback, chosen))


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    max_len = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    padded = torch.full((len(token_lists), max_len), vocab_size, dtype=torch.long)
    for i, t in enumerate(token_lists):
        if t:
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    use_top_k = any(r.top_k > 0 for r in rows)
    use_top_p = any(r.top_p < 1.0 for r in rows)
    if not (use_top_k or use_top_p):
        return logits
    device = logits.device
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if use_top_k:
        k = torch.tensor([r.top_k if r.top_k > 0 else vocab_size for r in rows], device=device)
        k = k.clamp(max=vocab_size)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_top_p:
        p = torch.tensor([r.top_p for r in rows], device=device).unsqueeze(1)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest head whose mass reaches p: drop a token when the mass before it already does.
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= p
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _apply_min_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    if not any(r.min_p > 0.0 for r in rows):
        return probs
    min_p = torch.tensor([r.min_p for r in rows], device=probs.device).unsqueeze(1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)
