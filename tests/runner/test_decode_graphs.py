"""Decode graphs (runner/decode_graphs.py) without a GPU: the bucket choice, the padding of a step's inputs,
and the static-buffer forward a graph would record, run with `replay_eagerly` on the CPU (the Triton backend
under its interpreter) against the runner's eager decode. Capturing itself is CUDA's (bench/gpu/ checks it)."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch, SamplingRow
from serval.runner.decode_graphs import (
    DecodeGraphs,
    bucket_for,
    decode_buckets,
    is_graph_step,
    padded_decode_inputs,
    replay_eagerly,
)
from tests.fixtures.triton_interpreter import triton_interpreter  # noqa: F401 (a fixture)

BLOCK_SIZE, NUM_BLOCKS = 4, 40
PAD_BLOCK = NUM_BLOCKS - 1  # the test's sequences never use it: it stands for the runner's spare block


def test_buckets_cover_every_batch_up_to_the_largest():
    assert decode_buckets(1) == [1]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112]
    buckets = decode_buckets(256)
    for num_seqs in range(1, 257):
        bucket = bucket_for(num_seqs, buckets)
        assert bucket >= num_seqs and not any(num_seqs <= b < bucket for b in buckets)
    assert bucket_for(257, buckets) is None  # runs eagerly


def test_padding_rows_live_in_the_pad_block():
    tables = torch.tensor([[5, 9, 0], [7, 0, 0]])
    padded = padded_decode_inputs([11, 12], [6, 3], tables, BLOCK_SIZE, bucket=4, pad_block=PAD_BLOCK)
    assert padded.input_ids.tolist() == [11, 12, 0, 0]
    assert padded.positions.tolist() == [6, 3, 0, 0]
    # Position 6 is the third slot of the sequence's second block (9); position 3 the last of block 7.
    assert padded.slot_mapping.tolist() == [9 * 4 + 2, 7 * 4 + 3, PAD_BLOCK * 4, PAD_BLOCK * 4]
    assert padded.context_lens.tolist() == [7, 4, 1, 1]
    assert padded.block_tables.dtype == torch.int32
    assert padded.block_tables[:2].tolist() == tables.tolist()
    assert (padded.block_tables[2:] == PAD_BLOCK).all()


def _decode(token_ids: list[int], positions: list[int], tables: list[list[int]], **extra) -> Batch:
    n = len(token_ids)
    return Batch(token_ids, [1] * n, positions, tables, list(range(n)), [SamplingRow()] * n, **extra)


def test_only_plain_decode_steps_are_replayed():
    assert is_graph_step(_decode([1, 2], [4, 5], [[0, 1], [2, 3]]))
    prefill = Batch([1, 2, 3], [2, 1], [0, 5], [[0], [1, 2]], [0, 1], [SamplingRow()] * 2)
    assert not is_graph_step(prefill)
    assert not is_graph_step(_decode([1, 2], [4, 5], [[0, 1], [2, 3]], lora_slots=[0, -1]))
    partial = Batch([1, 2], [1, 1], [4, 5], [[0, 1], [2, 3]], [1], [SamplingRow()])
    assert not is_graph_step(partial)


@pytest.fixture(scope="module")
def runner(tiny_model_factory, triton_interpreter):  # noqa: F811
    directory, _ = tiny_model_factory("llama", False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")
        config = EngineConfig(
            model=ModelConfig(model=directory, dtype="float32", attention_backend="triton"),
            cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
        )
        return Engine(config).runner


def test_replayed_decode_steps_match_the_eager_runner(runner):
    assert runner.decode_graphs is None  # graphs are built on CUDA only
    captured: list[int] = []

    def capture(run):
        # What a capture may read: padding only (its own runs write K/V), never rows an earlier step of a
        # wider bucket left.
        bucket = run().shape[0]  # as CUDA's capture does: a warm-up run, then the recorded one
        assert (graphs.slot_mapping[:bucket] == PAD_BLOCK * BLOCK_SIZE).all()
        assert (graphs.context_lens[:bucket] == 1).all() and (graphs.block_tables[:bucket] == PAD_BLOCK).all()
        captured.append(bucket)
        return replay_eagerly(run)

    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, BLOCK_SIZE, max_blocks_per_seq=8, max_batch=8, pad_block=PAD_BLOCK,
        device=torch.device("cpu"), capture=capture,
    )  # fmt: skip
    # Five sequences of different lengths, prefilled eagerly, each in its own blocks.
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 9, 4, 14, 6]
    tables = [list(range(6 * i, 6 * i + 6)) for i in range(len(lengths))]
    for length, table in zip(lengths, tables):
        prompt = torch.randint(3, 200, (length,), generator=generator).tolist()
        runner.compute_logits(Batch(prompt, [length], [0], [table], [0], [SamplingRow()]))
    positions = list(lengths)
    for num_seqs in (5, 3, 1, 5):  # buckets 8, 4, 1, then 8 again
        token_ids = torch.randint(3, 200, (num_seqs,), generator=generator).tolist()
        batch = _decode(token_ids, positions[:num_seqs], tables[:num_seqs])
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        expected = runner.compute_logits(batch)
        after_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):  # back to the state before the step
            k.copy_(k0)
            v.copy_(v0)
        got = graphs.run(batch)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4
        # The step's K/V went where the eager step put it; padding rows touched only the pad block.
        real_slots = slice(0, PAD_BLOCK * BLOCK_SIZE)
        for (k, v), (k_e, v_e) in zip(runner.kv_caches, after_eager):
            assert torch.allclose(k[real_slots], k_e[real_slots], atol=1e-5)
            assert torch.allclose(v[real_slots], v_e[real_slots], atol=1e-5)
        positions[:num_seqs] = [p + 1 for p in positions[:num_seqs]]
    assert captured == [8, 4, 1]  # one capture per bucket: the second 5-sequence step replayed bucket 8
    assert graphs.run(Batch([1, 2, 3], [2, 1], [0, 5], [[0], [1, 2]], [0, 1], [SamplingRow()] * 2)) is None


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(runner, caplog):
    attempts: list[int] = []

    def failing_capture(run):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, BLOCK_SIZE, max_blocks_per_seq=8, max_batch=8, pad_block=PAD_BLOCK,
        device=torch.device("cpu"), capture=failing_capture,
    )  # fmt: skip
    batch = _decode([5, 6], [3, 4], [[0, 1], [2, 3]])
    assert graphs.run(batch) is None and graphs.run(_decode([7], [3], [[4]])) is None
    assert attempts == [1]  # not tried again, for this bucket or another
    assert "bucket 2: operation not permitted" in graphs.capture_error
    assert "decode graphs are off" in caplog.text
