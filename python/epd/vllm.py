"""An adapter with the shape of vLLM's all-to-all manager (vllm.distributed.device_communicators
All2AllManagerBase and the DeepEP low-latency / high-throughput managers): dispatch() routes a rank's
tokens to the experts' ranks and returns them expert-major, combine() brings the expert outputs back and
reduces them with the router weights.

    mgr = EpdAll2AllManager.attach(socket, group="layer0", rank=rank, num_experts=64, hidden=4096,
                                   topk=8, max_tokens=128)
    recv_x, counts, handle = mgr.dispatch(hidden_states, topk_weights, topk_ids)
    expert_out = run_experts(recv_x, counts)          # LL: [local_experts, ranks*max_tokens, hidden]
    out = mgr.combine(expert_out, handle)             # [num_tokens, hidden]

Works with torch tensors (CUDA backend: stream-ordered on the current stream, capturable in a CUDA
graph for LL) and with NumPy arrays (host backend). See docs/python.md.
"""

import collections

import numpy as np

from . import core, formats

__all__ = ["EpdAll2AllManager", "EpdHandle"]


class EpdHandle(collections.namedtuple(
        "EpdHandle", "mode bank num_tokens fp8 num_recv recv_topk_idx recv_topk_weights expert_output_buffer")):
    """What combine() needs from its dispatch(). expert_output_buffer is the arena buffer combine reads
    (LL_Y [S, R*M, H] or HT_Y [num_recv, H]): experts that write their output there directly save a
    copy. num_recv, recv_topk_idx and recv_topk_weights are set in HT mode only."""

    __slots__ = ()


class EpdAll2AllManager:
    """dispatch/combine over one epd attachment, alternating the two banks so that step N+1's dispatch
    may run while step N's combine is pending."""

    def __init__(self, endpoint, mode="ll", fp8=False, stream=None):
        core._mode(mode)
        self.ep = endpoint
        self.mode = mode
        self.fp8 = bool(fp8)
        self.stream = stream
        self._conn = None
        self._step = 0

    @classmethod
    def attach(cls, socket=None, group="default", rank=0, num_experts=0, hidden=0, topk=0, max_tokens=0,
               mode="ll", fp8=False, stream=None):
        """Connect, attach to (group, rank) and wrap the endpoint; destroy() detaches."""
        conn = core.connect(socket)
        try:
            ep = conn.attach(group, rank=rank, num_experts=num_experts, hidden=hidden, topk=topk,
                             max_tokens=max_tokens)
        except BaseException:
            conn.close()
            raise
        mgr = cls(ep, mode=mode, fp8=fp8, stream=stream)
        mgr._conn = conn
        return mgr

    # vLLM All2AllManagerBase-style attributes
    @property
    def rank(self):
        return self.ep.rank

    @property
    def world_size(self):
        return self.ep.num_ranks

    @property
    def num_local_experts(self):
        """Physical expert slots on this rank (the expert-major leading dimension)."""
        return self.ep.slots_per_rank

    @property
    def max_num_tokens(self):
        return self.ep.max_tokens

    internode = False

    def get_handle(self, kwargs=None):
        """vLLM calls get_handle(kwargs) to obtain the communication object; this manager is its own."""
        return self

    def destroy(self):
        """Detach (and close the connection if attach() made it)."""
        if not self.ep.closed:
            self.ep.detach()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    # -- the data path
    def dispatch(self, hidden_states, topk_weights, topk_ids, *, mode=None, fp8=None, bank=None):
        """Send each token to the ranks of its top-k experts.

        hidden_states [T, H] (torch bf16/float, or NumPy float / uint16 bf16 bits), topk_weights [T, K]
        float, topk_ids [T, K] int (-1: none). Returns (recv_x, counts, handle):
        LL: recv_x [S, R*M, H] (bf16), or (fp8 [S, R*M, H], scales [S, R*M, H/128]) with fp8; counts [S]
            int32 rows valid per local slot (views of this bank's arena buffers);
        HT: recv_x [num_recv, H] (or (fp8, scales)), counts [S] (top-k entries per local slot); the
            handle carries recv_topk_idx [num_recv, K] (local slot or -1) and recv_topk_weights."""
        ep = self.ep
        mode = self.mode if mode is None else mode
        fp8 = self.fp8 if fp8 is None else bool(fp8)
        m = core._mode(mode)
        b = (self._step % 2) if bank is None else ep._bank(bank)
        n = ep.set_inputs(hidden_states, topk_ids, topk_weights, bank=b)
        st = ep.dispatch(n, mode=mode, fp8=fp8, bank=b, stream=self.stream)
        self._step += 1
        buf = ep.buffer
        if m == 0:  # LL
            x = (buf("ll_recv_x", b, fp8=True), buf("ll_recv_scales", b)) if fp8 else buf("ll_recv_x", b)
            handle = EpdHandle("ll", b, n, fp8, None, None, None, buf("ll_y", b))
            return x, buf("ll_recv_count", b), handle
        # HT: the number of received rows is known once the op completed (a stream sync on CUDA).
        if st is None:
            _sync(self.stream, ep)
            st = ep.op_status(check=True)
        r = st.num_recv
        x = ((buf("ht_recv_x", b, fp8=True)[:r], buf("ht_recv_scales", b)[:r]) if fp8
             else buf("ht_recv_x", b)[:r])
        handle = EpdHandle("ht", b, n, fp8, r, buf("ht_recv_topk_idx", b)[:r],
                           buf("ht_recv_topk_weights", b)[:r], buf("ht_y", b)[:r])
        return x, buf("ht_recv_count", b), handle

    def combine(self, expert_outputs, handle, *, copy=False):
        """Return each token's sum of weight x expert output, [num_tokens, H] bf16 (a view of the
        bank's OUT buffer unless copy=True; it is overwritten by the next combine of the same bank).

        LL: expert_outputs [S, R*M, H] (or [S, n, H] with n <= R*M rows per slot); HT: [num_recv, H],
        already reduced over the token's local experts with recv_topk_weights. Skipped copy when it is
        handle.expert_output_buffer itself."""
        ep = self.ep
        dst = handle.expert_output_buffer
        if not _same_memory(expert_outputs, dst):
            _copy_into(dst, expert_outputs, handle.mode)
        ep.combine(mode=handle.mode, bank=handle.bank, stream=self.stream)
        out = ep.buffer("out", handle.bank)[:handle.num_tokens]
        if copy:
            out = out.clone() if hasattr(out, "clone") else out.copy()
        return out


