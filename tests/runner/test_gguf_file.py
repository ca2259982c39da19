"""serval's GGUF container reader against the `gguf` package's reader: the same metadata values, tensor
directory and tensor bytes, for the default model and a file holding every metadata value type."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from serval.model_source import default_model_path
from serval.runner.loader.gguf import open_gguf
from serval.runner.loader.gguf_file import GGUFFile
from tests.fixtures.quants import quantize


def _assert_same_as_gguf_reader(path: str) -> None:
    reference = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    expected = {f.name: f.contents() for f in reference.fields.values() if not f.name.startswith("GGUF.")}
    assert ours.metadata.keys() == expected.keys()
    for key, value in expected.items():
        assert ours.metadata[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(n) for n in theirs.shape)
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.n_elements,
            theirs.n_bytes,
            theirs.data_offset,
        )
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8)), mine.name


def test_default_model_reads_as_gguf_reader_reads_it() -> None:
    _assert_same_as_gguf_reader(default_model_path())


def test_every_value_type_and_tensor_type(tmp_path) -> None:
    path = str(tmp_path / "types.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo <|im_start|>")
    writer.add_array("t.strings", ["a", "", "ü" * 3])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    writer.add_tensor("vector", rng.standard_normal(64, dtype=np.float32))
    for qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q6_K):
        values = rng.standard_normal((4, 256), dtype=np.float32)
        writer.add_tensor(qtype.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    _assert_same_as_gguf_reader(path)
    ours = GGUFFile(path)
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.bools"] == [True, False, True]
    assert ours.metadata["t.strings"] == ["a", "", "üüü"]


def test_big_endian_and_unknown_versions_are_named(tmp_path) -> None:
    path = tmp_path / "be.gguf"
    path.write_bytes(b"GGUF" + struct.pack(">I", 3) + bytes(16))
    with pytest.raises(ValueError, match="big-endian"):
        open_gguf(str(path))
    path.write_bytes(b"GGUF" + struct.pack("<I", 7) + bytes(16))
    with pytest.raises(ValueError, match="version 7"):
        open_gguf(str(path))


def test_tensor_past_the_end_is_an_error(tmp_path) -> None:
    path = tmp_path / "short.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("big", np.ones((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    content = path.read_bytes()
    path.write_bytes(content[:-4])  # the last element cut off
    with pytest.raises(ValueError, match="past the end of the file"):
        open_gguf(str(path))
