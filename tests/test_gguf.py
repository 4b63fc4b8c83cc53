"""GGUF reader: valid files (cross-checked with the PyPI `gguf` package), incremental parsing, and
one test per kind of bad input (each must raise a typed GGUFError naming offset and field)."""

import struct
import tracemalloc

import numpy as np
import pytest
from shapes import SMALL_SHAPE

from bitnet_web.convert.synthetic import synthetic_vocab_metadata, write_random_bitnet
from bitnet_web.formats.ggml import (
    GGMLType,
    GGUFError,
    GGUFFormatError,
    GGUFTruncatedError,
    GGUFUnsupportedError,
    GGUFValueType,
)
from bitnet_web.formats.gguf_reader import GGUFFile, describe, open_gguf, parse_header
from bitnet_web.formats.gguf_writer import GGUFWriter, Typed
from bitnet_web.formats.quants import i2s_encode

# --- hand-built files: every byte placed explicitly, independent of our writer ----------------


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, GGUFValueType.UINT32, struct.pack("<I", v))


def tinfo(name: str | bytes, ne: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + struct.pack(f"<I{len(ne)}Q", len(ne), *ne) + struct.pack("<IQ", ggml_type, offset)


def build(
    kvs: list[bytes],
    infos: list[bytes],
    data: bytes = b"",
    *,
    version: int = 3,
    alignment: int = 32,
    magic: bytes = b"GGUF",
) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    pad = -len(head) % alignment
    return head + b"\0" * pad + data


def one_f32_tensor_file(values=(1.0, 2.0, 3.0, 4.0)) -> bytes:
    data = np.array(values, dtype="<f4").tobytes()
    return build(
        [kv("general.architecture", GGUFValueType.STRING, gstr("test"))],
        [tinfo("w", (len(values),), GGMLType.F32, 0)],
        data,
    )


def test_hand_built_file_parses():
    g = GGUFFile.from_buffer(one_f32_tensor_file())
    assert g.version == 3 and g.metadata == {"general.architecture": "test"}
    info = g.tensors["w"]
    assert info.shape == (4,) and info.ggml_type == GGMLType.F32 and info.n_bytes == 16
    assert info.offset == g.data_offset and g.data_offset % 32 == 0
    np.testing.assert_array_equal(g.tensor("w"), [1, 2, 3, 4])


def test_version_2_accepted():
    raw = build([kv_u32("a", 7)], [], version=2)
    assert GGUFFile.from_buffer(raw).version == 2


# --- every metadata type, cross-checked with the gguf package ----------------------------------

ALL_TYPES_METADATA = {
    "u8": Typed(GGUFValueType.UINT8, 200),
    "i8": Typed(GGUFValueType.INT8, -5),
    "u16": Typed(GGUFValueType.UINT16, 60000),
    "i16": Typed(GGUFValueType.INT16, -30000),
    "u32": Typed(GGUFValueType.UINT32, 4_000_000_000),
    "i32": Typed(GGUFValueType.INT32, -2_000_000_000),
    "f32": Typed(GGUFValueType.FLOAT32, 0.5),
    "bool": True,
    "str": "héllo ✓ 世界",
    "u64": Typed(GGUFValueType.UINT64, 2**63 + 5),
    "i64": Typed(GGUFValueType.INT64, -(2**62)),
    "f64": Typed(GGUFValueType.FLOAT64, 1e-300),
    "arr_i32": np.arange(-3, 1000, dtype=np.int32),
    "arr_f32": np.linspace(0, 1, 7, dtype=np.float32),
    "arr_bool": np.array([True, False, True]),
    "arr_str": ["a", "", "ĠHello", "\u00ff\u4e16"],
    "arr_u8": Typed(GGUFValueType.UINT8, [1, 2, 255], True),
    "nested": [[1, 2, 3], [4], []],
    "nested_str": [["x", "y"], ["z"]],
    "empty_str_arr": Typed(GGUFValueType.STRING, [], True),
}


def write_all_types(path) -> None:
    w = GGUFWriter(str(path))
    w.add_dict(ALL_TYPES_METADATA)
    w.write()


def test_every_metadata_type_roundtrip(tmp_path):
    write_all_types(tmp_path / "m.gguf")
    md = open_gguf(str(tmp_path / "m.gguf")).metadata
    assert md["u8"] == 200 and md["i8"] == -5 and md["u16"] == 60000 and md["i16"] == -30000
    assert md["u32"] == 4_000_000_000 and md["i32"] == -2_000_000_000 and md["f32"] == 0.5
    assert md["bool"] is True and md["str"] == "héllo ✓ 世界"
    assert md["u64"] == 2**63 + 5 and md["i64"] == -(2**62) and md["f64"] == 1e-300
    assert isinstance(md["arr_i32"], np.ndarray) and md["arr_i32"].dtype == np.int32
    np.testing.assert_array_equal(md["arr_i32"], np.arange(-3, 1000))
    np.testing.assert_array_equal(md["arr_f32"], np.linspace(0, 1, 7, dtype=np.float32))
    assert md["arr_bool"].tolist() == [True, False, True]
    assert md["arr_str"] == ["a", "", "ĠHello", "\u00ff\u4e16"]
    assert md["arr_u8"].tolist() == [1, 2, 255]
    assert [a.tolist() for a in md["nested"]] == [[1, 2, 3], [4], []]
    assert md["nested_str"] == [["x", "y"], ["z"]]
    assert md["empty_str_arr"] == []


def test_metadata_agrees_with_gguf_package_reader(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    write_all_types(path)
    ours = open_gguf(str(path)).metadata
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith("nested"):
            continue  # the gguf package flattens nested arrays; checked in the roundtrip test
        ref = field.contents()
        got = ours[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == ref, key


def test_file_from_gguf_package_writer(tmp_path):
    """An independent writer: metadata of several types and F32/F16/BF16/Q8_0 tensors."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    path = tmp_path / "ref.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ĉ"])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    w.add_string("tokenizer.chat_template", "{{ x }}")
    a32 = rng.standard_normal((3, 64)).astype(np.float32)
    a16 = rng.standard_normal((5, 32)).astype(np.float16)
    w.add_tensor("a32", a32)
    w.add_tensor("a16", a16)
    bf = gguf.quants.quantize(a32, gguf.GGMLQuantizationType.BF16)
    w.add_tensor("abf16", bf, raw_shape=bf.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    q8 = gguf.quants.quantize(a32, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("aq8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    g = open_gguf(str(path))
    assert g.architecture == "llama" and g.get("{arch}.block_count") == 3
    assert g.metadata["tokenizer.ggml.tokens"] == ["a", "b", "ĉ"]
    np.testing.assert_array_equal(g.metadata["tokenizer.ggml.scores"], [0.5, -1.0, 2.0])
    np.testing.assert_array_equal(g.tensor("a32"), a32)
    np.testing.assert_array_equal(g.tensor("a16"), a16)
    np.testing.assert_array_equal(g.tensor("abf16"), gguf.quants.dequantize(bf, gguf.GGMLQuantizationType.BF16))
    np.testing.assert_array_equal(g.tensor("aq8"), gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
    assert g.tensors["a32"].shape == (3, 64) and g.tensors["aq8"].ggml_type == GGMLType.Q8_0
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        assert g.tensors[t.name].offset == t.data_offset
        assert g.tensors[t.name].n_bytes == t.n_bytes


def test_tensor_bytes_are_zero_copy_views(tmp_path):
    path = tmp_path / "t.gguf"
    path.write_bytes(one_f32_tensor_file())
    g = open_gguf(str(path))
    raw = g.tensor_bytes("w")
    assert np.shares_memory(raw, g.data)
    assert np.shares_memory(g.tensor("w"), g.data)
    buf = np.frombuffer(bytearray(one_f32_tensor_file()), dtype=np.uint8)  # the Pyodide case
    g2 = GGUFFile.from_buffer(buf)
    assert np.shares_memory(g2.tensor_bytes("w"), buf)
    assert np.shares_memory(g2.metadata["general.architecture"] and g2.tensor("w"), buf)


def test_i2s_tq_tensor_sizes_and_decoding(tmp_path):
    rng = np.random.default_rng(1)
    values = rng.integers(-1, 2, size=(4, 256)).astype(np.int8)
    path = tmp_path / "q.gguf"
    w = GGUFWriter(str(path))
    w.add("general.architecture", "test")
    w.add_tensor("i2s", values.shape, GGMLType.I2_S, (values, 0.25))
    w.add_tensor("tq1", values.shape, GGMLType.TQ1_0, values.astype(np.float32) * 0.25)
    w.add_tensor("tq2", values.shape, GGMLType.TQ2_0, values.astype(np.float32) * 0.25)
    w.write()
    g = open_gguf(str(path))
    assert g.tensors["i2s"].n_bytes == 1024 // 4 + 32
    assert g.tensors["tq1"].n_bytes == 4 * 54 and g.tensors["tq2"].n_bytes == 4 * 66
    for name in ("i2s", "tq1", "tq2"):
        v, s = g.ternary(name)
        np.testing.assert_array_equal(v, values)
        assert s == 0.25
        np.testing.assert_array_equal(g.tensor(name), values * np.float32(0.25))


def test_custom_alignment(tmp_path):
    path = tmp_path / "a.gguf"
    w = GGUFWriter(str(path), alignment=64)
    w.add_tensor("x", (3,), GGMLType.F32, np.ones(3))
    w.add_tensor("y", (5,), GGMLType.F16, np.arange(5))
    w.write()
    g = open_gguf(str(path))
    assert g.alignment == 64 and g.data_offset % 64 == 0
    assert all(t.offset % 64 == 0 for t in g.tensors.values())
    np.testing.assert_array_equal(g.tensor("y"), np.arange(5))


# --- incremental parsing -----------------------------------------------------------------------


def test_parse_header_incremental(tmp_path):
    path = tmp_path / "m.gguf"
    write_random_bitnet(str(path), **SMALL_SHAPE)
    data = path.read_bytes()
    full = open_gguf(str(path))
    for total in (len(data), None):
        for cut in list(range(0, full.header_size, 97)) + [full.header_size - 1]:
            assert parse_header(data[:cut], total) is None, cut
        g = parse_header(data[: full.header_size], total)
        assert g is not None and g.header_size == full.header_size
        assert g.metadata.keys() == full.metadata.keys()
        assert g.metadata["tokenizer.ggml.tokens"] == full.metadata["tokenizer.ggml.tokens"]
        assert g.tensors == full.tensors
        assert "bitnet-b1.58" in describe(g)
        with pytest.raises(GGUFTruncatedError, match="not loaded"):
            g.tensor_bytes("token_embd.weight")
    g = parse_header(np.frombuffer(data, dtype=np.uint8), len(data))
    np.testing.assert_array_equal(g.tensor("output_norm.weight"), full.tensor("output_norm.weight"))


def test_parse_header_rejects_lies_early_when_total_size_known():
    raw = build([kv("tokenizer.ggml.tokens", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.STRING, 10**9))], [])
    with pytest.raises(GGUFFormatError, match="claims 1000000000 elements"):
        parse_header(raw, total_size=100_000)
    assert parse_header(raw, total_size=None) is None  # unknown size: wait for more bytes


# --- bad input: one test each ---------------------------------------------------------------


def test_empty_and_truncated_header():
    raw = build([kv_u32("general.alignment", 32), kv("k", GGUFValueType.STRING, gstr("value"))], [], alignment=1)
    for cut in (0, 3, 10, 30, len(raw) - 2):
        with pytest.raises(GGUFTruncatedError, match="byte offset"):
            GGUFFile.from_buffer(raw[:cut])


def test_truncated_file_names_field(tmp_path):
    raw = build([kv("general.name", GGUFValueType.STRING, gstr("abcdefgh"))], [])
    path = tmp_path / "t.gguf"
    path.write_bytes(raw[:-4])
    with pytest.raises(GGUFTruncatedError, match=r"t\.gguf.*'general\.name' at byte offset 48"):
        open_gguf(str(path))


def test_empty_file(tmp_path):
    path = tmp_path / "e.gguf"
    path.write_bytes(b"")
    with pytest.raises(GGUFTruncatedError, match="empty"):
        open_gguf(str(path))


def test_wrong_magic():
    with pytest.raises(GGUFFormatError, match="bad magic b'GGML' at byte offset 0"):
        GGUFFile.from_buffer(build([], [], magic=b"GGML"))


def test_version_1_rejected():
    with pytest.raises(GGUFUnsupportedError, match="version 1"):
        GGUFFile.from_buffer(build([], [], version=1))


def test_unknown_version():
    with pytest.raises(GGUFUnsupportedError, match="unknown GGUF version 4 at byte offset 4"):
        GGUFFile.from_buffer(build([], [], version=4))


def test_absurd_array_length_rejected_before_allocating():
    raw = build(
        [kv("tokenizer.ggml.scores", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.FLOAT32, 2**61))], []
    )
    tracemalloc.start()
    with pytest.raises(GGUFFormatError, match=r"'tokenizer\.ggml\.scores' at byte offset \d+ claims"):
        GGUFFile.from_buffer(raw)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20


def test_absurd_string_array_length():
    raw = build(
        [kv("tokenizer.ggml.tokens", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.STRING, 10**12))], []
    )
    with pytest.raises(GGUFFormatError, match="claims 1000000000000 elements"):
        GGUFFile.from_buffer(raw)


def test_absurd_string_length():
    raw = build([kv("general.name", GGUFValueType.STRING, struct.pack("<Q", 2**40) + b"abc")], [])
    with pytest.raises(GGUFFormatError, match=r"string length of 'general\.name' at byte offset \d+ claims"):
        GGUFFile.from_buffer(raw)


def test_absurd_tensor_count():
    raw = b"GGUF" + struct.pack("<IQQ", 3, 2**50, 0) + b"\0" * 64
    with pytest.raises(GGUFFormatError, match="tensor count at byte offset 8 claims"):
        GGUFFile.from_buffer(raw)


def test_absurd_kv_count():
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40) + b"\0" * 64
    with pytest.raises(GGUFFormatError, match="key-value count at byte offset 16 claims"):
        GGUFFile.from_buffer(raw)


def test_tensor_data_past_end_of_file():
    raw = one_f32_tensor_file()
    with pytest.raises(GGUFFormatError, match=r"tensor 'w' data .* extends past the end of the file"):
        GGUFFile.from_buffer(raw[:-4])


def test_overlapping_tensors():
    data = np.zeros(16, dtype="<f4").tobytes()
    raw = build([], [tinfo("a", (8,), GGMLType.F32, 0), tinfo("b", (8,), GGMLType.F32, 0)], data)
    with pytest.raises(GGUFFormatError, match="'a' .* and 'b' .* overlap"):
        GGUFFile.from_buffer(raw)


def test_misaligned_tensor_offset():
    raw = build([], [tinfo("a", (8,), GGMLType.F32, 4)], b"\0" * 64)
    with pytest.raises(GGUFFormatError, match=r"tensor 'a': data offset 4 \(field at byte offset \d+\).*alignment 32"):
        GGUFFile.from_buffer(raw)


def test_bad_alignment_value():
    raw = build([kv_u32("general.alignment", 24)], [])
    with pytest.raises(GGUFFormatError, match="general.alignment 24 is not a positive power of two"):
        GGUFFile.from_buffer(raw)


def test_duplicate_tensor_names():
    raw = build([], [tinfo("a", (8,), GGMLType.F32, 0), tinfo("a", (8,), GGMLType.F32, 32)], b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="duplicate tensor name 'a' at byte offset"):
        GGUFFile.from_buffer(raw)


def test_duplicate_metadata_keys():
    raw = build([kv_u32("k", 1), kv_u32("k", 2)], [])
    with pytest.raises(GGUFFormatError, match="duplicate metadata key 'k' at byte offset"):
        GGUFFile.from_buffer(raw)


def test_unsupported_tensor_type_names_tensor_and_id():
    raw = build([], [tinfo("blk.0.attn_q.weight", (32,), 2, 0)], b"\0" * 64)  # 2 = Q4_0
    with pytest.raises(GGUFUnsupportedError, match=r"'blk\.0\.attn_q\.weight' has GGML type id 2"):
        GGUFFile.from_buffer(raw)
    raw = build([], [tinfo("x", (32,), 39, 0)], b"\0" * 64)
    with pytest.raises(GGUFUnsupportedError, match="type id 39"):
        GGUFFile.from_buffer(raw)


def test_unknown_value_type():
    raw = build([kv("k", 13, b"\0" * 8)], [])
    with pytest.raises(GGUFFormatError, match="'k' at byte offset \\d+ has unknown value type 13"):
        GGUFFile.from_buffer(raw)


def test_bad_bool():
    raw = build([kv("k", GGUFValueType.BOOL, b"\x02")], [])
    with pytest.raises(GGUFFormatError, match="bool"):
        GGUFFile.from_buffer(raw)


def test_non_utf8_string_value():
    raw = build([kv("general.name", GGUFValueType.STRING, gstr(b"ab\xff"))], [])
    offset = raw.index(b"ab\xff") + 2
    with pytest.raises(GGUFFormatError, match=rf"'general\.name' at byte offset {offset} is not valid UTF-8"):
        GGUFFile.from_buffer(raw)


def test_non_utf8_key_and_tensor_name_and_array_element():
    with pytest.raises(GGUFFormatError, match="metadata key #0 at byte offset 32 is not valid UTF-8"):
        GGUFFile.from_buffer(build([kv(b"\xc3", GGUFValueType.UINT32, b"\0" * 4)], []))
    with pytest.raises(GGUFFormatError, match="tensor #0 name .* not valid UTF-8"):
        GGUFFile.from_buffer(build([], [tinfo(b"\xe2\x82", (4,), GGMLType.F32, 0)], b"\0" * 32))
    arr = struct.pack("<IQ", GGUFValueType.STRING, 2) + gstr("ok") + gstr(b"\x80")
    with pytest.raises(GGUFFormatError, match=r"'tokenizer\.ggml\.tokens'\[1\] at byte offset \d+ is not valid"):
        GGUFFile.from_buffer(build([kv("tokenizer.ggml.tokens", GGUFValueType.ARRAY, arr)], []))


def test_bad_n_dims_and_block_multiple():
    raw = build([], [gstr("a") + struct.pack("<I", 5) + b"\0" * 60], b"")
    with pytest.raises(GGUFFormatError, match="n_dims 5"):
        GGUFFile.from_buffer(raw)
    raw = build([], [tinfo("q", (48,), GGMLType.Q8_0, 0)], b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="row length 48 is not a multiple of the block size 32"):
        GGUFFile.from_buffer(raw)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_inf_i2s_scale_found_on_validation(bad):
    raw_t = i2s_encode(np.ones(128, dtype=np.int8), 1.0)
    raw_t[32:36] = np.array([bad], dtype="<f4").view(np.uint8)
    raw = build([], [tinfo("blk.0.ffn_up.weight", (128,), GGMLType.I2_S, 0)], raw_t.tobytes())
    g = GGUFFile.from_buffer(raw)  # header parsing does not touch tensor data
    where = rf"tensor 'blk\.0\.ffn_up\.weight' at byte offset {g.data_offset}: I2_S scale"
    with pytest.raises(GGUFFormatError, match=where):
        g.validate_tensors()
    with pytest.raises(GGUFError, match="scale"):
        g.ternary("blk.0.ffn_up.weight")


# --- describe ----------------------------------------------------------------------------------


def test_describe_vocab_only(tmp_path):
    path = tmp_path / "vocab.gguf"
    w = GGUFWriter(str(path))
    w.add("general.architecture", "llama")
    w.add_dict(synthetic_vocab_metadata(1000))
    w.write()
    g = open_gguf(str(path))
    assert g.tensors == {}
    text = describe(g)
    assert "tensors: 0" in text and "tokenizer: gpt2, vocab 1000" in text
    assert "bos 997 '<|begin_of_text|>'" in text and "chat template" in text


def test_describe_model(tmp_path):
    path = tmp_path / "m.gguf"
    write_random_bitnet(str(path), dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=300)
    text = describe(open_gguf(str(path)))
    assert "architecture: bitnet-b1.58" in text and "block_count: 2" in text
    assert "I2_S      14 tensors" in text and "F32        9 tensors" in text
    assert "tied to token_embd" in text


# --- byte order and general.alignment's type, as gguf-py sees them --------------------------


def _gguf_py_file(path, *, big_endian: bool = False, alignment=None) -> None:
    gguf = pytest.importorskip("gguf")
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), "test", endianess=endian)
    if alignment is not None:
        value, vtype = alignment
        w.add_key_value("general.alignment", value, vtype)
    w.add_tensor("t", np.arange(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_big_endian_file_is_named_as_such(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "be.gguf"
    _gguf_py_file(path, big_endian=True)
    assert gguf.GGUFReader(str(path)).endianess == gguf.GGUFEndian.BIG  # the reference reads it as big-endian
    with pytest.raises(GGUFUnsupportedError, match="big-endian GGUF .*version 3.* is not supported"):
        open_gguf(str(path))


@pytest.mark.parametrize("vtype_name", ["UINT32", "UINT64", "INT32", "UINT16", "FLOAT32"])
def test_alignment_of_another_type_is_rejected_like_gguf_py(tmp_path, vtype_name):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "a.gguf"
    value = 32.0 if vtype_name == "FLOAT32" else 32  # the writer pads to 32 whatever the key says
    _gguf_py_file(path, alignment=(value, getattr(gguf.GGUFValueType, vtype_name)))
    try:
        gguf.GGUFReader(str(path))
        reference_ok = True
    except ValueError:
        reference_ok = False
    assert reference_ok == (vtype_name == "UINT32")
    if reference_ok:
        assert open_gguf(str(path)).alignment == 32
    else:
        with pytest.raises(GGUFFormatError, match="general.alignment .*value type .*expected 4, UINT32"):
            open_gguf(str(path))


def test_describe_names_the_file_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    from bitnet_web.formats.gguf_reader import FILE_TYPE_NAMES

    # Upstream names agree with gguf-py up to TQ2_0; 40 is bitnet.cpp's I2_S (the 2B-4T file's value).
    for ft in gguf.LlamaFileType:
        if ft.value <= 37 and ft.name != "GUESSED":
            assert FILE_TYPE_NAMES[ft.value] == ft.name
    path = tmp_path / "m.gguf"
    write_random_bitnet(str(path), dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=300)
    text = describe(open_gguf(str(path)))
    assert "file_type: 40 (MOSTLY_I2_S, bitnet.cpp" in text
