"""Connection and Endpoint: the Python face of libepd's connect/attach/dispatch/combine.

Arena buffers are exposed in place, without copies: NumPy arrays over the mapped host memory (host
backend) or torch tensors over the device memory (CUDA backend, through DLPack). They are views of memory
that the daemon owns and libepd maps: they stay valid until the Endpoint is detached, and using one after
that is undefined (the memory is unmapped).
"""

import collections
import ctypes
import operator
import os
import threading
import weakref

import numpy as np

from . import _lib, errors, formats
from ._lib import BUF_KINDS, BUF_NAMES

_MAX_REPLICAS = 8  # replicas per logical expert (the daemon's EPD_MAX_REPLICAS)

__all__ = ["connect", "Connection", "Endpoint", "Geometry", "OpStatus", "default_socket_path"]

MODES = {"ll": _lib.EPD_MODE_LL, "ht": _lib.EPD_MODE_HT}

Geometry = collections.namedtuple(
    "Geometry", "num_ranks num_experts hidden topk max_tokens slots_per_rank ht_capacity")


def default_socket_path():
    """The control socket libepd uses when none is given: $EPD_SOCKET, else /run/epd/control.sock for
    root, else $XDG_RUNTIME_DIR/epd/control.sock, else /tmp/epd-<uid>/control.sock."""
    env = os.environ.get("EPD_SOCKET")
    if env:
        return env
    if os.geteuid() == 0:
        return "/run/epd/control.sock"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "epd", "control.sock")
    return "/tmp/epd-%d/control.sock" % os.getuid()


class OpStatus(collections.namedtuple(
        "OpStatus", "status peer map_version num_recv step user_tag latency_ns masked dropped")):
    """Completion record of an operation (epd_comp_t). status is 0 or an epd error code. masked: the
    world ranks masked in the step (bit r; groups attached with on_rank_loss="mask"); dropped: top-k
    entries of this rank's tokens dropped because no replica of their expert was live."""

    __slots__ = ()

    @property
    def ok(self):
        return self.status == 0

    @property
    def name(self):
        return errors.code_name(self.status)

    def error(self, message="", call=None):
        """The exception this completion stands for, or None when it succeeded."""
        if self.status == 0:
            return None
        return errors.make_error(self.status, message, call=call, peer=self.peer)

    def check(self, message="", call=None):
        """Raise the EpdError of a failed completion; return self when it succeeded."""
        e = self.error(message, call)
        if e is not None:
            raise e
        return self

    @classmethod
    def _from_c(cls, c):
        return cls(c.status, c.peer, c.map_version, c.num_recv, c.step, c.user_tag, c.latency_ns, c.masked,
                   c.dropped)

    @property
    def masked_ranks(self):
        """The ranks masked in the step, as a sorted list."""
        return [r for r in range(64) if self.masked >> r & 1]


def connect(socket=None, timeout_ms=0):
    """Open a control connection to the daemon (a Connection; use it as a context manager)."""
    return Connection(socket, timeout_ms)


