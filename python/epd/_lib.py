"""ctypes bindings of libepd (include/epd/epd.h, include/epd/epd_abi.h).

Only this module touches ctypes declarations of the C API; everything above it is plain Python. The
library is found, in order, at $EPD_LIBRARY, next to this package (a wheel or an install may place
libepd.so there), in the build directory of the source tree ($EPD_BUILD/lib, else <repo>/build/lib), and
last through the system loader (libepd.so.1, then libepd.so).
"""

import ctypes
import ctypes.util
import os
import threading

# ---- constants of include/epd/epd.h and include/epd/epd_abi.h (kept in step with the headers) --------------------
EPD_API_VERSION = 1
EPD_OPTS_MAGIC = 0x4550444F
EPD_ABI_VERSION = 2
EPD_NUM_BANKS = 2
EPD_DESC_FP8 = 1 << 0
EPD_DESC_HT_DENSE = 1 << 1

EPD_MODE_LL = 0
EPD_MODE_HT = 1

(EPD_INFO_RANK, EPD_INFO_NUM_RANKS, EPD_INFO_NUM_EXPERTS, EPD_INFO_HIDDEN, EPD_INFO_TOPK,
 EPD_INFO_MAX_TOKENS, EPD_INFO_SLOTS_PER_RANK, EPD_INFO_HT_CAPACITY, EPD_INFO_ON_GPU, EPD_INFO_DEVICE,
 EPD_INFO_MAP_VERSION, EPD_INFO_CLIENT_ID, EPD_INFO_NEXT_SLOT, EPD_INFO_WEIGHT_BYTES_PER_SLOT,
 EPD_INFO_KERNEL_SUBMIT) = range(15)

# Arena buffer kinds (EPD_BUF_*).
BUF_KINDS = {
    "x": 0,
    "x_scales": 1,
    "topk_idx": 2,
    "topk_weights": 3,
    "ll_recv_x": 4,
    "ll_recv_scales": 5,
    "ll_recv_count": 6,
    "ll_recv_src": 7,
    "ll_y": 8,
    "out": 9,
    "ht_recv_x": 10,
    "ht_recv_scales": 11,
    "ht_recv_topk_idx": 12,
    "ht_recv_topk_weights": 13,
    "ht_recv_src": 14,
    "ht_recv_count": 15,
    "ht_y": 16,
}
BUF_NAMES = {v: k for k, v in BUF_KINDS.items()}


class EpdConnectOpts(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("socket_path", ctypes.c_char_p),
        ("timeout_ms", ctypes.c_int),
    ]


class EpdAttachOpts(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("group", ctypes.c_char_p),
        ("rank", ctypes.c_int),
        ("num_experts", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("client_name", ctypes.c_char_p),
        ("weight_bytes_per_slot", ctypes.c_uint64),
        ("on_rank_loss", ctypes.c_uint32),
        ("renormalize", ctypes.c_uint32),
    ]


EPD_RANK_LOSS_FAIL = 1
EPD_RANK_LOSS_MASK = 2


class EpdComp(ctypes.Structure):
    """epd_comp_t: the completion record of one operation (64 bytes)."""

    _fields_ = [
        ("status", ctypes.c_int32),
        ("peer", ctypes.c_int32),
        ("map_version", ctypes.c_uint32),
        ("num_recv", ctypes.c_uint32),
        ("step", ctypes.c_uint64),
        ("user_tag", ctypes.c_uint64),
        ("latency_ns", ctypes.c_uint64),
        ("masked", ctypes.c_uint64),
        ("dropped", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32 * 3),
    ]


assert ctypes.sizeof(EpdComp) == 64, "epd_comp_t is 64 bytes"


def _candidates():
    env = os.environ.get("EPD_LIBRARY")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libepd.so", "libepd.so.1"):
        yield os.path.join(here, name)
    build = os.environ.get("EPD_BUILD")
    if build:
        yield os.path.join(build, "lib", "libepd.so")
    repo = os.path.dirname(os.path.dirname(here))  # python/epd -> repo root (source checkout)
    yield os.path.join(repo, "build", "lib", "libepd.so")
    for name in ("libepd.so.1", "libepd.so"):
        yield name  # the system loader (ld.so.cache, LD_LIBRARY_PATH)
    found = ctypes.util.find_library("epd")
    if found:
        yield found


_lib = None
_lib_lock = threading.Lock()


def _declare(lib):
    c = ctypes
    vp = c.c_void_p
    lib.epd_strerror.argtypes = [c.c_int]
    lib.epd_strerror.restype = c.c_char_p
    lib.epd_connect.argtypes = [c.POINTER(EpdConnectOpts), c.POINTER(vp)]
    lib.epd_connect.restype = c.c_int
    lib.epd_disconnect.argtypes = [vp]
    lib.epd_disconnect.restype = None
    lib.epd_conn_last_error.argtypes = [vp]
    lib.epd_conn_last_error.restype = c.c_char_p
    lib.epd_attach.argtypes = [vp, c.POINTER(EpdAttachOpts), c.POINTER(vp)]
    lib.epd_attach.restype = c.c_int
    lib.epd_detach.argtypes = [vp]
    lib.epd_detach.restype = c.c_int
    lib.epd_last_error.argtypes = [vp]
    lib.epd_last_error.restype = c.c_char_p
    lib.epd_masked_ranks.argtypes = [vp]
    lib.epd_masked_ranks.restype = c.c_uint64
    lib.epd_info.argtypes = [vp, c.c_int]
    lib.epd_info.restype = c.c_int64
    lib.epd_buffer.argtypes = [vp, c.c_int, c.c_uint, c.POINTER(c.c_size_t)]
    lib.epd_buffer.restype = vp
    lib.epd_dispatch.argtypes = [vp, c.c_int, c.c_uint32, c.c_uint32, c.c_uint, vp]
    lib.epd_dispatch.restype = c.c_int
    lib.epd_combine.argtypes = [vp, c.c_int, c.c_uint, vp]
    lib.epd_combine.restype = c.c_int
    lib.epd_op_status.argtypes = [vp, c.POINTER(EpdComp)]
    lib.epd_op_status.restype = c.c_int
    lib.epd_slot_status.argtypes = [vp, c.c_uint, c.POINTER(EpdComp)]
    lib.epd_slot_status.restype = c.c_int
    lib.epd_slot_experts.argtypes = [vp, c.POINTER(c.c_int32), c.c_uint32, c.POINTER(c.c_uint32)]
    lib.epd_slot_experts.restype = c.c_int
    lib.epd_expert_slots.argtypes = [vp, c.c_uint32, c.POINTER(c.c_uint32), c.c_uint32, c.POINTER(c.c_uint32),
                                     c.POINTER(c.c_uint32)]
    lib.epd_expert_slots.restype = c.c_int
    return lib


def library_path():
    """Path of the loaded libepd (loads it if needed)."""
    lib = load()
    return lib._name


def load():
    """Load libepd once and declare its prototypes; raises OSError naming every place tried."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        for cand in _candidates():
            if os.sep in cand and not os.path.exists(cand):
                tried.append(cand + " (missing)")
                continue
            try:
                lib = ctypes.CDLL(cand)
            except OSError as e:
                tried.append("%s (%s)" % (cand, e))
                continue
            _lib = _declare(lib)
            return _lib
        raise OSError("libepd.so not found; set EPD_LIBRARY to its path or build it with `make` "
                      "(tried: %s)" % "; ".join(tried))


def cstr(b):
    """Decode a C string returned by libepd ('' for NULL)."""
    return b.decode("utf-8", "replace") if b else ""
