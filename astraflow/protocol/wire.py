"""Typed message <-> plain msgpack-able dict, with validation on the way in.

A message class is a dataclass whose fields use a small closed set of types: int, float,
str, bool, bytes, `np.ndarray` (the dtype named in the field's metadata; on the wire the raw
little-endian bytes), `list[T]`, `dict[str, T]`, `Any` (any msgpack-native value) and nested
message dataclasses. Decoding checks every field and names the dotted path of the first bad
one, so a hostile or buggy peer gets a precise error instead of crashing the receiver.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable

import numpy as np


class WireError(ValueError):
    """A message does not match its declared schema."""


def array_field(dtype: str) -> Any:
    """A per-token array field: numpy in memory, raw bytes on the wire."""
    return dataclasses.field(metadata={"dtype": np.dtype(dtype).newbyteorder("<")})


_Decoder = Callable[[Any, str], Any]
_Encoder = Callable[[Any], Any]
_CACHE: dict[type, tuple[tuple[str, ...], tuple[_Encoder, ...], tuple[_Decoder, ...], frozenset[str]]] = {}


def encode(msg: Any) -> dict:
    names, encoders, _, _ = _compiled(type(msg))
    return {n: enc(getattr(msg, n)) for n, enc in zip(names, encoders)}


def decode(cls: type, data: Any, path: str = "") -> Any:
    return _decode_dataclass(cls, data, path or cls.__name__)


def _compiled(cls: type):
    got = _CACHE.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        names = tuple(f.name for f in fields)
        encoders = tuple(_encoder_for(hints[f.name], f) for f in fields)
        decoders = tuple(_decoder_for(hints[f.name], f) for f in fields)
        required = frozenset(
            f.name for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        got = _CACHE[cls] = (names, encoders, decoders, required)
    return got


def _decode_dataclass(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{path}: expected a map, got {type(data).__name__}")
    names, _, decoders, required = _compiled(cls)
    kwargs = {}
    for name, dec in zip(names, decoders):
        if name in data:
            kwargs[name] = dec(data[name], f"{path}.{name}")
        elif name in required:
            raise WireError(f"{path}.{name}: missing")
    if len(data) > len(kwargs):
        extra = sorted(str(k) for k in data if k not in names)
        raise WireError(f"{path}: unknown fields {extra[:5]}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise WireError(f"{path}: {e}") from None


def _identity(x: Any) -> Any:
    return x


def _encoder_for(tp: Any, f: dataclasses.Field | None) -> _Encoder:
    if f is not None and "dtype" in f.metadata:
        dtype = f.metadata["dtype"]
        return lambda a: np.ascontiguousarray(a, dtype=dtype).tobytes()
    if dataclasses.is_dataclass(tp):
        return encode
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        enc = _encoder_for(item, None)
        return _identity if enc is _identity else (lambda xs: [enc(x) for x in xs])
    if origin is dict:
        _, item = typing.get_args(tp)
        enc = _encoder_for(item, None)
        return _identity if enc is _identity else (lambda d: {k: enc(v) for k, v in d.items()})
    return _identity


def _scalar(tp: type) -> _Decoder:
    name = tp.__name__

    def check(x: Any, path: str) -> Any:
        if type(x) is tp:
            return x
        if tp is float and type(x) is int:
            return float(x)
        raise WireError(f"{path}: expected {name}, got {type(x).__name__}")

    return check


def _decoder_for(tp: Any, f: dataclasses.Field | None) -> _Decoder:
    if f is not None and "dtype" in f.metadata:
        dtype = f.metadata["dtype"]
        size = dtype.itemsize

        def array(x: Any, path: str) -> np.ndarray:
            if type(x) is not bytes:
                raise WireError(f"{path}: expected bytes of {dtype.name}, got {type(x).__name__}")
            if len(x) % size:
                raise WireError(f"{path}: {len(x)} bytes is not a whole number of {dtype.name}")
            return np.frombuffer(x, dtype=dtype)

        return array
    if tp is Any:
        return lambda x, path: x
    if dataclasses.is_dataclass(tp):
        return lambda x, path: _decode_dataclass(tp, x, path)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        dec = _decoder_for(item, None)

        def seq(x: Any, path: str) -> list:
            if type(x) is not list:
                raise WireError(f"{path}: expected a list, got {type(x).__name__}")
            return [dec(v, f"{path}.{i}") for i, v in enumerate(x)]

        return seq
    if origin is dict:
        _, item = typing.get_args(tp)
        dec = _decoder_for(item, None)

        def mapping(x: Any, path: str) -> dict:
            if type(x) is not dict:
                raise WireError(f"{path}: expected a map, got {type(x).__name__}")
            out = {}
            for k, v in x.items():
                if type(k) is not str:
                    raise WireError(f"{path}: keys must be strings")
                out[k] = dec(v, f"{path}.{k}")
            return out

        return mapping
    if tp in (int, float, str, bool, bytes):
        return _scalar(tp)
    raise TypeError(f"unsupported wire type {tp!r}")
