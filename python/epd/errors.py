"""Exceptions: every failing libepd call raises an EpdError subclass chosen by its result code.

EpdError carries the C result code (``code``), its name (``name``, e.g. "EPD_ERR_BAD_EXPERT"), the
per-handle error text of libepd (``message``, from epd_last_error / epd_conn_last_error) and, for step
failures, the peer rank named by the completion record (``peer``, None if not applicable).
Some subclasses also derive from the matching built-in exception (ValueError, TimeoutError, ...) so
that generic handlers work.
"""

EPD_OK = 0

_CODE_NAMES = {
    -1: "EPD_ERR_INVALID", -2: "EPD_ERR_NOMEM", -3: "EPD_ERR_SYSTEM", -4: "EPD_ERR_RPC",
    -5: "EPD_ERR_PROTOCOL", -6: "EPD_ERR_NOT_FOUND", -7: "EPD_ERR_BUSY", -8: "EPD_ERR_TIMEOUT",
    -9: "EPD_ERR_PEER", -10: "EPD_ERR_DRAINING", -11: "EPD_ERR_CUDA", -12: "EPD_ERR_NCCL",
    -13: "EPD_ERR_UNSUPPORTED", -14: "EPD_ERR_BAD_EXPERT", -15: "EPD_ERR_TOO_MANY_TOKENS",
    -16: "EPD_ERR_PERMISSION", -17: "EPD_ERR_OVERFLOW", -18: "EPD_ERR_MISMATCH", -19: "EPD_ERR_CLOSED",
    -20: "EPD_ERR_STATE", -21: "EPD_ERR_INTERNAL",
}
# Module-level names of the codes (epd.errors.EPD_ERR_BAD_EXPERT == -14, ...).
globals().update({name: code for code, name in _CODE_NAMES.items()})


class EpdError(Exception):
    """A libepd call failed. Attributes: code (int < 0), name, message (C error text), peer, call."""

    code = None

    def __init__(self, code, message="", call=None, peer=None):
        self.code = code
        self.name = _CODE_NAMES.get(code, "EPD_ERR_%d" % code)
        self.message = message or ""
        self.call = call
        self.peer = peer if peer is not None and peer >= 0 else None
        text = "%s%s (%d)" % ((call + ": ") if call else "", self.name, code)
        if self.message:
            text += ": " + self.message
        if self.peer is not None:
            text += " [peer rank %d]" % self.peer
        super().__init__(text)


class InvalidArgument(EpdError, ValueError):
    code = -1


class OutOfMemory(EpdError, MemoryError):
    code = -2


class SystemCallFailed(EpdError, OSError):
    code = -3


class RpcFailed(EpdError, ConnectionError):
    code = -4


class ProtocolMismatch(EpdError):
    code = -5


class NotFound(EpdError, LookupError):
    code = -6


class Busy(EpdError):
    code = -7


class Timeout(EpdError, TimeoutError):
    code = -8


class PeerFailed(EpdError):
    code = -9


class Draining(EpdError):
    code = -10


class CudaError(EpdError):
    code = -11


class NcclError(EpdError):
    code = -12


class Unsupported(EpdError, NotImplementedError):
    code = -13


class BadExpert(EpdError, ValueError):
    code = -14


class TooManyTokens(EpdError, ValueError):
    code = -15


class PermissionDenied(EpdError, PermissionError):
    code = -16


class Overflow(EpdError, OverflowError):
    code = -17


class Mismatch(EpdError):
    code = -18


class Closed(EpdError, ConnectionError):
    code = -19


class StateError(EpdError):
    code = -20


class InternalError(EpdError):
    code = -21


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, OutOfMemory, SystemCallFailed, RpcFailed, ProtocolMismatch, NotFound, Busy, Timeout,
    PeerFailed, Draining, CudaError, NcclError, Unsupported, BadExpert, TooManyTokens, PermissionDenied,
    Overflow, Mismatch, Closed, StateError, InternalError)}


def error_class(code):
    """The EpdError subclass of a result code (EpdError itself for an unknown code)."""
    return _BY_CODE.get(code, EpdError)


def make_error(code, message="", call=None, peer=None):
    """Build the exception for a result code."""
    return error_class(code)(code, message, call=call, peer=peer)


def code_name(code):
    """Name of a result code ("EPD_OK", "EPD_ERR_...")."""
    return "EPD_OK" if code == 0 else _CODE_NAMES.get(code, "EPD_ERR_%d" % code)
