"""Shared fixtures: tiny random-weight checkpoints written once per session, and the default model."""

from __future__ import annotations

import os

import pytest
import torch

from tests.fixtures.tiny_models import write_tiny_model

# Triton's interpreter runs the CUDA attention backend's kernels on CPU tensors (tests/fixtures/
# triton_interpreter.py). It must be chosen before triton is first imported, which anything may do (triton's
# own library functions are decorated at that import), so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHITECTURES = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """(architecture, tied, checkpoint dtype) -> (directory, transformers model); each written once."""
    made: dict = {}

    def make(architecture: str, tie_word_embeddings: bool = False, dtype: torch.dtype = torch.float32):
        key = (architecture, tie_word_embeddings, dtype)
        if key not in made:
            directory = tmp_path_factory.mktemp(
                f"tiny-{architecture}-{'tied' if tie_word_embeddings else 'untied'}"
                + ("" if dtype == torch.float32 else f"-{str(dtype).removeprefix('torch.')}")
            )
            made[key] = (
                str(directory),
                write_tiny_model(str(directory), architecture, tie_word_embeddings, dtype=dtype),
            )
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_lora_factory(tmp_path_factory, tiny_model_factory):
    """(adapter name in tests.fixtures.lora_adapters.ADAPTERS, architecture) -> (directory, PEFT model);
    adapters of the untied tiny model, each written once."""
    from tests.fixtures.lora_adapters import ADAPTERS, write_peft_adapter

    made: dict = {}

    def make(name: str, architecture: str = "llama"):
        key = (name, architecture)
        if key not in made:
            _, reference = tiny_model_factory(architecture, False)
            directory = str(tmp_path_factory.mktemp(f"lora-{architecture}-{name}"))
            made[key] = (directory, write_peft_adapter(reference, directory, ADAPTERS[name]))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_vl_factory(tmp_path_factory):
    """qwen2_5 -> (directory, transformers model): a tiny Qwen2-VL (or Qwen2.5-VL), written once."""
    from tests.fixtures.tiny_vl import write_tiny_vl_model

    made: dict = {}

    def make(qwen2_5: bool = False):
        if qwen2_5 not in made:
            directory = str(tmp_path_factory.mktemp("tiny-qwen2_5-vl" if qwen2_5 else "tiny-qwen2-vl"))
            made[qwen2_5] = (directory, write_tiny_vl_model(directory, qwen2_5))
        return made[qwen2_5]

    return make


@pytest.fixture(scope="session")
def tiny_audio_factory(tmp_path_factory):
    """() -> (directory, transformers model): a tiny Qwen2-Audio, written once."""
    from tests.fixtures.tiny_audio import write_tiny_audio_model

    made: list = []

    def make():
        if not made:
            directory = str(tmp_path_factory.mktemp("tiny-qwen2-audio"))
            made.append((directory, write_tiny_audio_model(directory)))
        return made[0]

    return make
