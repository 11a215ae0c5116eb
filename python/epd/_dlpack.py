"""Zero-copy torch tensors over device memory that epd owns, through a DLPack capsule built with ctypes.

The capsule is a legacy "dltensor" PyCapsule holding a DLManagedTensor (DLPack 0.x layout, which every
torch since 1.10 accepts in torch.utils.dlpack.from_dlpack). The manager context keeps a Python owner
(the Endpoint) alive until torch calls the deleter when the last tensor over the memory is freed.
"""

import ctypes
import threading

kDLCPU = 1
kDLCUDA = 2
kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLBfloat = 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

# Everything a live capsule needs, keyed by the DLManagedTensor address; dropped by the deleter.
_live = {}
_live_lock = threading.Lock()


@_Deleter
def _deleter(managed):
    addr = ctypes.cast(managed, ctypes.c_void_p).value
    with _live_lock:
        _live.pop(addr, None)


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# dtype name -> (DLPack code, bits)
DTYPES = {
    "bfloat16": (kDLBfloat, 16),
    "float32": (kDLFloat, 32),
    "int64": (kDLInt, 64),
    "int32": (kDLInt, 32),
    "uint8": (kDLUInt, 8),
}


def capsule(addr, shape, dtype, device_type, device_id, owner):
    """A "dltensor" capsule describing contiguous memory at addr (not copied; owner kept alive)."""
    code, bits = DTYPES[dtype]
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * ndim)(*shape)
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= int(n)
    strides_arr = (ctypes.c_int64 * ndim)(*reversed(strides))
    m = DLManagedTensor()
    m.dl_tensor.data = addr
    m.dl_tensor.device = DLDevice(device_type, device_id)
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype = DLDataType(code, bits, 1)
    m.dl_tensor.shape = shape_arr
    m.dl_tensor.strides = strides_arr
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _deleter
    key = ctypes.addressof(m)
    with _live_lock:
        _live[key] = (m, shape_arr, strides_arr, owner)
    # No capsule destructor: the capsule is consumed at once by from_dlpack, which takes ownership and
    # calls the deleter when the tensor dies. An unconsumed capsule would only leak its _live entry.
    return _PyCapsule_New(key, b"dltensor", None)


def live_count():
    """Number of DLPack exports whose consumer has not released them yet (for tests)."""
    with _live_lock:
        return len(_live)


_libcuda = None


def pointer_device(addr):
    """CUDA device ordinal of a device pointer in this process (driver API), or None if unknown."""
    global _libcuda
    try:
        if _libcuda is None:
            _libcuda = ctypes.CDLL("libcuda.so.1")
            _libcuda.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            _libcuda.cuPointerGetAttribute.restype = ctypes.c_int
        ordinal = ctypes.c_int(-1)
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
        rc = _libcuda.cuPointerGetAttribute(ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                            addr)
        return ordinal.value if rc == 0 and ordinal.value >= 0 else None
    except (OSError, AttributeError):
        return None
