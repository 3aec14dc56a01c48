"""Wire format: every message type round-trips, tensors travel zero-copy, bad frames are WireErrors."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from mmcache.shared import messages as M
from mmcache.shared import wire
from mmcache.shared.wire import PROTOCOL_VERSION, WireError, decode, encode

# --- helpers ---------------------------------------------------------------------------


def _registered() -> list[type]:
    """Every message type defined in shared.messages (the protocol's public surface)."""
    return [
        obj
        for obj in vars(M).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == M.__name__
        and wire._REGISTRY.get(obj.__name__) is obj
    ]


def _sample(hint: Any, seed: int) -> Any:
    """A non-default value of type ``hint`` (so a dropped field cannot pass unnoticed)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)), seed)
    if origin is list:
        return [_sample(args[0], seed + i) for i in range(2)]
    if origin is tuple:
        return tuple(_sample(a, seed + i) for i, a in enumerate(args))
    if origin is dict or hint is dict:
        return {"k": seed, "nested": {"x": [1, 2.5, "s", b"\x00b"]}}
    if hint is torch.Tensor:
        return torch.arange(6, dtype=torch.float32).reshape(2, 3) + seed
    if hint is bool:
        return True
    if hint is int:
        return 1000 + seed
    if hint is float:
        return 0.25 + seed
    if hint is str:
        return f"s{seed}-é"
    if hint is bytes or getattr(hint, "__supertype__", None) is bytes:  # bytes, or a NewType of it
        return bytes([seed % 256, 0, 255]) + b"key"
    if dataclasses.is_dataclass(hint):
        return _instance(hint, seed)
    raise AssertionError(f"no sample for {hint!r}")


def _instance(cls: type, seed: int = 1) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name], seed + i) for i, f in enumerate(dataclasses.fields(cls))})


def _assert_same(got: Any, want: Any, strict_sequences: bool = False) -> None:
    """Deep equality that understands tensors (dtype, shape and values)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want)
        for f in dataclasses.fields(want):
            _assert_same(getattr(got, f.name), getattr(want, f.name), strict_sequences)
    elif isinstance(want, (list, tuple)):
        if strict_sequences:
            assert type(got) is type(want), f"{type(got).__name__} != {type(want).__name__}"
        assert isinstance(got, (list, tuple)) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w, strict_sequences)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for k in want:
            _assert_same(got[k], want[k], strict_sequences)
    else:
        assert type(got) is type(want) and got == want


def _roundtrip(msg: Any, env: dict | None = None) -> tuple[Any, dict]:
    return decode(encode(msg, env))


def _header(frames: list[Any]) -> dict:
    return msgpack.unpackb(frames[1], raw=False, strict_map_key=False)


def _with_header(frames: list[Any], header: dict) -> list[Any]:
    return [frames[0], msgpack.packb(header, use_bin_type=True), *frames[2:]]


# --- round trips -----------------------------------------------------------------------


def test_messages_module_defines_the_expected_core_types():
    names = {cls.__name__ for cls in _registered()}
    assert {"Ping", "Pong", "ErrorReply", "EncodeItem", "EncodeRequest", "MediaSpan", "Abort"} <= names
    assert {"SamplingParams", "GenerateRequest", "GenerateReply"} <= names


@pytest.mark.parametrize("cls", _registered(), ids=lambda c: c.__name__)
def test_every_message_type_round_trips(cls):
    msg = _instance(cls)
    got, env = _roundtrip(msg, {"rid": 42, "final": False})
    _assert_same(got, msg)
    assert env == {"rid": 42, "final": False}


@pytest.mark.parametrize("cls", _registered(), ids=lambda c: c.__name__)
def test_default_fields_round_trip(cls):
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    hints = typing.get_type_hints(cls)
    msg = cls(**{name: _sample(hints[name], 3) for name in required})
    got, env = _roundtrip(msg)
    _assert_same(got, msg)
    assert env == {}


def test_nested_encode_items_keep_their_own_tensors():
    items = [
        M.EncodeItem(b"k0", "image", torch.randint(0, 256, (1, 3, 28, 28), dtype=torch.uint8)),
        M.EncodeItem(b"k1", "video", torch.randint(0, 256, (2, 3, 56, 28), dtype=torch.uint8)),
        M.EncodeItem(b"k2", "video", torch.zeros((2, 3, 28, 56), dtype=torch.uint8)),
    ]
    msg = M.EncodeRequest(items=items)
    frames = encode(msg)
    assert len(frames) == 2 + len(items)  # type, header, one frame per tensor
    got, _ = decode(frames)
    assert [type(i) for i in got.items] == [M.EncodeItem] * 3
    _assert_same(got, msg)