def _sync(stream, ep):
    torch = core._torch()
    if torch is not None and ep.on_gpu:
        if stream is None:
            torch.cuda.current_stream().synchronize()
        elif hasattr(stream, "synchronize"):
            stream.synchronize()
        else:
            torch.cuda.synchronize()


def _data_ptr(a):
    if hasattr(a, "data_ptr"):
        return a.data_ptr()
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return None


def _same_memory(a, b):
    pa, pb = _data_ptr(a), _data_ptr(b)
    return pa is not None and pa == pb and tuple(a.shape) == tuple(b.shape)


def _copy_into(dst, src, mode):
    """Copy expert outputs into the arena buffer dst, converting to bf16; rows beyond src are left."""
    shape = tuple(src.shape)
    if len(shape) != len(dst.shape) or shape[-1] != dst.shape[-1] or any(
            s > d for s, d in zip(shape, dst.shape)):
        raise ValueError("expert_outputs must have shape %s (%s mode), got %s" % (
            "[slots, <=ranks*max_tokens, hidden] = %s" % (tuple(dst.shape),) if mode == "ll"
            else "[num_recv, hidden] = %s" % (tuple(dst.shape),), mode, shape))
    idx = tuple(slice(0, s) for s in shape)
    if hasattr(dst, "copy_"):  # torch
        torch = core._torch()
        if not hasattr(src, "to"):
            s = np.asarray(src)
            src = (torch.from_numpy(s.view(np.int16)).view(torch.bfloat16) if s.dtype == np.uint16
                   else torch.from_numpy(np.ascontiguousarray(s)))
        if not src.is_floating_point():
            raise TypeError("expert_outputs must be a float or bfloat16 tensor, got %s" % src.dtype)
        dst[idx].copy_(src.to(device=dst.device, dtype=torch.bfloat16), non_blocking=True)
    else:
        s = np.asarray(src)
        if s.dtype == np.uint16:
            dst[idx] = s
        elif s.dtype.kind == "f":
            dst[idx] = formats.f32_to_bf16(s)
        else:
            raise TypeError("expert_outputs must be float or bfloat16 (uint16 bits), got dtype %s" % s.dtype)
