"""Scoring several tokens of a sequence in one step (ModelRunner.score, Batch.num_logit_rows), the seam of
speculative decoding: the k + 1 rows of one step equal k + 1 decode steps' logits, on the native kernels'
path and on the PyTorch (SDPA) path, with and without cached context, alone and beside other sequences."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch, SamplingRow
from serval.runner.runner import ModelRunner
from tests.fixtures.kernels import require_kernels

BLOCK_SIZE = 4
PROMPT = [5, 17, 260, 3, 3, 99, 41, 8, 120, 7, 64]  # 11 tokens: the last block is partial
DRAFT = [301, 14, 14, 77, 2]  # k = 5: the step's 6 tokens cross two block boundaries
OTHER = [9, 250, 31, 31, 200, 6, 47]


def _runner(path: str, tiny_model_factory, monkeypatch) -> ModelRunner:
    if path == "sdpa":
        monkeypatch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")
    else:
        require_kernels()  # skips without a compiler
    directory, _ = tiny_model_factory("llama", False)
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK_SIZE),
    )
    runner = Engine(config).runner
    # The path under test is the one in use: several new tokens after cached ones go through the native
    # prefill kernel with an offset, or through SDPA with an offset mask.
    assert runner.attention_backend.name == {"native": "native-cpu", "sdpa": "sdpa"}[path]
    return runner


class Blocks:
    """Fresh KV blocks for each sequence, so that no computation reads another's rows."""

    def __init__(self) -> None:
        self.next_free = 0

    def table(self, num_tokens: int) -> list[int]:
        num_blocks = -(-num_tokens // BLOCK_SIZE)
        self.next_free += num_blocks
        return list(range(self.next_free - num_blocks, self.next_free))


def _decoded_logits(runner: ModelRunner, tokens: list[int], num_rows: int, table: list[int]) -> torch.Tensor:
    """The reference: all but the last num_rows tokens in one prefill, then one decode step per token;
    (num_rows, vocab) logits after each of the last num_rows tokens."""
    num_cached = len(tokens) - num_rows
    if num_cached:
        runner.compute_logits(Batch(tokens[:num_cached], [num_cached], [0], [table], [], []))
    rows = []
    for position in range(num_cached, len(tokens)):
        step = Batch([tokens[position]], [1], [position], [table], [0], [])
        rows.append(runner.compute_logits(step)[0])
    return torch.stack(rows)


def _assert_same(scored: torch.Tensor, decoded: torch.Tensor) -> None:
    assert scored.shape == decoded.shape
    # fp32 on both sides: only the order of the sums differs between the one-step and per-token paths
    torch.testing.assert_close(scored, decoded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["native", "sdpa"])
@pytest.mark.parametrize("num_cached", [0, len(PROMPT) - 1])
def test_k_rows_of_one_step_equal_k_decode_steps(tiny_model_factory, monkeypatch, path, num_cached):
    runner = _runner(path, tiny_model_factory, monkeypatch)
    blocks = Blocks()
    context = PROMPT + DRAFT
    num_rows = len(DRAFT) + 1  # the last accepted token's and each draft token's
    decoded = _decoded_logits(runner, context, num_rows, blocks.table(len(context)))

    table = blocks.table(len(context))
    if num_cached:  # the context before the last accepted token is in the KV cache already
        runner.compute_logits(Batch(context[:num_cached], [num_cached], [0], [table], [], []))
    new = context[num_cached:]
    step = Batch(new, [len(new)], [num_cached], [table], [0], [], num_logit_rows=[num_rows])
    (scored,) = runner.score(step)
    _assert_same(scored, decoded)
    # The same step without num_logit_rows (it rewrites the same K/V rows) gives the last row alone.
    ordinary = runner.compute_logits(Batch(new, [len(new)], [num_cached], [table], [0], []))
    assert ordinary.shape[0] == 1
    _assert_same(ordinary, scored[-1:])


@pytest.mark.parametrize("path", ["native", "sdpa"])
def test_scored_rows_stay_in_order_beside_a_decode_and_an_unsampled_chunk(
    tiny_model_factory, monkeypatch, path
):
    runner = _runner(path, tiny_model_factory, monkeypatch)
    blocks = Blocks()
    context = PROMPT + DRAFT
    num_rows = len(DRAFT) + 1
    decoded = _decoded_logits(runner, context, num_rows, blocks.table(len(context)))
    other_decoded = _decoded_logits(runner, OTHER, 1, blocks.table(len(OTHER)))

    table, other_table, chunk_table = (blocks.table(len(context)), blocks.table(len(OTHER)), blocks.table(8))
    num_cached = len(PROMPT) - 1
    runner.compute_logits(
        Batch(context[:num_cached] + OTHER[:-1], [num_cached, len(OTHER) - 1], [0, 0], [table, other_table],
              [], [])
    )  # fmt: skip
    # A decode (one row), the speculative sequence (k + 1 rows), then a prefill chunk that samples nothing.
    step = Batch(
        token_ids=OTHER[-1:] + context[num_cached:] + list(range(40, 48)),
        num_new_tokens=[1, num_rows, 8],
        num_computed_tokens=[len(OTHER) - 1, num_cached, 0],
        block_tables=[other_table, table, chunk_table],
        sample_indices=[0, 1],
        sampling=[],
        num_logit_rows=[1, num_rows],
    )
    other_scored, scored = runner.score(step)
    _assert_same(other_scored, other_decoded)
    _assert_same(scored, decoded)


def test_logit_rows_default_to_each_sampled_sequences_last():
    batch = Batch(list(range(10)), [3, 1, 6], [0, 7, 2], [[0], [1], [2, 3]], [0, 2], [])
    assert batch.logit_rows().tolist() == [2, 9]
    batch.num_logit_rows = [2, 4]
    assert batch.logit_rows().tolist() == [1, 2, 6, 7, 8, 9]
    assert batch.logit_row_counts() == [2, 4]


@pytest.mark.parametrize("counts", [[4, 1], [0, 1], [1]])
def test_logit_row_counts_past_the_new_tokens_are_refused(counts):
    batch = Batch(
        list(range(10)), [3, 1, 6], [0, 7, 2], [[0], [1], [2, 3]], [0, 2], [], num_logit_rows=counts
    )
    with pytest.raises(ValueError, match="logit rows|num_logit_rows"):
        batch.logit_rows()


def test_execute_samples_every_logit_row_each_with_its_own_sampling_row(tiny_model_factory, monkeypatch):
    runner = _runner("sdpa", tiny_model_factory, monkeypatch)
    step = Batch([3, 4, 5], [3], [0], [[0]], [0], [], num_logit_rows=[2])
    with pytest.raises(ValueError, match="one sampling row per logit row"):
        runner.execute(step)
    (logits,) = runner.score(step)
    step.sampling = [SamplingRow(), SamplingRow()]  # greedy: each row's argmax
    assert runner.execute(step).token_ids == logits.argmax(-1).tolist()