def test_generate_request_with_nested_spans_and_sampling():
    spans = [
        M.MediaSpan(3, "image", (1, 8, 12), [b"a" * 16]),
        M.MediaSpan(40, "video", (3, 4, 4), [b"b" * 16, b"c" * 16, b"d" * 16], seconds_per_chunk=2 / 3),
    ]
    sampling = M.SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=50, seed=7, stop_token_ids=[5]
    )
    hints = typing.get_type_hints(M.GenerateRequest)
    fields = {f.name: _sample(hints[f.name], 1) for f in dataclasses.fields(M.GenerateRequest)}
    fields.update(
        prompt_token_ids=torch.arange(64, dtype=torch.int32), spans=spans, sampling=sampling, salt=None
    )
    msg = M.GenerateRequest(**fields)
    got, _ = _roundtrip(msg)
    _assert_same(got, msg)
    assert got.spans[1].num_tokens == 12 and got.spans[1].seconds_per_chunk == 2 / 3
    assert got.sampling.seed == 7 and got.salt is None


def test_decoded_message_equals_the_original():
    """A decoded message must be *equal* to the one sent: tuple fields such as
    MediaSpan.grid_thw must not come back as lists."""
    span = M.MediaSpan(offset=5, modality="image", grid_thw=(1, 4, 6), chunk_keys=[b"k" * 16])
    got, _ = _roundtrip(span)
    assert got == span
    assert isinstance(got.grid_thw, tuple)


TENSOR_CASES = {
    "fp32": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
    "fp16": torch.randn(4, 2, generator=torch.Generator().manual_seed(1)).half(),
    "bf16": torch.randn(7, 3, generator=torch.Generator().manual_seed(2)).bfloat16(),
    "uint8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
    "int32": torch.tensor([[-(2**31), 2**31 - 1], [0, -1]], dtype=torch.int32),
    "int64": torch.tensor([-(2**63), 2**63 - 1, 3], dtype=torch.int64),
    "bool": torch.tensor([True, False, True]),
    "empty_1d": torch.empty(0, dtype=torch.float32),
    "empty_2d": torch.empty(0, 128, dtype=torch.bfloat16),
    "empty_mid": torch.empty(3, 0, 2, dtype=torch.int32),
    "scalar_fp32": torch.tensor(3.5),
    "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
    "scalar_int32": torch.tensor(7, dtype=torch.int32),
    "non_contiguous": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    "sliced": torch.arange(40, dtype=torch.int32).reshape(8, 5)[2:6, 1:4],
}


@pytest.mark.parametrize("name", list(TENSOR_CASES))
def test_tensor_round_trip(name):
    t = TENSOR_CASES[name]
    got, _ = _roundtrip(M.EncodeItem(b"", "image", t))
    out = got.pixels
    assert out.dtype == t.dtype
    assert out.shape == t.shape
    assert torch.equal(out, t)


def test_bf16_bits_are_preserved_exactly():
    # +0, -0, +inf, -inf, a NaN payload, the smallest subnormal, 1.0
    raw = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80], dtype=np.uint16)
    bits = torch.from_numpy(raw.view(np.int16))
    t = bits.view(torch.bfloat16)
    got, _ = _roundtrip(M.EncodeItem(b"k", "image", t))
    assert torch.equal(got.pixels.view(torch.int16), bits)


# --- zero copy --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int32, torch.float16])
def test_encoded_tensor_frame_shares_memory_with_the_tensor(dtype):
    t = (torch.arange(4096) % 251).to(dtype).reshape(64, 64)
    frames = encode(M.EncodeItem(b"k", "image", t))
    assert len(frames) == 3
    frame = np.asarray(frames[2])
    assert frame.nbytes == t.numel() * t.element_size()
    # The frame is a view of the tensor's storage, not a copy.
    assert np.shares_memory(frame, t.view(torch.uint8).numpy())
    assert frame.ctypes.data == t.data_ptr()


def test_decoded_tensor_is_a_view_of_the_received_frame():
    t = torch.arange(1000, dtype=torch.float32)
    frames = encode(M.EncodeItem(b"k", "image", t))
    received = bytearray(np.asarray(frames[2]).tobytes())  # what a socket would hand us
    got, _ = decode([frames[0], frames[1], received])
    assert got.pixels.data_ptr() == np.frombuffer(received, dtype=np.uint8).ctypes.data
    assert torch.equal(got.pixels, t)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_frames_may_be_memoryviews_or_bytes():
    t = torch.arange(10, dtype=torch.int32)
    frames = encode(M.EncodeItem(b"k", "image", t), {"rid": 3})
    as_bytes = [bytes(frames[0]), bytes(frames[1]), np.asarray(frames[2]).tobytes()]
    as_views = [memoryview(b) for b in as_bytes]
    for variant in (as_bytes, as_views):
        got, env = decode(variant)
        assert torch.equal(got.pixels, t) and env == {"rid": 3}


