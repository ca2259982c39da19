#!/usr/bin/env bash
# Lays out .device/ in the checkout (ignored: .gitignore) for bench/gpu/check.sh on a machine lent
# a GPU, which receives only the working tree (64 MiB) and reaches no package registry: the Python 3.12 wheels
# its image lacks, and the default model's tokenizer as a metadata-only GGUF (no weights: every model of the
# check is made there with random weights). Run here, from the checkout, once: bash bench/gpu/prepare.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
python=${PYTHON:-.venv/bin/python}
rm -rf .device && mkdir -p .device/whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device/whl \
  fastapi==0.163.2 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 \
  annotated-types uvicorn==0.54.0 gguf==0.19.0 sniffio==1.3.1
"$python" - .device/tokenizer.gguf <<'PY'
import sys

import gguf

from serval.model_source import default_model_path

reader = gguf.GGUFReader(default_model_path())
writer = gguf.GGUFWriter(sys.argv[1], "llama")
for key, field in reader.fields.items():
    if key.startswith("tokenizer."):
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_ti_data_to_file()
writer.close()
PY
du -sh .device
