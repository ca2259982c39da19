"""Rewrite a GGUF file's weights in another GGML type: the same model, dequantized (F16, F32) or quantized
again (Q4_0, Q8_0) from its dequantized values. Every metadata key (the tokenizer's, the chat template) is
copied; norms and other 1-D tensors stay F32.

What it is for: a target and a draft of the same real weights for speculative decoding with a draft model
(the default model's Q4_1 file, dequantized to F16, is the target; the Q4_1 file itself, or a Q4_0 copy, the
draft). Files are made on demand under /tmp, never committed:

    .venv/bin/python bench/dequantize_gguf.py /tmp/serval-models/smollm2-135m-F16.gguf          # the default model
    .venv/bin/python bench/dequantize_gguf.py /tmp/serval-models/smollm2-135m-Q4_0.gguf --type Q4_0
"""

from __future__ import annotations

import argparse
import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType

from serval.model_source import default_model_path

FILE_TYPES = {
    "F32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: LlamaFileType) -> None:
    for key, field in reader.fields.items():
        # The writer adds the header's counts and the architecture itself; the file type is the new one.
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        element_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=element_type)
    writer.add_file_type(file_type)


def converted(tensor, weight_type: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The tensor's values in weight_type (matrices only; a 1-D tensor stays F32), with the type written."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    if values.ndim < 2 or weight_type == GGMLQuantizationType.F32:
        return values, GGMLQuantizationType.F32
    if weight_type == GGMLQuantizationType.F16:
        return values.astype(np.float16), weight_type
    return gguf.quants.quantize(values, weight_type), weight_type


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    parser.add_argument("--type", default="F16", choices=sorted(FILE_TYPES))
    args = parser.parse_args()
    reader = gguf.GGUFReader(args.model or default_model_path())
    weight_type, file_type = FILE_TYPES[args.type]
    arch = reader.fields["general.architecture"].contents()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    writer = gguf.GGUFWriter(args.out, arch)
    copy_metadata(reader, writer, file_type)
    for tensor in reader.tensors:
        values, written_type = converted(tensor, weight_type)
        # Quantized data is bytes (rows, row bytes): the writer needs the element type and the byte shape.
        raw_dtype = (
            None if written_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else written_type
        )
        writer.add_tensor(tensor.name, values, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {os.path.getsize(args.out) / 2**20:.1f} MiB, matrices {args.type}")


if __name__ == "__main__":
    main()