# --- encode refuses -----------------------------------------------------------------------


def test_encode_refuses_unregistered_types():
    @dataclasses.dataclass
    class NotRegistered:
        x: int

    with pytest.raises(TypeError):
        encode(NotRegistered(1))
    with pytest.raises(TypeError):
        encode({"a": 1})


def test_encode_refuses_unsupported_tensor_dtype():
    with pytest.raises(TypeError):
        encode(M.EncodeItem(b"k", "image", torch.zeros(2, dtype=torch.complex64)))


def test_message_decorator_rejects_non_dataclasses_and_duplicate_names():
    with pytest.raises(TypeError):
        wire.message(type("Plain", (), {}))
    dup = dataclasses.make_dataclass("Ping", [("x", int)])
    with pytest.raises(TypeError):
        wire.message(dup)


# --- decode refuses ------------------------------------------------------------------------


def _tensor_frames() -> list[Any]:
    return encode(
        M.EncodeItem(b"key", "image", torch.arange(12, dtype=torch.float32).reshape(3, 4)), {"rid": 1}
    )


def test_decode_rejects_unknown_type():
    frames = encode(M.Ping())
    with pytest.raises(WireError):
        decode([b"NoSuchMessage", frames[1]])
    with pytest.raises(WireError):
        decode([b"\xff\xfe", frames[1]])


def test_decode_rejects_wrong_version():
    frames = encode(M.Ping())
    header = _header(frames)
    assert header["v"] == PROTOCOL_VERSION
    for version in (PROTOCOL_VERSION + 1, 0, None, "1"):
        header["v"] = version
        with pytest.raises(WireError):
            decode(_with_header(frames, header))
    del header["v"]
    with pytest.raises(WireError):
        decode(_with_header(frames, header))


def test_decode_rejects_too_few_frames_and_garbage_headers():
    with pytest.raises(WireError):
        decode([])
    with pytest.raises(WireError):
        decode([b"Ping"])
    for garbage in (b"", b"\xc1", b"\x92\x01", msgpack.packb([1, 2, 3]), msgpack.packb("text")):
        with pytest.raises(WireError):
            decode([b"Ping", garbage])


def test_decode_rejects_body_of_another_type():
    frames = encode(M.Ping())
    with pytest.raises(WireError):
        decode([b"Pong", frames[1]])


def test_decode_rejects_unknown_nested_type_and_bad_fields():
    frames = encode(M.Abort(request_id=3))
    header = _header(frames)
    header["body"]["__dc__"] = "NoSuchMessage"
    with pytest.raises(WireError):
        decode(_with_header(frames, header))
    header = _header(frames)
    header["body"]["unexpected_field"] = 1
    with pytest.raises(WireError):
        decode(_with_header(frames, header))


def test_decode_rejects_truncated_tensor_frame():
    frames = _tensor_frames()
    raw = np.asarray(frames[2]).tobytes()
    for cut in (raw[:-1], raw[:-4], raw[:0], raw + b"\x00"):
        with pytest.raises(WireError):
            decode([frames[0], frames[1], cut])


def test_decode_rejects_missing_tensor_frame():
    frames = _tensor_frames()
    with pytest.raises(WireError):
        decode(frames[:2])


@pytest.mark.parametrize("index", [0, 1, 3, 99, -1, "2", None, 2.0])
def test_decode_rejects_bad_tensor_index(index):
    frames = _tensor_frames()
    header = _header(frames)
    ref = header["body"]["pixels"]["__t__"]
    assert ref[2] == 2
    ref[2] = index
    with pytest.raises(WireError):
        decode(_with_header(frames, header))


@pytest.mark.parametrize("dtype", ["complex64", "float64", "", 5, None])
def test_decode_rejects_bad_tensor_dtype(dtype):
    frames = _tensor_frames()
    header = _header(frames)
    header["body"]["pixels"]["__t__"][0] = dtype
    with pytest.raises(WireError):
        decode(_with_header(frames, header))


@pytest.mark.parametrize("shape", [[4, 3, 2], [-3, -4], [-12], [12, -1], [-1, 0], "ab", [1.5, 8], None])
def test_decode_rejects_bad_tensor_shape(shape):
    """Only a list of non-negative ints whose product matches the frame is a shape; anything else must
    be a WireError (never a RuntimeError from torch, which a server loop would not expect)."""
    frames = _tensor_frames()
    header = _header(frames)
    header["body"]["pixels"]["__t__"][1] = shape
    with pytest.raises(WireError):
        decode(_with_header(frames, header))
