"""Write random-weight Llama GGUF files of real model shapes, to benchmark serval and llama-server on.

Both servers read the same file, so a comparison at 1B-7B needs no downloaded checkpoint. Owns the shape
table (Llama 3.2 1B/3B, Llama 2 7B and a tiny self-check shape), the llama.cpp tensor plan and metadata for
them, and the streaming writer. The vocabulary and every `tokenizer.*` key come from the default model
(SmolLM2's 49152-token BPE), so the text a model generates is noise but its speed and memory are real.
Files are made on demand, never committed:

    # -> /tmp/serval-models/llama-3.2-1b-Q4_0.gguf (skipped if it exists)
    .venv/bin/python bench/make_model.py --shape llama-3.2-1b --type Q4_0
    .venv/bin/python bench/make_model.py --shape tiny --type F16 --out-dir /tmp/models --force
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from tqdm import tqdm

from serval.model_source import default_model_path

DEFAULT_OUT_DIR = "/tmp/serval-models"

# Matrices are N(0, WEIGHT_STD): with RMS-normed inputs a projection's outputs have std
# WEIGHT_STD * sqrt(fan_in) (about 1.3 at hidden 4096), so activations stay finite through every layer.
WEIGHT_STD = 0.02
NORM_NOISE_STD = 0.02  # norm weights are ones plus this much noise
RMS_NORM_EPS = 1e-5

# Floats generated at once: 16M float32 (64 MiB) plus the quantizer's temporaries per chunk keeps the peak
# far under 2 GB even for the 7B token embedding (49152 x 4096 = 201M values, 805 MB as float32).
CHUNK_ELEMENTS = 16 * 1024 * 1024


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    tie_word_embeddings: bool  # True: no output.weight, the head reads token_embd.weight
    context_length: int  # what llama.context_length says, not always the model's trained maximum


# From the models' config.json files.
# NOTE: Llama 3.2 is trained to 131072 positions with llama3 rope scaling; we write 8192 (its pre-scaling
# length) and no rope_freqs.weight: position scaling changes the numbers, not the cost of a step, and a
# 131072 context would make llama-server reserve a KV cache for it by default.
SHAPES = {
    shape.name: shape
    for shape in (
        ModelShape("tiny", 256, 768, 4, 4, 2, 64, 10000.0, True, 2048),
        ModelShape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 64, 500000.0, True, 8192),
        ModelShape("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128, 500000.0, True, 8192),
        ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 128, 10000.0, False, 4096),
    )
}


@dataclass(frozen=True)
class WeightType:
    """What `--type` means for each kind of tensor (norms are always F32)."""

    matrix: GGMLQuantizationType  # attention and FFN projections
    embedding: GGMLQuantizationType  # token_embd.weight
    output: GGMLQuantizationType  # output.weight, when the head is untied
    file_type: LlamaFileType  # general.file_type


Q = GGMLQuantizationType
# NOTE: llama-quantize gives a Q4_0 model a Q6_K output.weight, but gguf's Python quantizer cannot write Q6_K
# (quants.Q6_K has no quantize_blocks), so the untied head is Q8_0: the same role ("the head keeps more
# bits"), about 6% more bytes for that one tensor.
WEIGHT_TYPES = {
    "Q4_0": WeightType(Q.Q4_0, Q.Q4_0, Q.Q8_0, LlamaFileType.MOSTLY_Q4_0),
    "Q8_0": WeightType(Q.Q8_0, Q.Q8_0, Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "F16": WeightType(Q.F16, Q.F16, Q.F16, LlamaFileType.MOSTLY_F16),
}


@dataclass(frozen=True)
class TensorPlan:
    name: str  # llama.cpp's name, e.g. blk.3.ffn_gate.weight
    shape: tuple[int, ...]  # numpy order (out_features, in_features); GGUF's ne is this reversed
    qtype: GGMLQuantizationType

    @property
    def is_norm(self) -> bool:
        return len(self.shape) == 1

    @property
    def row_bytes(self) -> int:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block_size * type_size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], self.row_bytes)

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.byte_shape))


def plan_tensors(shape: ModelShape, vocab_size: int, weight_type: WeightType) -> list[TensorPlan]:
    """Every tensor of the file, in the order llama.cpp's converter writes a Llama checkpoint."""
    hidden, q_width = shape.hidden_size, shape.num_heads * shape.head_dim
    kv_width, ffn = shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    matrix = weight_type.matrix
    plans = [TensorPlan("token_embd.weight", (vocab_size, hidden), weight_type.embedding)]
    for layer in range(shape.num_layers):
        # NOTE: llama.cpp stores attn_q/attn_k with rows permuted per head; random rows need no permuting
        for part, part_shape, qtype in (
            ("attn_norm", (hidden,), Q.F32),
            ("attn_q", (q_width, hidden), matrix),
            ("attn_k", (kv_width, hidden), matrix),
            ("attn_v", (kv_width, hidden), matrix),
            ("attn_output", (hidden, q_width), matrix),
            ("ffn_norm", (hidden,), Q.F32),
            ("ffn_gate", (ffn, hidden), matrix),
            ("ffn_up", (ffn, hidden), matrix),
            ("ffn_down", (hidden, ffn), matrix),
        ):
            plans.append(TensorPlan(f"blk.{layer}.{part}.weight", part_shape, qtype))
    plans.append(TensorPlan("output_norm.weight", (hidden,), Q.F32))
    if not shape.tie_word_embeddings:
        plans.append(TensorPlan("output.weight", (vocab_size, hidden), weight_type.output))
    return plans


