"""Weights of a Hugging Face directory: config.json and one or many *.safetensors shards."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from serval.progress import progress


def read_hf_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def safetensors_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    paths = [os.path.join(directory, s) for s in shards]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"weight shard {p} named by the index is missing")
    return paths


def iter_safetensors_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(directory)
    num_tensors = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            num_tensors += len(f.keys())
    with progress(total=num_tensors, desc="loading weights", unit="tensor") as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    yield name, f.get_tensor(name)
                    bar.update(1)


def safetensors_formats(directory: str) -> tuple[str, ...]:
    """The dtypes of the checkpoint's matrices ("BF16", "F32", ...), most weights first (headers only)."""
    weights_by_dtype: dict[str, int] = {}
    for path in safetensors_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                sliced = f.get_slice(name)
                shape = sliced.get_shape()
                if len(shape) >= 2:
                    count = 1
                    for n in shape:
                        count *= n
                    dtype = sliced.get_dtype()
                    weights_by_dtype[dtype] = weights_by_dtype.get(dtype, 0) + count
    return tuple(sorted(weights_by_dtype, key=weights_by_dtype.__getitem__, reverse=True))
