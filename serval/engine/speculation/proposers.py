"""Which proposer a SpeculativeConfig asks for, wrapped in the engine's Speculator."""

from __future__ import annotations

from serval.config import EngineConfig
from serval.engine.speculation.ngram import NgramProposer
from serval.engine.speculation.speculator import Speculator


def make_speculator(config: EngineConfig, max_model_len: int, vocab_size: int) -> Speculator | None:
    spec = config.speculative
    if spec.method is None:
        return None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from serval.engine.speculation.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, vocab_size)
    return Speculator(spec, proposer, max_model_len)
