"""Wire format: ``[type name, msgpack header, *raw buffers]``.

Messages are dataclasses registered with :func:`message`. Tensors inside a
message travel as ``{"__t__": [dtype, shape, frame index]}`` in the header and
their bytes as a separate frame, handed to ZeroMQ without a copy. Nested
registered dataclasses travel as ``{"__dc__": name, ...fields}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgpack
import torch

# 2: FetchReply rows are (tokens, feature sets, hidden), every feature set of a token together;
#    SamplingParams gained penalties, logit_bias, min_tokens and grammar.
# 3: SamplingParams gained logprobs and prompt_logprobs; GenerateChunk carries them (TokenLogprobs).
# 4: Pong gained healthy (a replica whose engine failed says so, and discovery drops it);
#    GenerateChunk is GenerateReply ("chunk" means a media chunk only).
#    ProbeReply gained stored_tokens (the shared KV tier).
PROTOCOL_VERSION = 4

_REGISTRY: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}  # each registered dataclass's field names
_TUPLE_FIELDS: dict[type, tuple[str, ...]] = {}  # msgpack has no tuples: restored on decode
_T = TypeVar("_T")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class WireError(ValueError):
    """A frame sequence that is not a valid message of this protocol version."""


def message(cls: type[_T]) -> type[_T]:
    """Register a dataclass so it can be sent and received by name."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass")
    name = cls.__name__
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise TypeError(f"duplicate wire type {name}")
    _REGISTRY[name] = cls
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    _TUPLE_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple"))
    return cls


def encode(msg: Any, envelope: dict[str, Any] | None = None) -> list[Any]:
    """Serialize a registered message into ZeroMQ frames (tensor bytes are not copied)."""
    name = type(msg).__name__
    if _REGISTRY.get(name) is not type(msg):
        raise TypeError(f"{name} is not a registered wire message")
    buffers: list[Any] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _tensor_ref(obj, buffers)
        if _REGISTRY.get(type(obj).__name__) is type(obj):
            out = {name: getattr(obj, name) for name in _FIELDS[type(obj)]}
            out["__dc__"] = type(obj).__name__
            return out
        raise TypeError(f"cannot serialize {type(obj).__name__}")

    header = {"v": PROTOCOL_VERSION, "env": envelope or {}, "body": msg}
    packed = msgpack.packb(header, default=default, use_bin_type=True)
    return [name.encode(), packed, *buffers]


def decode(frames: list[Any]) -> tuple[Any, dict[str, Any]]:
    """Inverse of :func:`encode`. ``frames`` may be bytes or ``zmq.Frame`` objects.

    Returns:
        The message and its envelope (request id and flags).
    """
    if len(frames) < 2:
        raise WireError("message needs at least a type and a header frame")
    raw = [_buffer(f) for f in frames]
    name = bytes(raw[0]).decode(errors="replace")
    if name not in _REGISTRY:
        raise WireError(f"unknown message type {name!r}")

    def hook(obj: dict) -> Any:
        if "__t__" in obj:
            return _tensor_from(obj["__t__"], raw)
        if "__dc__" in obj:
            cls = _REGISTRY.get(obj.pop("__dc__"))
            if cls is None:
                raise WireError("unknown nested type")
            for name in _TUPLE_FIELDS[cls]:
                if isinstance(obj.get(name), list):
                    obj[name] = tuple(obj[name])
            return cls(**obj)
        return obj

    try:
        header = msgpack.unpackb(raw[1], object_hook=hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # msgpack and the dataclass constructors raise many types on garbage
        raise WireError(f"bad header for {name}: {exc}") from exc
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise WireError(f"protocol version mismatch (want {PROTOCOL_VERSION})")
    body = header.get("body")
    if type(body) is not _REGISTRY[name]:
        raise WireError(f"header body is not a {name}")
    env = header.get("env", {})
    if not isinstance(env, dict) or not isinstance(env.get("rid", 0), int):
        raise WireError("bad envelope")
    return body, env


def peek_rid(frames: list[Any]) -> int:
    """The request id of a message whose body cannot be decoded (0 when unreadable too)."""
    try:
        header = msgpack.unpackb(_buffer(frames[1]), raw=False, strict_map_key=False)
        rid = header["env"]["rid"]
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:
        return 0


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)


def _tensor_ref(t: torch.Tensor, buffers: list[Any]) -> dict[str, Any]:
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"unsupported tensor dtype {t.dtype}")
    if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    shape = list(t.shape)
    # NOTE: a numpy view is the frame (no copy); numpy has no bfloat16, so that travels as int16.
    data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy() if t.numel() else b""
    buffers.append(data)
    return {"__t__": [dtype, shape, len(buffers) + 1]}


def _tensor_from(ref: list[Any], raw: list[memoryview]) -> torch.Tensor:
    if not isinstance(ref, list) or len(ref) != 3:
        raise WireError("bad tensor reference")
    dtype_name, shape, index = ref
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None or not isinstance(index, int) or not 2 <= index < len(raw):
        raise WireError("bad tensor reference")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WireError(f"bad tensor shape {shape!r}")
    buf = raw[index]
    numel = 1
    for dim in shape:
        numel *= dim
    if buf.nbytes != numel * dtype.itemsize:
        raise WireError(f"tensor frame has {buf.nbytes} bytes, shape {shape} needs {numel * dtype.itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)
