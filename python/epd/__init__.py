"""epd: Python client of the epd expert-parallel communication daemon.

    import epd
    with epd.connect("/run/epd/control.sock") as conn:
        with conn.attach("default", rank=0, num_experts=16, hidden=1024, topk=4, max_tokens=128) as ep:
            ep.set_inputs(x, topk_idx, topk_weights, bank=0)
            ep.dispatch(len(x), mode="ll", bank=0)
            ...

Pure Python over libepd (ctypes); see docs/python.md.
"""

from . import errors, formats
from .core import Bank, Connection, Endpoint, Geometry, OpStatus, connect, default_socket_path
from .errors import (BadExpert, Busy, Closed, CudaError, Draining, EpdError, InternalError, InvalidArgument,
                     Mismatch, NcclError, NotFound, OutOfMemory, Overflow, PeerFailed, PermissionDenied,
                     ProtocolMismatch, RpcFailed, StateError, SystemCallFailed, Timeout, TooManyTokens,
                     Unsupported)
from .formats import bf16_to_f32, dequantize_fp8, e4m3_to_f32, f32_to_bf16, f32_to_e4m3, quantize_fp8

__version__ = "0.1.0"


def library_path():
    """Path of the libepd shared library in use (loads it)."""
    from . import _lib
    return _lib.library_path()


__all__ = [
    "connect", "Connection", "Endpoint", "Bank", "Geometry", "OpStatus", "default_socket_path",
    "library_path", "errors", "formats", "EpdError", "InvalidArgument", "OutOfMemory", "SystemCallFailed",
    "RpcFailed", "ProtocolMismatch", "NotFound", "Busy", "Timeout", "PeerFailed", "Draining", "CudaError",
    "NcclError", "Unsupported", "BadExpert", "TooManyTokens", "PermissionDenied", "Overflow", "Mismatch",
    "Closed", "StateError", "InternalError", "f32_to_bf16", "bf16_to_f32", "f32_to_e4m3", "e4m3_to_f32",
    "quantize_fp8", "dequantize_fp8",
]
