"""Write a GGUF checkpoint as a Hugging Face directory (config.json, bf16 safetensors, tokenizer files), for peers
that only read Hugging Face directories (vLLM's CPU build). Weights go through serval's own GGUF loader
(dequantized, llama.cpp's q/k row order undone); the tokenizer through transformers' GGUF reader.

    .venv/bin/python bench/export_hf.py /tmp/smollm2-hf            # the default model
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from serval.model_source import resolve_model
from serval.runner.loader.gguf import config_from_reader, iter_gguf_weights, open_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    args = parser.parse_args()
    source = resolve_model(args.model)
    os.makedirs(args.out_dir, exist_ok=True)
    reader = open_gguf(source.path)
    config = config_from_reader(reader)
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(args.out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    tensors = {
        name: tensor.to(torch.bfloat16).contiguous()
        for name, tensor in iter_gguf_weights(source.path, reader)
    }
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(args.out_dir, "model.safetensors"), metadata={"format": "pt"})
    directory, name = os.path.split(source.path)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(args.out_dir)
    print(f"wrote {len(tensors)} tensors and the tokenizer to {args.out_dir}")


if __name__ == "__main__":
    main()