def read_tokenizer_fields(path: str) -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """Every `tokenizer.*` key of a GGUF file as (value, type, array element type), ready to write back."""
    reader = gguf.GGUFReader(path)
    fields = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        # types is [ARRAY, element type] for an array and [type] otherwise; contents() decodes strings, so
        # the token list stays a list of str and the chat template a str
        value_type = field.types[0]
        element_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        fields[key] = (field.contents(), value_type, element_type)
    return fields


def add_metadata(
    writer: gguf.GGUFWriter,
    shape: ModelShape,
    weight_type: WeightType,
    tokenizer_fields: dict,
    vocab_size: int,
) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(weight_type.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, value_type, element_type) in tokenizer_fields.items():
        writer.add_key_value(key, value, value_type, sub_type=element_type)


def generate_tensor(plan: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The tensor's encoded bytes, (rows, row_bytes) uint8, made CHUNK_ELEMENTS floats at a time.

    Quantization works along the last axis in blocks, so quantizing row chunks separately and stacking the
    bytes is the same as quantizing the whole matrix: only one chunk of float32 is alive at a time.
    """
    encoded = np.empty(plan.byte_shape, dtype=np.uint8)
    if plan.is_norm:
        values = 1.0 + NORM_NOISE_STD * rng.standard_normal(plan.shape, dtype=np.float32)
        encoded[:] = values.astype(np.float32).view(np.uint8)
        return encoded
    num_rows, num_cols = plan.shape
    rows_per_chunk = max(1, CHUNK_ELEMENTS // num_cols)
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        chunk = rng.standard_normal((stop - start, num_cols), dtype=np.float32)  # (chunk_rows, num_cols)
        chunk *= WEIGHT_STD
        # quantize returns float16 for F16 and uint8 blocks otherwise; both are the row's bytes
        encoded[start:stop] = gguf.quants.quantize(chunk, plan.qtype).view(np.uint8)
    return encoded


def iter_tensor_data(plans: list[TensorPlan], seed: int) -> Iterator[np.ndarray]:
    for index, plan in enumerate(plans):
        # one generator per tensor, so a tensor's values depend on (seed, its index) and not on chunking
        yield generate_tensor(plan, np.random.default_rng([seed, index]))


def write_model(path: str, shape: ModelShape, weight_type: WeightType, seed: int) -> None:
    """Write the file at `path`, one tensor in memory at a time: infos first, then each tensor's data."""
    tokenizer_fields = read_tokenizer_fields(default_model_path())
    vocab_size = len(tokenizer_fields["tokenizer.ggml.tokens"][0])
    plans = plan_tensors(shape, vocab_size, weight_type)
    check_free_space(os.path.dirname(path), sum(plan.num_bytes for plan in plans))

    writer = gguf.GGUFWriter(path, "llama")
    add_metadata(writer, shape, weight_type, tokenizer_fields, vocab_size)
    for plan in plans:
        # uint8 bytes + raw_dtype: the writer turns the byte shape back into element counts for ne
        writer.add_tensor_info(
            plan.name, plan.byte_shape, np.dtype(np.uint8), plan.num_bytes, raw_dtype=plan.qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    progress = tqdm(total=len(plans), unit="tensor", desc=os.path.basename(path).removesuffix(".partial"))
    for plan, data in zip(plans, iter_tensor_data(plans, seed)):
        progress.set_postfix_str(plan.name, refresh=False)
        writer.write_tensor_data(data)  # pads to the alignment, writes, and checks the byte count
        progress.update()
    progress.close()
    writer.close()


def check_free_space(directory: str, num_bytes: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < num_bytes * 1.05:
        raise SystemExit(f"{directory} has {free / 1e9:.2f} GB free; the file needs {num_bytes / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--type", required=True, choices=list(WEIGHT_TYPES), dest="weight_type")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{args.shape}-{args.weight_type}.gguf")
    if os.path.exists(path) and not args.force:
        print(f"{path} exists, skipping (--force to write it again)")
        return
    # written under a temporary name, so an interrupted run never leaves a file that a later run would skip
    partial_path = path + ".partial"
    started = time.monotonic()
    try:
        write_model(partial_path, SHAPES[args.shape], WEIGHT_TYPES[args.weight_type], args.seed)
    except BaseException:
        if os.path.exists(partial_path):
            os.remove(partial_path)
        raise
    os.replace(partial_path, path)
    elapsed = time.monotonic() - started
    print(f"{path}: {os.path.getsize(path) / 1e9:.3f} GB in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