class Connection:
    """A connection to the epd daemon's control socket (epd_conn_t)."""

    def __init__(self, socket=None, timeout_ms=0):
        self._lib = _lib.load()
        self.socket_path = os.fspath(socket) if socket is not None else default_socket_path()
        if not isinstance(timeout_ms, int) or timeout_ms < 0:
            raise ValueError("timeout_ms must be a non-negative int (0: the default 10000), got %r"
                             % (timeout_ms,))
        self._h = None
        self._endpoints = weakref.WeakSet()
        self._control = None
        self._lock = threading.Lock()
        self._path_b = self.socket_path.encode()
        opts = _lib.EpdConnectOpts(ctypes.sizeof(_lib.EpdConnectOpts), _lib.EPD_OPTS_MAGIC,
                                   _lib.EPD_API_VERSION, self._path_b, timeout_ms)
        h = ctypes.c_void_p()
        rc = self._lib.epd_connect(ctypes.byref(opts), ctypes.byref(h))
        if rc != 0:
            # The connection handle is not returned on failure: the text comes from the code alone.
            raise errors.make_error(rc, "cannot connect to %s: %s" % (
                self.socket_path, _lib.cstr(self._lib.epd_strerror(rc))), call="epd_connect")
        self._h = h

    # -- lifecycle
    @property
    def masked_ranks(self):
        """The group's ranks masked now (on_rank_loss="mask"), as a sorted list."""
        self._check_open()
        m = int(self._lib.epd_masked_ranks(self._h))
        return [r for r in range(64) if m >> r & 1]

    @property
    def closed(self):
        return self._h is None

    def close(self):
        """Detach every endpoint still attached through this connection, then disconnect."""
        for ep in list(self._endpoints):
            try:
                ep.detach()
            except errors.EpdError:
                pass
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._h is not None:
            self._lib.epd_disconnect(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def last_error(self):
        """Text of the last failure on this connection ('' if none)."""
        return _lib.cstr(self._lib.epd_conn_last_error(self._h)) if self._h is not None else ""

    def _check_open(self):
        if self._h is None:
            raise errors.Closed(-19, "the connection is closed", call="Connection")

    # -- attach
    def attach(self, group="default", rank=0, num_experts=0, hidden=0, topk=0, max_tokens=0,
               client_name=None, on_rank_loss=None, renormalize=False):
        """Attach to (group, rank) and map its queue and arena; returns an Endpoint.

        The first attach of a group fixes its geometry (num_experts, hidden, topk, max_tokens); later
        attaches pass 0 to take the group's, or the same values. on_rank_loss: "fail" (a lost rank fails
        the group's steps until it is attached again), "mask" (the group goes on without it; see
        docs/SEMANTICS.md "Masked ranks") or None (the group's; "fail" for a new group). renormalize
        (masked groups): scale a token's remaining top-k weights when some were dropped. The first attach
        fixes both."""
        self._check_open()
        if not isinstance(group, str) or not group:
            raise TypeError("group must be a non-empty str, got %r" % (group,))
        rank = _as_int("rank", rank, lo=0)
        geo = {k: _as_int(k, v, lo=0, hi=0xFFFFFFFF) for k, v in (
            ("num_experts", num_experts), ("hidden", hidden), ("topk", topk), ("max_tokens", max_tokens))}
        if client_name is None:
            client_name = "python:%d" % os.getpid()
        group_b, name_b = group.encode(), str(client_name).encode()
        losses = {None: 0, "fail": _lib.EPD_RANK_LOSS_FAIL, "mask": _lib.EPD_RANK_LOSS_MASK}
        if on_rank_loss not in losses:
            raise ValueError("on_rank_loss must be None, 'fail' or 'mask', got %r" % (on_rank_loss,))
        opts = _lib.EpdAttachOpts(ctypes.sizeof(_lib.EpdAttachOpts), _lib.EPD_OPTS_MAGIC,
                                  _lib.EPD_API_VERSION, group_b, rank, geo["num_experts"], geo["hidden"],
                                  geo["topk"], geo["max_tokens"], name_b, 0, losses[on_rank_loss],
                                  1 if renormalize else 0)
        h = ctypes.c_void_p()
        with self._lock:
            rc = self._lib.epd_attach(self._h, ctypes.byref(opts), ctypes.byref(h))
            if rc != 0:
                raise errors.make_error(rc, self.last_error(), call="attach")
        ep = Endpoint(self, h, group)
        self._endpoints.add(ep)
        return ep

    # -- control calls (gRPC; optional dependency)
    @property
    def control(self):
        """The control RPC client (epd.control.Control) on this connection's socket."""
        if self._control is None:
            from .control import Control
            self._control = Control(self.socket_path)
        return self._control

    def status(self):
        """Daemon status (GetStatus) as a dict."""
        return self.control.status()

    def metrics(self):
        """Prometheus metrics text (GetMetrics)."""
        return self.control.metrics()

    def expert_map(self, group="default"):
        """The active expert map of a group (GetExpertMap), an epd.control.ExpertMap."""
        return self.control.expert_map(group)

    def set_expert_map(self, placement, group="default"):
        """Stage a new expert map (SetExpertMap); returns the staged version."""
        return self.control.set_expert_map(placement, group)


def _as_int(name, v, lo=None, hi=None):
    if isinstance(v, bool):
        raise TypeError("%s must be an int, got bool" % name)
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError("%s must be an int, got %s" % (name, type(v).__name__)) from None
    if lo is not None and v < lo:
        raise ValueError("%s must be >= %d, got %d" % (name, lo, v))
    if hi is not None and v > hi:
        raise ValueError("%s must be <= %d, got %d" % (name, hi, v))
    return v


def _mode(mode):
    if isinstance(mode, str) and mode.lower() in MODES:
        return MODES[mode.lower()]
    if mode in (_lib.EPD_MODE_LL, _lib.EPD_MODE_HT) and not isinstance(mode, bool):
        return int(mode)
    raise ValueError("mode must be 'll' or 'ht', got %r" % (mode,))


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


class Endpoint:
    """One attachment to (group, rank): geometry, arena buffers in place, dispatch and combine."""

    def __init__(self, conn, handle, group):
        self._conn = conn
        self._lib = conn._lib
        self._h = handle
        self.group = group
        info = lambda k: int(self._lib.epd_info(self._h, k))  # noqa: E731
        self.rank = info(_lib.EPD_INFO_RANK)
        self.num_ranks = info(_lib.EPD_INFO_NUM_RANKS)
        self.num_experts = info(_lib.EPD_INFO_NUM_EXPERTS)
        self.hidden = info(_lib.EPD_INFO_HIDDEN)
        self.topk = info(_lib.EPD_INFO_TOPK)
        self.max_tokens = info(_lib.EPD_INFO_MAX_TOKENS)
        self.slots_per_rank = info(_lib.EPD_INFO_SLOTS_PER_RANK)
        self.ht_capacity = info(_lib.EPD_INFO_HT_CAPACITY)
        self.on_gpu = info(_lib.EPD_INFO_ON_GPU) == 1
        self.device = info(_lib.EPD_INFO_DEVICE)
        self.client_id = info(_lib.EPD_INFO_CLIENT_ID)
        self._views = {}
        self._torch_device = None

    # -- properties
    @property
    def geometry(self):
        return Geometry(self.num_ranks, self.num_experts, self.hidden, self.topk, self.max_tokens,
                        self.slots_per_rank, self.ht_capacity)

    @property
    def backend(self):
        return "cuda" if self.on_gpu else "host"

    @property
    def map_version(self):
        """Active expert-map version of the group, as this attachment sees it now."""
        self._check_open()
        return int(self._lib.epd_info(self._h, _lib.EPD_INFO_MAP_VERSION))

    @property
    def masked_ranks(self):
        """The group's ranks masked now (on_rank_loss="mask"), as a sorted list."""
        self._check_open()
        m = int(self._lib.epd_masked_ranks(self._h))
        return [r for r in range(64) if m >> r & 1]

    @property
    def closed(self):
        return self._h is None

    def last_error(self):
        """Text of the last failure on this attachment ('' if none)."""
        return _lib.cstr(self._lib.epd_last_error(self._h)) if self._h is not None else ""

    def __repr__(self):
        return "<epd.Endpoint group=%r rank=%d/%d %s E=%d H=%d K=%d M=%d%s>" % (
            self.group, self.rank, self.num_ranks, self.backend, self.num_experts, self.hidden, self.topk,
            self.max_tokens, " detached" if self.closed else "")

    # -- lifecycle
    def detach(self):
        """Detach and unmap. Every array/tensor view of the arena becomes invalid."""
        if self._h is None:
            return
        h, self._h = self._h, None
        self._views.clear()
        rc = self._lib.epd_detach(h)
        if rc != 0:
            raise errors.make_error(rc, "detach of group %r rank %d failed" % (self.group, self.rank),
                                    call="detach")

    close = detach

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def __del__(self):
        try:
            if self._h is not None and not self._conn.closed:
                self.detach()
        except Exception:
            pass

    def _check_open(self):
        if self._h is None:
            raise errors.StateError(-20, "the endpoint is detached", call="Endpoint")

    # -- buffers
    def _layout(self, kind):
        """(dtype name, shape) of a buffer kind in its BF16 form (docs: include/epd/epd_abi.h)."""
        M, H, K, S, R, C = (self.max_tokens, self.hidden, self.topk, self.slots_per_rank, self.num_ranks,
                            self.ht_capacity)
        nb = formats.scale_blocks(H)
        return {
            0: ("bfloat16", (M, H)), 1: ("float32", (M, nb)), 2: ("int64", (M, K)), 3: ("float32", (M, K)),
            4: ("bfloat16", (S, R * M, H)), 5: ("float32", (S, R * M, nb)), 6: ("int32", (S,)),
            7: ("int32", (S, R * M)), 8: ("bfloat16", (S, R * M, H)), 9: ("bfloat16", (M, H)),
            10: ("bfloat16", (C, H)), 11: ("float32", (C, nb)), 12: ("int64", (C, K)),
            13: ("float32", (C, K)), 14: ("int32", (C,)), 15: ("int32", (S,)), 16: ("bfloat16", (C, H)),
        }[kind]

    def _kind(self, kind):
        if isinstance(kind, str):
            k = BUF_KINDS.get(kind.lower())
            if k is None:
                raise ValueError("unknown buffer %r; known: %s" % (kind, ", ".join(BUF_KINDS)))
            return k
        k = _as_int("kind", kind)
        if k not in BUF_NAMES:
            raise ValueError("buffer kind must be 0..%d, got %d" % (len(BUF_NAMES) - 1, k))
        return k

    def _bank(self, bank):
        return _as_int("bank", bank, lo=0, hi=_lib.EPD_NUM_BANKS - 1)

    def buffer_address(self, kind, bank=0):
        """(address, bytes) of an arena buffer in this process (device address on the CUDA backend)."""
        self._check_open()
        k, b = self._kind(kind), self._bank(bank)
        n = ctypes.c_size_t(0)
        addr = self._lib.epd_buffer(self._h, k, b, ctypes.byref(n))
        if not addr:
            raise errors.NotFound(-6, "buffer %s bank %d is not in the arena" % (BUF_NAMES[k], b),
                                  call="buffer")
        return addr, n.value

    def _raw(self, k, b, dtype, shape):
        addr, nbytes = self.buffer_address(k, b)
        itemsize = {"bfloat16": 2, "float32": 4, "int64": 8, "int32": 4, "uint8": 1}[dtype]
        need = int(np.prod(shape, dtype=np.int64)) * itemsize
        if nbytes < need:
            raise errors.InternalError(-21, "buffer %s bank %d has %d bytes, its shape %s needs %d" % (
                BUF_NAMES[k], b, nbytes, shape, need), call="buffer")
        return addr, need

    def array(self, kind, bank=0, fp8=False):
        """A NumPy view (zero copy) of an arena buffer: host backend only.

        BF16 buffers are uint16 bit patterns (see epd.formats); with fp8=True the recv_x buffers are
        uint8 e4m3 codes [.., H] (the first H bytes of each row)."""
        if self.on_gpu:
            raise TypeError("the arena of a CUDA-backend endpoint is device memory: use tensor(), not array()")
        k, b = self._kind(kind), self._bank(bank)
        key = ("np", k, b, bool(fp8))
        v = self._views.get(key)
        if v is not None:
            return v
        dtype, shape = self._layout(k)
        addr, need = self._raw(k, b, dtype, shape)
        mem = (ctypes.c_uint8 * need).from_address(addr)
        mem._epd_owner = self  # keeps the attachment object alive while a view exists
        npdt = {"bfloat16": np.uint16, "float32": np.float32, "int64": np.int64, "int32": np.int32}[dtype]
        arr = np.frombuffer(mem, dtype=npdt).reshape(shape)
        if fp8:
            if k not in (4, 10):
                raise ValueError("fp8=True applies to ll_recv_x and ht_recv_x only, not %s" % BUF_NAMES[k])
            arr = arr.view(np.uint8)[..., :self.hidden]
        self._views[key] = arr
        return arr

    def tensor(self, kind, bank=0, fp8=False):
        """A torch view (zero copy) of an arena buffer: a CUDA tensor on the CUDA backend (DLPack), a CPU
        tensor over the mapped memory on the host backend. BF16 buffers are torch.bfloat16; with
        fp8=True the recv_x buffers are torch.float8_e4m3fn [.., H]."""
        torch = _torch()
        if torch is None:
            raise ImportError("epd.Endpoint.tensor() needs PyTorch (pip install torch)")
        k, b = self._kind(kind), self._bank(bank)
        if fp8 and k not in (4, 10):
            raise ValueError("fp8=True applies to ll_recv_x and ht_recv_x only, not %s" % BUF_NAMES[k])
        key = ("torch", k, b, bool(fp8))
        v = self._views.get(key)
        if v is not None:
            return v
        dtype, shape = self._layout(k)
        if self.on_gpu:
            from . import _dlpack
            addr, _ = self._raw(k, b, dtype, shape)
            if self._torch_device is None:
                dev = _dlpack.pointer_device(addr)
                self._torch_device = dev if dev is not None else max(self.device, 0)
            t = torch.utils.dlpack.from_dlpack(
                _dlpack.capsule(addr, shape, dtype, _dlpack.kDLCUDA, self._torch_device, self))
        else:
            arr = self.array(k, b)
            t = torch.from_numpy(arr.view(np.int16) if dtype == "bfloat16" else arr)
            if dtype == "bfloat16":
                t = t.view(torch.bfloat16)
        if fp8:
            t = t.view(torch.uint8)[..., :self.hidden].view(torch.float8_e4m3fn)
        self._views[key] = t
        return t

    def buffer(self, kind, bank=0, fp8=False):
        """array() on the host backend, tensor() on the CUDA backend."""
        return self.tensor(kind, bank, fp8) if self.on_gpu else self.array(kind, bank, fp8)

    def bank(self, bank=0):
        """The buffers of one bank as attributes (x, topk_idx, ..., ll_recv_x, ll_recv_x_fp8, ...)."""
        return Bank(self, self._bank(bank))

    # -- inputs
    def set_inputs(self, x, topk_idx, topk_weights, bank=0):
        """Copy one step's inputs into the bank's X, TOPK_IDX, TOPK_WEIGHTS; returns num_tokens.

        x: [T, H] float (rounded to BF16) or BF16 bits (uint16) / torch.bfloat16; topk_idx: [T, K]
        integers (-1 = none); topk_weights: [T, K] float. Shapes and dtypes are checked here; expert ids
        are checked by the daemon on dispatch (EPD_ERR_BAD_EXPERT on every rank). For zero copy, write
        into bank(b).x / .topk_idx / .topk_weights directly instead."""
        self._check_open()
        b = self._bank(bank)
        T = _rows("x", x)
        _check_shape("x", x, (T, self.hidden), "[num_tokens, hidden=%d]" % self.hidden)
        _check_shape("topk_idx", topk_idx, (T, self.topk), "[num_tokens=%d, topk=%d]" % (T, self.topk))
        _check_shape("topk_weights", topk_weights, (T, self.topk),
                     "[num_tokens=%d, topk=%d]" % (T, self.topk))
        if T > self.max_tokens:
            raise ValueError("x has %d tokens but the group's max_tokens is %d" % (T, self.max_tokens))
        _check_kind("x", x, "float or bfloat16 (uint16 bits)", ("f", "bf16", "u2"))
        _check_kind("topk_idx", topk_idx, "an integer dtype", ("i", "u"))
        _check_kind("topk_weights", topk_weights, "a float dtype", ("f", "bf16"))
        if self.on_gpu or _is_torch(x) or _is_torch(topk_idx) or _is_torch(topk_weights):
            self._set_inputs_torch(x, topk_idx, topk_weights, b, T)
        else:
            xs = np.asarray(x)
            self.array("x", b)[:T] = xs if xs.dtype == np.uint16 else formats.f32_to_bf16(xs)
            self.array("topk_idx", b)[:T] = np.asarray(topk_idx, dtype=np.int64)
            self.array("topk_weights", b)[:T] = np.asarray(topk_weights, dtype=np.float32)
        return T

    def _set_inputs_torch(self, x, topk_idx, topk_weights, b, T):
        torch = _torch()
        if torch is None:
            raise ImportError("writing torch inputs needs PyTorch")

        def as_t(v, dtype):
            if _is_torch(v):
                return v
            v = np.asarray(v)
            if v.dtype == np.uint16:  # bf16 bits
                return torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(np.ascontiguousarray(v)).to(dtype)

        dst_x = self.tensor("x", b)
        xt = as_t(x, torch.float32)
        if xt.dtype == torch.int16:
            xt = xt.view(torch.bfloat16)
        dst_x[:T].copy_(xt.to(torch.bfloat16), non_blocking=True)
        self.tensor("topk_idx", b)[:T].copy_(as_t(topk_idx, torch.int64).to(torch.int64), non_blocking=True)
        self.tensor("topk_weights", b)[:T].copy_(as_t(topk_weights, torch.float32).to(torch.float32),
                                                 non_blocking=True)

    # -- operations
    def _stream(self, stream):
        """The CUstream handle to pass to libepd (None: run and wait)."""
        if not self.on_gpu:
            if stream not in (None, 0, False, "sync"):
                raise ValueError("the host backend runs operations synchronously: pass stream=None")
            return None
        if stream in (False, "sync"):
            return None
        if stream is None:
            torch = _torch()
            if torch is None or not torch.cuda.is_available():
                return None
            dev = self._torch_device if self._torch_device is not None else max(self.device, 0)
            stream = torch.cuda.current_stream(dev)
        handle = getattr(stream, "cuda_stream", stream)
        handle = _as_int("stream", handle, lo=0)
        # torch's default stream is the legacy NULL stream, handle 0; libepd reads NULL as "run and
        # wait", so name the legacy stream explicitly (CU_STREAM_LEGACY) to stay stream-ordered.
        return handle if handle != 0 else 1

    def dispatch(self, num_tokens, mode="ll", fp8=False, bank=0, stream=None, dense=False):
        """Dispatch num_tokens tokens of the bank's X/TOPK_* buffers (collective: every rank calls it).

        dense=True (mode "ht" only): the dense HT layout, every rank receives every token of every rank
        (rows ordered by (src, t), entries of other ranks -1); its BF16 rows move with the GPU's copy
        engines on the CUDA backend.

        stream=None: host backend, run and wait, returning the OpStatus (raises the EpdError of a
        failed step); CUDA backend, enqueue on torch's current stream (capturable in torch.cuda.graph)
        and return None: read the status with op_status() after the stream is synchronised.
        stream may be a torch.cuda.Stream, a raw cudaStream_t int, or "sync" to run and wait."""
        self._check_open()
        m = _mode(mode)
        n = _as_int("num_tokens", num_tokens, lo=0, hi=0xFFFFFFFF)
        b = self._bank(bank)
        flags = (_lib.EPD_DESC_FP8 if fp8 else 0) | (_lib.EPD_DESC_HT_DENSE if dense else 0)
        s = self._stream(stream)
        rc = self._lib.epd_dispatch(self._h, m, n, flags, b, s)
        return self._after(rc, s, "dispatch")

    def combine(self, mode="ll", bank=0, stream=None):
        """Combine the bank's expert outputs (LL_Y or HT_Y) into its OUT buffer; same stream rules."""
        self._check_open()
        m = _mode(mode)
        b = self._bank(bank)
        s = self._stream(stream)
        rc = self._lib.epd_combine(self._h, m, b, s)
        return self._after(rc, s, "combine")

    def _after(self, rc, stream, call):
        if rc != 0:
            msg = self.last_error()
            peer = None
            comp = _lib.EpdComp()
            if self._lib.epd_op_status(self._h, ctypes.byref(comp)) == rc and comp.status == rc:
                peer = comp.peer
            raise errors.make_error(rc, msg, call=call, peer=peer)
        if stream is not None:
            return None
        return self.op_status()

    def slot_experts(self):
        """(version, [logical expert held by each of this rank's slots, -1 for a free slot]): which weights
        to run on each slot, read from the map table the daemon keeps in this attachment's memory (no
        round trip, a consistent snapshot)."""
        self._check_open()
        n = self.slots_per_rank
        row = (ctypes.c_int32 * n)()
        version = ctypes.c_uint32()
        rc = self._lib.epd_slot_experts(self._h, row, n, ctypes.byref(version))
        if rc != 0:
            raise errors.make_error(rc, self.last_error(), call="slot_experts")
        return int(version.value), [int(e) for e in row]

    def expert_slots(self, expert):
        """(version, [(rank, slot) of each replica of logical expert `expert`]), from the same table."""
        self._check_open()
        e = _as_int("expert", expert, lo=0, hi=self.num_experts - 1)
        cap = _MAX_REPLICAS
        reps = (ctypes.c_uint32 * (2 * cap))()
        nrep, version = ctypes.c_uint32(), ctypes.c_uint32()
        rc = self._lib.epd_expert_slots(self._h, e, reps, cap, ctypes.byref(nrep), ctypes.byref(version))
        if rc != 0:
            raise errors.make_error(rc, self.last_error(), call="expert_slots")
        n = min(int(nrep.value), cap)
        return int(version.value), [(int(reps[2 * i]), int(reps[2 * i + 1])) for i in range(n)]

    def slot_status(self, slot):
        """Completion record (OpStatus) held by queue slot `slot` (ops replayed from CUDA graphs or submitted
        by a client kernel: read it after the stream is synchronised)."""
        self._check_open()
        comp = _lib.EpdComp()
        rc = self._lib.epd_slot_status(self._h, int(slot), ctypes.byref(comp))
        if rc != 0 and rc != comp.status:
            raise errors.make_error(rc, self.last_error(), call="slot_status")
        return OpStatus._from_c(comp)

    @property
    def next_slot(self):
        """Queue slot of the next op submitted through this endpoint (ops run in ring order)."""
        self._check_open()
        return int(self._lib.epd_info(self._h, _lib.EPD_INFO_NEXT_SLOT))

    @property
    def kernel_submit(self):
        """True when ops are submitted through the queue's device twin with libepd's kernels."""
        self._check_open()
        return int(self._lib.epd_info(self._h, _lib.EPD_INFO_KERNEL_SUBMIT)) == 1

    def op_status(self, check=False):
        """Completion record (OpStatus) of the last completed op; with check=True raise its error."""
        self._check_open()
        comp = _lib.EpdComp()
        rc = self._lib.epd_op_status(self._h, ctypes.byref(comp))
        if rc != 0 and rc != comp.status:
            raise errors.make_error(rc, self.last_error(), call="op_status")
        st = OpStatus._from_c(comp)
        if check:
            st.check(self.last_error(), call="op")
        return st


def _is_torch(v):
    return type(v).__module__.startswith("torch")


def _rows(name, v):
    shape = tuple(v.shape) if hasattr(v, "shape") else np.shape(v)
    if len(shape) != 2:
        raise ValueError("%s must be 2-D [num_tokens, ...], got shape %s" % (name, shape))
    return shape[0]


def _check_shape(name, v, want, text):
    shape = tuple(v.shape) if hasattr(v, "shape") else np.shape(v)
    if tuple(shape) != tuple(want):
        raise ValueError("%s must have shape %s, got %s" % (name, text, tuple(shape)))


def _check_kind(name, v, text, allowed):
    if _is_torch(v):
        s = str(v.dtype)
        kind = ("bf16" if "bfloat16" in s else "f" if "float" in s else
                "u" if "uint" in s else "b" if "bool" in s else "i" if "int" in s else "?")
    else:
        dt = np.asarray(v).dtype
        kind = dt.kind
        if dt == np.uint16:
            kind = "u2" if "u2" in allowed else "u"
        dt_s = str(dt)
        s = dt_s
    if kind not in allowed:
        raise TypeError("%s must be %s, got dtype %s" % (name, text, s))


class Bank:
    """The buffers of one bank of an Endpoint, as attributes (views, no copies)."""

    def __init__(self, ep, bank):
        self._ep, self.index = ep, bank

    def __getattr__(self, name):
        if name.endswith("_fp8") and name[:-4] in ("ll_recv_x", "ht_recv_x"):
            return self._ep.buffer(name[:-4], self.index, fp8=True)
        if name in BUF_KINDS:
            return self._ep.buffer(name, self.index)
        raise AttributeError("no buffer %r; known: %s" % (name, ", ".join(BUF_KINDS)))

    def __dir__(self):
        return list(BUF_KINDS) + ["ll_recv_x_fp8", "ht_recv_x_fp8"]
