"""Embedding models: how a checkpoint says it is one, and how its final hidden states become one vector.

The rule (sentence-transformers', which vLLM follows for its pooling models): a Hugging Face directory whose
`modules.json` lists a sentence-transformers `Pooling` module is an embedding model. That module's
`config.json` names the pooling (`"pooling_mode": "lasttoken"` in sentence-transformers 6, the flag
`pooling_mode_lasttoken` before: Qwen3-Embedding; mean, cls and max likewise), and a `Normalize` module after it L2-normalizes the
vector. Other modes (weighted mean, mean/sqrt(len)) and modules serval does not run (a Dense projection) are
refused at load, never silently skipped. Tensors only: the runner pools, serving handles text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

# Modules by class name: sentence-transformers 2-5 write "sentence_transformers.models.Pooling", 6 writes
# "sentence_transformers.sentence_transformer.modules.pooling.Pooling".
POOLING_MODULE = "Pooling"
NORMALIZE_MODULE = "Normalize"
TRANSFORMER_MODULE = "Transformer"
# sentence-transformers 6 names the mode ("pooling_mode": "lasttoken"); earlier versions turn one flag on.
_NAMED_MODES = {"lasttoken": "lasttoken", "mean": "mean", "cls": "cls", "max": "max"}
_MODES = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
}
_UNSUPPORTED_MODES = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class Pooling:
    mode: str  # "lasttoken" | "mean" | "cls" | "max"
    normalize: bool  # L2-normalize the pooled vector (a Normalize module follows the Pooling one)


def _read_json(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def read_pooling(directory: str) -> Pooling | None:
    """The directory's pooling, or None when it is not an embedding model (no Pooling in modules.json).
    ValueError for a sentence-transformers pipeline serval cannot reproduce."""
    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path} must be a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if POOLING_MODULE not in kinds:
        return None
    extra = [kind for kind in kinds if kind not in (TRANSFORMER_MODULE, POOLING_MODULE, NORMALIZE_MODULE)]
    if extra:
        raise ValueError(
            f"{path}: the module {extra[0]!r} is not supported (only Transformer, Pooling, Normalize)"
        )
    pooling_module = modules[kinds.index(POOLING_MODULE)]
    config = _read_json(os.path.join(directory, str(pooling_module.get("path", "")), "config.json"))
    if not isinstance(config, dict):
        raise ValueError(f"{directory}: the Pooling module's config.json must be an object")  # noqa: TRY004
    named = config.get("pooling_mode")
    if isinstance(named, str):
        if named not in _NAMED_MODES:
            raise ValueError(f"{directory}: pooling {named!r} is not supported (only {sorted(_NAMED_MODES)})")
        modes = [_NAMED_MODES[named]]
    else:
        for key in _UNSUPPORTED_MODES:
            if config.get(key):
                raise ValueError(f"{directory}: pooling {key} is not supported")
        modes = [mode for key, mode in _MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{directory}: the Pooling module must turn exactly one of {sorted(_MODES)} on")
    if config.get("include_prompt") is False:
        raise ValueError(
            f"{directory}: pooling with include_prompt false (instruction tokens left out) is not supported"
        )
    return Pooling(modes[0], NORMALIZE_MODULE in kinds[kinds.index(POOLING_MODULE) :])


def pool(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One sequence's vector: hidden (num_tokens, hidden_size) -> (hidden_size,) float32."""
    hidden = hidden.float()
    if pooling.mode == "lasttoken":
        vector = hidden[-1]
    elif pooling.mode == "cls":
        vector = hidden[0]
    elif pooling.mode == "mean":
        vector = hidden.mean(dim=0)
    else:
        vector = hidden.max(dim=0).values
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector
