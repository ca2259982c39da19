"""Write random-weight GGUF files of real model shapes, to benchmark serval and llama-server on.

Both servers read the same file, so a comparison at 1B-30B needs no downloaded checkpoint. Owns what
`--type` means (each tensor's GGML type, llama.cpp's Q4_K_M and Q5_K_M mixes), the file's tensor plan and
metadata, and the streaming writer; the shapes (Llama 3.2 1B/3B, Llama 2 7B, the mixture-of-experts Qwen3-30B-A3B and
gpt-oss-20b, and a tiny self-check shape) are bench/model_shapes.py's, each type's bytes bench/gguf_blocks.py's.
The vocabulary and every `tokenizer.*` key come from the default model (SmolLM2's 49152-token BPE), so the
text a model generates is noise but its speed and memory are real. Files are made on demand, never committed:

    # -> /tmp/serval-models/llama-3.2-1b-Q4_0.gguf (skipped if it exists)
    .venv/bin/python bench/make_model.py --shape llama-3.2-1b --type Q4_0
    .venv/bin/python bench/make_model.py --shape tiny --type F16 --out-dir /tmp/models --force
    # -> /tmp/serval-models/gpt-oss-20b-2l-MXFP4.gguf: the real layer shapes, 2 of the 24 layers
    .venv/bin/python bench/make_model.py --shape gpt-oss-20b --type MXFP4 --layers 2
    # the size of the full file, without writing it
    .venv/bin/python bench/make_model.py --shape qwen3-30b-a3b --type Q4_0 --dry-run
    # llama.cpp's Q4_K_M mix as random k-quant blocks (bench/gguf_blocks.py: no quantizer needed); Q5_K_M too
    .venv/bin/python bench/make_model.py --shape qwen3-30b-a3b --type Q4_K_M
    .venv/bin/python bench/make_model.py --shape llama-3.2-1b --type Q5_K_M
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf_blocks import RANDOM_BLOCK_TYPES, encode, random_blocks
from model_shapes import EMBEDDING, EXPERTS, NORM, OUTPUT, SHAPES, ModelShape, Role
from tqdm import tqdm

from serval.model_source import default_model_path

DEFAULT_OUT_DIR = "/tmp/serval-models"


# Floats generated at once: 16M float32 (64 MiB) plus the quantizer's temporaries per chunk keeps the peak
# far under 2 GB even for the 7B token embedding (49152 x 4096 = 201M values, 805 MB as float32).
CHUNK_ELEMENTS = 16 * 1024 * 1024

Q = GGMLQuantizationType


@dataclass(frozen=True)
class WeightType:
    """What `--type` means for each kind of tensor (norms, biases and routers are always F32)."""

    matrix: GGMLQuantizationType  # attention and dense FFN projections
    experts: GGMLQuantizationType  # the stacked expert matrices of a mixture-of-experts layer
    embedding: GGMLQuantizationType  # token_embd.weight
    output: GGMLQuantizationType  # output.weight, when the head is untied
    file_type: LlamaFileType  # general.file_type
    experts_only: bool = False  # the type is about expert matrices: a shape without experts is refused
    # attn_v and ffn_down(_exps) of llama.cpp's use_more_bits layers (its _M mixes), if not None
    more_bits: GGMLQuantizationType | None = None
    # A tied token_embd.weight is the head, and takes the output type, as llama-quantize gives it (its _M mixes
    # here; the plain types keep the embedding's, so that their files stay the ones earlier figures measured).
    tied_embedding_as_output: bool = False


def k_quant_mix(base: GGMLQuantizationType, file_type: LlamaFileType) -> WeightType:
    """llama-quantize's _M mix over `base` (Q4_K for Q4_K_M, Q5_K for Q5_K_M), written as random blocks
    (bench/gguf_blocks.py): a Q6_K head (the tied embedding too), and Q6_K attn_v and ffn_down(_exps) in the
    first and last eighth of the layers and every third between."""
    return WeightType(base, base, base, Q.Q6_K, file_type, more_bits=Q.Q6_K, tied_embedding_as_output=True)


# NOTE: llama-quantize gives a Q4_0 model a Q6_K output.weight, but gguf's Python quantizer cannot write Q6_K
# (quants.Q6_K has no quantize_blocks), so the untied head is Q8_0: the same role ("the head keeps more
# bits"), about 6% more bytes for that one tensor.
# NOTE: MXFP4 is what llama.cpp's published gpt-oss GGUFs hold (ggml-org/gpt-oss-20b-GGUF, converted with
# --outtype q8_0): experts in MXFP4 as OpenAI ships them, attention, embedding and head in Q8_0 (12.1 GB
# at gpt-oss's own 201088-token vocabulary, which is what 19.1G MXFP4 + 1.8G Q8_0 parameters come to).
WEIGHT_TYPES = {
    "Q4_0": WeightType(Q.Q4_0, Q.Q4_0, Q.Q4_0, Q.Q8_0, LlamaFileType.MOSTLY_Q4_0),
    "Q8_0": WeightType(Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "F16": WeightType(Q.F16, Q.F16, Q.F16, Q.F16, LlamaFileType.MOSTLY_F16),
    "MXFP4": WeightType(Q.Q8_0, Q.MXFP4, Q.Q8_0, Q.Q8_0, LlamaFileType.MOSTLY_MXFP4_MOE, experts_only=True),
    "Q4_K_M": k_quant_mix(Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": k_quant_mix(Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
}
MORE_BITS_PARTS = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
# llama-quantize's type for a matrix whose rows a k-quant's 256-value super-block does not divide
# (src/llama-quant.cpp, "using fallback quantization"): DeepSeek-V2-Lite's 10944- and 1408-wide ffn_down rows.
K_QUANT_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in a Q4_K_M file
    (src/llama-quant.cpp): the first and last eighth, and every third layer between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


@dataclass(frozen=True)
class TensorPlan:
    name: str  # llama.cpp's name, e.g. blk.3.ffn_gate.weight
    shape: tuple[int, ...]  # numpy order, e.g. (out_features, in_features); GGUF's ne is this reversed
    qtype: GGMLQuantizationType
    role: Role

    @property
    def row_bytes(self) -> int:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        if self.shape[-1] % block_size:
            raise ValueError(f"{self.name}: rows of {self.shape[-1]} are not whole {self.qtype.name} blocks")
        return self.shape[-1] // block_size * type_size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], self.row_bytes)

    @property
    def num_bytes(self) -> int:
        return math.prod(self.byte_shape)


def plan_tensors(shape: ModelShape, vocab_size: int, weight_type: WeightType) -> list[TensorPlan]:
    """Every tensor of the file: token embedding, the architecture's layer table per layer, final norm, head."""
    shape.arch.check_names()
    dims = shape.dimensions()

    def plan(name: str, dim_names: tuple[str, ...], role: Role, more_bits: bool = False) -> TensorPlan:
        qtype = getattr(weight_type, role.weight_field) if role.weight_field else Q.F32
        if more_bits and weight_type.more_bits is not None:
            qtype = weight_type.more_bits
        shape = tuple(dims[dim] for dim in dim_names)
        if qtype in K_QUANT_FALLBACK and shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = K_QUANT_FALLBACK[qtype]
        return TensorPlan(name, shape, qtype, role)

    dims["vocab"] = vocab_size
    tied_head = shape.tie_word_embeddings and weight_type.tied_embedding_as_output
    plans = [plan("token_embd.weight", ("vocab", "hidden"), OUTPUT if tied_head else EMBEDDING)]
    for layer in range(shape.num_layers):
        more_bits = use_more_bits(layer, shape.num_layers)
        plans.extend(
            plan(f"blk.{layer}.{part}", dim_names, role, more_bits and part in MORE_BITS_PARTS)
            for part, dim_names, role in shape.arch.layer_table(layer, shape.num_dense_layers)
        )
    plans.append(plan("output_norm.weight", ("hidden",), NORM))
    if not shape.tie_word_embeddings:
        plans.append(plan("output.weight", ("vocab", "hidden"), OUTPUT))
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
    """The keys llama.cpp's converter writes for the architecture (gguf-py's writer adds the arch prefix)."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if shape.mla is not None:
        add_mla_metadata(writer, shape)
    # llama.cpp's head size defaults to hidden / heads; Qwen3 (128, not 64) and gpt-oss (64, not 45) differ
    elif shape.head_dim * shape.num_heads != shape.hidden_size:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.num_experts:
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.num_experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate_size)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(shape.yarn.original_context_length)
        writer.add_rope_scaling_yarn_beta_fast(shape.yarn.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(shape.yarn.beta_slow)
        if shape.yarn.log_multiplier:
            writer.add_rope_scaling_yarn_log_mul(shape.yarn.log_multiplier)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(weight_type.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, value_type, element_type) in tokenizer_fields.items():
        writer.add_key_value(key, value, value_type, sub_type=element_type)


def add_mla_metadata(writer: gguf.GGUFWriter, shape: ModelShape) -> None:
    """DeepSeek-V2's keys (llama.cpp's converter): MLA's sizes as a head's q.k and value widths, the dense
    lead, the shared experts and the softmax router's settings."""
    mla = shape.mla
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    writer.add_key_length(mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    writer.add_value_length(mla.v_head_dim)
    writer.add_leading_dense_block_count(shape.num_dense_layers)
    writer.add_expert_shared_count(shape.num_shared_experts)
    writer.add_expert_weights_scale(1.0)
    writer.add_expert_weights_norm(False)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)


