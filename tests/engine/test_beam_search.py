"""Beam search in the engine against transformers' beam search on the same tiny random weights.

Also: beams share their prompt's KV blocks by reference (copy on write for the partial block), and every
block is free when the search ends or is aborted.
"""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.sampling import SamplingParams

PROMPT = [7, 99, 250, 13, 13, 13, 5, 42, 17, 300, 12, 11, 10, 9, 8, 7, 6, 5, 4]  # 19 tokens: 2 blocks


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama")[0]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama, dtype="float32"), cache=CacheConfig(num_blocks=128)
    )
    return Engine(config)


@pytest.fixture(scope="module")
def hf_model(tiny_model_factory):
    return tiny_model_factory("llama")[1].float().eval()


def _serval_beams(engine: Engine, params: SamplingParams, eos: int):
    engine.add_request("beam", PROMPT, params, eos_token_ids=(eos,))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert len(outputs) == 1 and outputs[0].finished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs[0].beams


def _hf_beams(model, width: int, n: int, max_tokens: int, length_penalty, early_stopping, eos: int):
    import transformers

    config = transformers.GenerationConfig(
        num_beams=width,
        num_return_sequences=n,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([PROMPT]), generation_config=config)
    beams = []
    for sequence, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        generated = sequence[len(PROMPT) :]
        if eos in generated:
            generated = generated[: generated.index(eos) + 1]
        beams.append((generated, score))
    return beams


def _hf_beams_ending_on_eos(model, width, n, max_tokens, length_penalty, early_stopping):
    """transformers' beams with an EOS id chosen so that at least one returned beam ends on it (the random
    model has no real EOS): tries the tokens a search without EOS emits, most frequent first."""
    plain = _hf_beams(model, width, width, max_tokens, length_penalty, early_stopping, eos=10_000)
    counts: dict[int, int] = {}
    for tokens, _ in plain:
        for token in tokens[1:]:
            counts[token] = counts.get(token, 0) + 1
    for eos in sorted(counts, key=counts.get, reverse=True)[:20]:
        beams = _hf_beams(model, width, n, max_tokens, length_penalty, early_stopping, eos)
        if any(tokens[-1] == eos for tokens, _ in beams):
            return eos, beams
    raise AssertionError("no token ends a returned beam")


@pytest.mark.parametrize(
    ("width", "n", "max_tokens", "length_penalty", "early_stopping"),
    [
        (4, 4, 12, 1.0, False),
        (4, 2, 12, 0.0, True),
        (3, 3, 10, 2.0, "never"),
        (5, 1, 9, -0.5, False),
        (2, 2, 14, 1.0, True),
    ],
)
def test_beams_and_scores_match_transformers(
    engine, hf_model, width, n, max_tokens, length_penalty, early_stopping
):
    eos, expected = _hf_beams_ending_on_eos(hf_model, width, n, max_tokens, length_penalty, early_stopping)
    params = SamplingParams(
        n=n,
        best_of=width,
        temperature=0.0,
        max_tokens=max_tokens,
        use_beam_search=True,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    beams = _serval_beams(engine, params, eos)
    assert [b.token_ids for b in beams] == [tokens for tokens, _ in expected]
    for beam, (_, score) in zip(beams, expected):
        assert beam.score == pytest.approx(score, abs=1e-4)
        assert beam.finish_reason == ("stop" if beam.token_ids[-1] == eos else "length")
    assert any(b.finish_reason == "stop" for b in beams)


def test_beams_of_a_lora_adapter_match_transformers_with_peft(tiny_model_factory, tiny_lora_factory):
    from serval.config import LoraConfig, LoraModule

    directory, peft_model = tiny_lora_factory("full")
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_factory("llama")[0], dtype="float32"),
        cache=CacheConfig(num_blocks=128),
        lora=LoraConfig(enable_lora=True, max_loras=1, lora_modules=(LoraModule("full", directory),)),
    )
    engine = Engine(config)
    expected = _hf_beams(peft_model.float(), 3, 3, 10, 1.0, False, eos=10_000)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=10, use_beam_search=True)
    engine.add_request("lora-beams", PROMPT, params, eos_token_ids=(10_000,), lora_name="full")
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [b.token_ids for b in outputs[0].beams] == [tokens for tokens, _ in expected]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_beams_share_prompt_blocks_by_reference(engine, monkeypatch):
    copies: list[tuple[int, int]] = []
    copy_blocks = engine.runner.copy_blocks
    monkeypatch.setattr(
        engine.runner, "copy_blocks", lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
    )
    params = SamplingParams(n=4, temperature=0.0, max_tokens=8, use_beam_search=True, ignore_eos=True)
    engine.add_request("shared", PROMPT, params)
    engine.step()  # the prompt, then the first choice of 4 beams
    group = engine.beams.groups["shared"]
    assert len(group.running) == 4
    first_block = group.running[0].block_ids[0]
    assert all(beam.block_ids[0] == first_block for beam in group.running)
    assert engine.block_manager.ref_counts[first_block] == 4
    shared_tail = group.running[0].block_ids[1]
    assert copies == []
    engine.step()  # each beam writes its first token into the shared partial block: copied on write
    # The first three writers get copies; the last one is then the block's only holder and keeps it.
    assert len(copies) == 3 and all(source == shared_tail for source, _ in copies)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_every_beam(engine):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=50, use_beam_search=True, ignore_eos=True)
    engine.add_request("aborted", PROMPT, params)
    for _ in range(4):
        engine.step()
    output = engine.abort_request("aborted")
    assert output.finished and output.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_mid_search_keeps_the_results(tiny_llama, engine):
    # Two searches and a long plain request in a cache that holds each alone but not all at once.
    params = SamplingParams(n=2, temperature=0.0, max_tokens=24, use_beam_search=True, ignore_eos=True)
    long_prompt = PROMPT[::-1] * 2
    plain = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = _serval_beams(engine, params, eos=10_000)
    small = Engine(
        EngineConfig(model=ModelConfig(model=tiny_llama, dtype="float32"), cache=CacheConfig(num_blocks=12))
    )
    small.add_request("plain", long_prompt, plain)
    for request_id in ("a", "b", "c"):
        small.add_request(request_id, PROMPT, params)
    results = {}
    while small.has_unfinished_requests():
        for output in small.step():
            if output.beams is not None:
                results[output.request_id] = output.beams
    assert small.num_preemptions > 0
    for request_id in ("a", "b", "c"):
        assert [b.token_ids for b in results[request_id]] == [b.token_ids for b in expected]
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_a_search_that_cannot_fit_the_cache_is_refused(tiny_llama):
    small = Engine(
        EngineConfig(model=ModelConfig(model=tiny_llama, dtype="float32"), cache=CacheConfig(num_blocks=8))
    )
    params = SamplingParams(n=4, temperature=0.0, max_tokens=24, use_beam_search=True)
    with pytest.raises(ValueError, match="needs 12 KV blocks"):
        small.add_request("too-big", PROMPT, params)
    assert not small.has_unfinished_requests()
