"""The wire between the frontend and an engine core in another process (vLLM's serial_utils):
msgpack via msgspec, one typed frame per message, numpy arrays as raw-buffer msgpack extensions
(never pickled).

Every ZMQ message is two frames: a one-byte kind, then the msgspec-encoded payload. The kind says
which struct to decode, so neither side needs tagged unions or pickle.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import msgspec
import numpy as np

from jaxllm.engine import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest

# A core that joined over TCP (another host, a Ray actor) sends a heartbeat when it has sent
# nothing else for this long, and its frontend sends one this often: ZMQ never reports a dead
# peer, and neither side has the other's process to watch.
HEARTBEAT_INTERVAL_S = 1.0
# Seconds of silence after which either side counts the other as dead (the frontend's value:
# its cores get it in the welcome).
HEARTBEAT_TIMEOUT_ENV = "JAXLLM_DP_HEARTBEAT_TIMEOUT_S"
# Seconds a data-parallel start waits for its cores to join and finish loading (vLLM's name).
ENGINE_READY_TIMEOUT_ENV = "JAXLLM_ENGINE_READY_TIMEOUT_S"


def _seconds(name: str, default: float, low: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if not value >= low:
        raise ValueError(f"{name}={text!r} must be at least {low:g} seconds")
    return value


def heartbeat_timeout_s() -> float:
    """At least two heartbeat intervals: one late heartbeat is not a death."""
    return _seconds(HEARTBEAT_TIMEOUT_ENV, 30.0, 2 * HEARTBEAT_INTERVAL_S)


def engine_ready_timeout_s() -> float:
    return _seconds(ENGINE_READY_TIMEOUT_ENV, 600.0, 1.0)


# msgpack extension code of a numpy array: header (dtype str, shape) + raw bytes.
_NDARRAY_EXT = 1


class RequestType(bytes, enum.Enum):
    """Frontend -> core."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str] of request ids
    UTILITY = b"\x02"  # payload: UtilityRequest
    SHUTDOWN = b"\x03"  # payload: empty; the core finishes its step and exits 0
    HEARTBEAT = b"\x04"  # payload: empty; to a core on another host: the frontend lives


class OutputType(bytes, enum.Enum):
    """Core -> frontend."""

    READY = b"\x10"  # payload: ReadyMessage (handshake)
    OUTPUTS = b"\x11"  # payload: EngineCoreOutputs
    UTILITY = b"\x12"  # payload: UtilityOutput
    STARTUP_FAILED = b"\x13"  # payload: str (the exception, formatted)
    HEARTBEAT = b"\x14"  # payload: empty; from a core on another host: the core lives


class UtilityRequest(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any]


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The method's result still encoded (Raw): the caller decodes it with the type it expects
    (UTILITY_RESULT_TYPES), since msgpack alone does not know a struct from a dict."""

    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None  # "ExceptionType: message" when the call raised


class ReadyMessage(msgspec.Struct):
    """The handshake: what the frontend needs before it can validate a request, sent once the
    core loaded the model, sized the KV array and compiled. The frontend never starts a JAX
    backend, so the platform and dtype come from here."""

    info: EngineCoreInfo  # with the core's platform and dtype
    pid: int


class CoreHello(msgspec.Struct):
    """A core that joins the frontend over TCP (another host, a Ray actor) says who it is."""

    engine_index: int
    host: str
    pid: int
    model: str | None = None  # the model its host was started with, if any (must match)


class CoreWelcome(msgspec.Struct, omit_defaults=True):
    """The frontend's answer: where to connect, and the engine's settings (the frontend's, so
    that every core runs the same engine); or why it is refused."""

    input_address: str = ""
    output_address: str = ""
    engine_args_json: str = ""
    launch_config_json: str = ""
    heartbeat_timeout_s: float = 0.0
    error: str | None = None


# Utility results that are structs; the rest are plain msgpack values.
UTILITY_RESULT_TYPES: dict[str, Any] = {"get_engine_info": EngineCoreInfo}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("object arrays cannot go over the wire")
        arr = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode((arr.dtype.str, arr.shape))
        return msgspec.msgpack.Ext(_NDARRAY_EXT, len(header).to_bytes(4, "little") + header
                                   + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__} for the engine-core wire")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4:4 + n])
    # A copy: the frame's buffer is not ours to keep, and users may write to the array.
    return np.frombuffer(data[4 + n:], dtype=np.dtype(dtype)).reshape(shape).copy()


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {type_}")


class MsgpackEncoder:
    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._enc.encode(obj)


class MsgpackDecoder:
    """One decoder per payload type (msgspec validates while decoding)."""

    def __init__(self, type_: Any = Any) -> None:
        self._dec = msgspec.msgpack.Decoder(type_, ext_hook=_ext_hook, dec_hook=_dec_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._dec.decode(data)


REQUEST_DECODERS = {RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    RequestType.ABORT: MsgpackDecoder(list[str]),
                    RequestType.UTILITY: MsgpackDecoder(UtilityRequest)}
OUTPUT_DECODERS = {OutputType.READY: MsgpackDecoder(ReadyMessage),
                   OutputType.OUTPUTS: MsgpackDecoder(EngineCoreOutputs),
                   OutputType.UTILITY: MsgpackDecoder(UtilityOutput),
                   OutputType.STARTUP_FAILED: MsgpackDecoder(str)}