def padded_vocabulary(fields: dict, vocab_size: int) -> dict:
    """The tokenizer fields with control tokens appended up to vocab_size (a shape's real vocabulary size,
    which sets its embedding's and head's cost)."""
    tokens, token_type, element_type = fields["tokenizer.ggml.tokens"]
    missing = vocab_size - len(tokens)
    if missing <= 0:
        return fields
    padded = dict(fields)
    padded["tokenizer.ggml.tokens"] = (
        [*tokens, *(f"<|pad_{i}|>" for i in range(missing))],
        token_type,
        element_type,
    )
    if "tokenizer.ggml.token_type" in fields:
        types, types_type, types_element = fields["tokenizer.ggml.token_type"]
        control = [int(gguf.TokenType.CONTROL)] * missing
        padded["tokenizer.ggml.token_type"] = ([*types, *control], types_type, types_element)
    return padded


def generate_tensor(plan: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The tensor's encoded bytes, (rows, row_bytes) uint8, made CHUNK_ELEMENTS floats at a time.

    Quantization works along the last axis in blocks, so quantizing row chunks separately and stacking the
    bytes is the same as quantizing the whole matrix: only one chunk of float32 is alive at a time. An
    expert stack (experts, rows, cols) is experts * rows rows.
    """
    num_cols = plan.shape[-1]
    num_rows = math.prod(plan.shape[:-1])
    encoded = np.empty((num_rows, plan.row_bytes), dtype=np.uint8)
    std = plan.role.std if plan.role.std is not None else 1.0 / math.sqrt(num_cols)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // num_cols)
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        if plan.qtype in RANDOM_BLOCK_TYPES:  # no quantizer: random codes under scales giving `std`
            encoded[start:stop] = random_blocks(stop - start, num_cols, plan.qtype, std, rng)
            continue
        chunk = rng.standard_normal((stop - start, num_cols), dtype=np.float32)  # (chunk_rows, num_cols)
        chunk *= std
        if plan.role.mean:
            chunk += plan.role.mean
        encoded[start:stop] = encode(chunk, plan.qtype)
    return encoded


def iter_tensor_data(plans: list[TensorPlan], seed: int) -> Iterator[np.ndarray]:
    for index, plan in enumerate(plans):
        # one generator per tensor, so a tensor's values depend on (seed, its index) and not on chunking
        yield generate_tensor(plan, np.random.default_rng([seed, index]))


def write_model(path: str, shape: ModelShape, weight_type: WeightType, seed: int) -> None:
    """Write the file at `path`, one tensor in memory at a time: infos first, then each tensor's data."""
    tokenizer_fields = padded_vocabulary(read_tokenizer_fields(default_model_path()), shape.vocab_size)
    vocab_size = len(tokenizer_fields["tokenizer.ggml.tokens"][0])
    plans = plan_tensors(shape, vocab_size, weight_type)
    check_free_space(os.path.dirname(path), sum(plan.num_bytes for plan in plans))

    writer = gguf.GGUFWriter(path, shape.arch.name)
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


def describe_plan(shape: ModelShape, weight_type: WeightType) -> str:
    """The tensor data's size and parameter counts, for --dry-run (the file adds ~1 MB of vocabulary)."""
    vocab_size = max(
        shape.vocab_size, len(read_tokenizer_fields(default_model_path())["tokenizer.ggml.tokens"][0])
    )
    plans = plan_tensors(shape, vocab_size, weight_type)
    by_type: dict[str, int] = {}
    for plan in plans:
        by_type[plan.qtype.name] = by_type.get(plan.qtype.name, 0) + plan.num_bytes
    params = sum(math.prod(plan.shape) for plan in plans)
    expert_params = sum(math.prod(plan.shape) for plan in plans if plan.role is EXPERTS)
    active = params - expert_params
    if shape.num_experts:
        active += expert_params * shape.num_experts_used // shape.num_experts
    types = ", ".join(f"{name} {num_bytes / 1e9:.3f}" for name, num_bytes in sorted(by_type.items()))
    return (
        f"{len(plans)} tensors, {sum(plan.num_bytes for plan in plans) / 1e9:.3f} GB of tensor data ({types} GB),"
        f" {params / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, choices=list(SHAPES))
    parser.add_argument("--type", required=True, choices=list(WEIGHT_TYPES), dest="weight_type")
    parser.add_argument("--layers", type=int, help="write this many layers of the shape (quick checks)")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.add_argument("--dry-run", action="store_true", help="print the file's size and write nothing")
    args = parser.parse_args()

    shape, weight_type = SHAPES[args.shape], WEIGHT_TYPES[args.weight_type]
    if weight_type.experts_only and not shape.num_experts:
        parser.error(f"--type {args.weight_type} types expert matrices; {args.shape} has none")
    stem = args.shape
    if args.layers is not None and args.layers != shape.num_layers:
        if args.layers < 1:
            parser.error("--layers must be at least 1")
        stem = f"{args.shape}-{args.layers}l"
        shape = dataclasses.replace(shape, name=stem, num_layers=args.layers)
    if args.dry_run:
        print(f"{stem}-{args.weight_type}: {describe_plan(shape, weight_type)}")
        return

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{stem}-{args.weight_type}.gguf")
    if os.path.exists(path) and not args.force:
        print(f"{path} exists, skipping (--force to write it again)")
        return
    # written under a temporary name, so an interrupted run never leaves a file that a later run would skip
    partial_path = path + ".partial"
    started = time.monotonic()
    try:
        write_model(partial_path, shape, weight_type, args.seed)
    except BaseException:
        if os.path.exists(partial_path):
            os.remove(partial_path)
        raise
    os.replace(partial_path, path)
    elapsed = time.monotonic() - started
    print(f"{path}: {os.path.getsize(path) / 1e9:.3f} GB in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
