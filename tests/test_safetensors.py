"""The numpy safetensors reader against the PyPI `safetensors` package (the reference implementation).

Good files are written by the reference (numpy and torch front ends, and huggingface_hub's sharding)
and must read back identically, as views of the one buffer. Bad files are built byte by byte; each
must raise SafetensorsError naming what is wrong, and the reference must reject the same bytes (so
the test is about inputs that really are invalid).
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from bitnet_web.formats.safetensors import (
    SafetensorsError,
    SafetensorsFile,
    ShardedSafetensors,
    open_safetensors,
    parse_index,
)

NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
SHAPES = [(), (0, 3), (7,), (3, 5), (2, 3, 4)]


def _random(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(rng.integers(0, 2, size=shape)).astype(bool)
    if dtype.kind == "f":
        return np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    info = np.iinfo(dtype)
    return np.asarray(rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True))


@pytest.fixture(scope="module")
def numpy_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {
        f"{name}.{i}": _random(rng, dtype, shape)
        for name, dtype in NUMPY_DTYPES.items()
        for i, shape in enumerate(SHAPES)
    }
    path = tmp_path_factory.mktemp("st") / "all.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "np", "note": "ünïcode"})
    return path


def test_every_numpy_dtype_matches_reference(numpy_file):
    ours = open_safetensors(str(numpy_file))
    theirs = safetensors.numpy.load_file(str(numpy_file))
    assert sorted(ours.keys()) == sorted(theirs)
    assert ours.metadata == {"format": "np", "note": "ünïcode"}
    for name, expected in theirs.items():
        got = ours.array(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
        assert ours.shape(name) == expected.shape
        assert ours.dtype(name) == name.split(".")[0]
        if got.size:
            assert np.shares_memory(got, ours.data), f"{name} is a copy, not a view"
        if expected.dtype.kind in "fiu":
            np.testing.assert_array_equal(ours.float32(name), expected.astype(np.float32))


def test_from_buffer_equals_memmap(numpy_file):
    data = numpy_file.read_bytes()
    buffer = np.frombuffer(data, dtype=np.uint8)
    ours = SafetensorsFile.from_buffer(buffer, "downloaded")
    mapped = open_safetensors(str(numpy_file))
    for name in mapped:
        np.testing.assert_array_equal(ours.array(name), mapped.array(name))
        assert ours.tensors[name] == mapped.tensors[name]
        if ours.array(name).size:
            assert np.shares_memory(ours.array(name), buffer)
    # The loaded dict from raw bytes matches the reference's `load` on the same bytes.
    theirs = safetensors.numpy.load(data)
    assert sorted(theirs) == sorted(ours.keys())


def test_bf16_and_torch_dtypes_match_reference(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(1)
    tensors = {
        "bf16": (torch.randn(33, 17, generator=gen) * 50).to(torch.bfloat16),
        "bf16_special": torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, 3.0e38], dtype=torch.bfloat16),
        "f16": torch.randn(5, 8, generator=gen).half(),
        "u8": torch.randint(0, 256, (64, 16), generator=gen, dtype=torch.uint8),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"))
    ours = open_safetensors(str(tmp_path / "t.safetensors"))
    theirs = load_file(str(tmp_path / "t.safetensors"))
    for name, expected in theirs.items():
        np.testing.assert_array_equal(ours.float32(name), expected.float().numpy(), err_msg=name)
    bits = theirs["bf16"].view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours.array("bf16"), bits)
    assert ours.dtype("bf16") == "BF16" and ours.shape("bf16") == (33, 17)


def test_sharded_checkpoint_from_huggingface_hub(tmp_path):
    torch = pytest.importorskip("torch")
    hub = pytest.importorskip("huggingface_hub")
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(2)
    state = {f"layer.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(6)}
    state["packed"] = torch.randint(0, 170, (16, 64), generator=gen, dtype=torch.uint8)
    hub.save_torch_state_dict(state, str(tmp_path), max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    weight_map = parse_index(index)
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1, "the test needs several shards"
    checkpoint = ShardedSafetensors({s: open_safetensors(str(tmp_path / s)) for s in shards}, weight_map)
    assert sorted(checkpoint) == sorted(state)
    for shard in shards:
        for name, expected in load_file(str(tmp_path / shard)).items():
            assert checkpoint.file(name).source.endswith(shard)
            np.testing.assert_array_equal(checkpoint.file(name).float32(name), expected.float().numpy())


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _file(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD = {"a": _entry("F32", [2], 0, 8), "b": _entry("U8", [4], 8, 12)}

BAD_FILES = {
    # name: (bytes, regex the message must match)
    "too_short": (b"\x01\x00", r"too short .* byte offset 0"),
    "header_past_eof": (_file(GOOD, bytes(12), length=500), r"header length 500 .*runs past the end"),
    "header_absurd": (_file(GOOD, bytes(12), length=1 << 40), r"header length 1099511627776 .*absurd"),
    "not_utf8": (_file(b'{"a": "\xff\xfe"}'), r"not valid UTF-8 at byte offset 15"),
    "not_json": (_file(b'{"a": [1, 2'), r"not JSON at byte offset \d+"),
    "not_object": (_file(b"[1, 2]"), r"JSON list, expected an object"),
    "unknown_dtype": (_file({"a": _entry("Q4", [2], 0, 1)}, bytes(1)), r"tensor 'a' has unknown dtype 'Q4'"),
    "negative_shape": (_file({"a": _entry("U8", [-1], 0, 1)}, bytes(1)), r"tensor 'a': shape \[-1\]"),
    "bad_offsets": (_file({"a": _entry("U8", [1], 4, 2)}, bytes(4)), r"tensor 'a': data_offsets \[4, 2\]"),
    "size_mismatch": (
        _file({"a": _entry("F32", [3], 0, 8)}, bytes(8)),
        r"tensor 'a': data_offsets 0\.\.8 hold 8 bytes, but shape \[3\] of F32 needs 12",
    ),
    "past_end": (_file(GOOD, bytes(10)), r"tensor 'b' data \(bytes \d+\.\.\d+\) runs past the end of"),
    "overlap": (
        _file({"a": _entry("F32", [2], 0, 8), "b": _entry("U8", [4], 6, 10)}, bytes(10)),
        r"tensor 'b' \(bytes \d+\.\.\d+\) overlaps tensor 'a'",
    ),
    "hole": (
        _file({"a": _entry("F32", [2], 0, 8), "b": _entry("U8", [4], 10, 14)}, bytes(14)),
        r"bytes \d+\.\.\d+ before tensor 'b' belong to no tensor",
    ),
    "trailing": (_file(GOOD, bytes(20)), r"at the end of the file belong to no tensor"),
    "bad_metadata": (_file({"__metadata__": {"k": 1}, **GOOD}, bytes(12)), r"__metadata__"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_raises_typed_error(case, tmp_path):
    data, pattern = BAD_FILES[case]
    with pytest.raises(SafetensorsError, match=pattern) as info:
        SafetensorsFile.from_buffer(data, "bad.safetensors")
    assert str(info.value).startswith("bad.safetensors: ")
    # The reference rejects the same bytes.
    with pytest.raises(Exception):  # noqa: B017  (its error types differ between versions)
        safetensors.numpy.load(data)


def test_good_template_is_valid():
    """The hand-built template of BAD_FILES is itself a valid file (for both readers)."""
    data = _file(GOOD, np.array([1.5, -2], "<f4").tobytes() + bytes([1, 2, 3, 4]))
    ours = SafetensorsFile.from_buffer(data)
    theirs = safetensors.numpy.load(data)
    np.testing.assert_array_equal(ours.array("a"), theirs["a"])
    np.testing.assert_array_equal(ours.array("b"), theirs["b"])


def test_duplicate_tensor_name():
    body = (
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
        b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    )
    with pytest.raises(SafetensorsError, match="duplicate key 'a'"):
        SafetensorsFile.from_buffer(_file(body, bytes(1)))


def test_opaque_dtype_is_sized_but_not_read():
    st = SafetensorsFile.from_buffer(_file({"f8": _entry("F8_E4M3", [4], 0, 4)}, bytes(4)))
    assert st.raw_bytes("f8").tolist() == [0, 0, 0, 0]
    with pytest.raises(SafetensorsError, match="F8_E4M3"):
        st.array("f8")


def test_missing_tensor_and_empty_file(tmp_path):
    st = SafetensorsFile.from_buffer(_file(GOOD, bytes(12)), "x.safetensors")
    with pytest.raises(SafetensorsError, match="x.safetensors: no tensor named 'c'"):
        st.array("c")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(SafetensorsError, match="empty"):
        open_safetensors(str(tmp_path / "empty.safetensors"))


def _shard(names: list[str]) -> SafetensorsFile:
    header = {n: _entry("U8", [1], i, i + 1) for i, n in enumerate(names)}
    return SafetensorsFile.from_buffer(_file(header, bytes(len(names))), "shard")


def test_bad_indexes():
    with pytest.raises(SafetensorsError, match="not JSON"):
        parse_index("{", "idx.json")
    with pytest.raises(SafetensorsError, match="no 'weight_map'"):
        parse_index({"metadata": {}}, "idx.json")
    with pytest.raises(SafetensorsError, match="not a file name in the same folder"):
        parse_index({"weight_map": {"a": "../a.safetensors"}}, "idx.json")
    shards = {"s1": _shard(["a", "b"]), "s2": _shard(["c"])}
    with pytest.raises(SafetensorsError, match="tensor 'c' is missing from this shard, where idx.json says"):
        ShardedSafetensors(shards, {"a": "s1", "b": "s1", "c": "s1"}, "idx.json")
    with pytest.raises(SafetensorsError, match="tensor 'c' is in shard 's3', which is missing"):
        ShardedSafetensors(shards, {"a": "s1", "b": "s1", "c": "s3"}, "idx.json")
    with pytest.raises(SafetensorsError, match="tensor 'b' is not listed for this shard"):
        ShardedSafetensors(shards, {"a": "s1", "c": "s2"}, "idx.json")
    with pytest.raises(SafetensorsError, match="tensor 'a' is in both"):
        ShardedSafetensors({"s1": _shard(["a"]), "s2": _shard(["a"])})
    ok = ShardedSafetensors(shards, {"a": "s1", "b": "s1", "c": "s2"})
    assert ok.file("c") is shards["s2"]
    with pytest.raises(SafetensorsError, match="no tensor 'z'"):
        ok.file("z")
