"""epd.vllm.EpdAll2AllManager on the host backend: LL and HT round trips against the reference."""

import numpy as np
import pytest

import epd
from epd import formats, reference
from epd.vllm import EpdAll2AllManager
from conftest import run_ranks

R, E, H, K, M = 2, 8, 128, 2, 16


def managers(daemon, group, mode, fp8=False):
    m0 = EpdAll2AllManager.attach(daemon.socket, group=group, rank=0, num_experts=E, hidden=H, topk=K,
                                  max_tokens=M, mode=mode, fp8=fp8)
    m1 = EpdAll2AllManager.attach(daemon.socket, group=group, rank=1, mode=mode, fp8=fp8)
    return [m0, m1]


def inputs(rng, T):
    out = []
    for _ in range(R):
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)  # vLLM uses int32
        w = rng.random((T, K)).astype(np.float32)
        out.append((x, ids, w))
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_ll_round_trip(daemon, fp8):
    rng = np.random.default_rng(30)
    mgrs = managers(daemon, "vll%d" % fp8, "ll", fp8)
    try:
        assert mgrs[0].world_size == R and mgrs[1].rank == 1
        assert mgrs[0].get_handle({}) is mgrs[0]
        assert mgrs[0].num_local_experts == mgrs[0].ep.slots_per_rank
        for step in range(4):
            inp = inputs(rng, M - step)

            def rank_fn(r):
                x, ids, w = inp[r]
                recv_x, counts, handle = mgrs[r].dispatch(x, w, ids)
                assert handle.bank == step % 2 and handle.num_tokens == len(x)
                if fp8:
                    q, scales = recv_x
                    xs = formats.dequantize_fp8(q, scales)
                else:
                    xs = formats.bf16_to_f32(recv_x)
                y = np.zeros(xs.shape, np.float32)
                for s in range(len(counts)):
                    y[s, :counts[s]] = 2 * xs[s, :counts[s]] + s  # "expert s"
                return mgrs[r].combine(y, handle, copy=True)

            outs = run_ranks([lambda r=r: rank_fn(r) for r in range(R)])
            g = reference.geom_of(mgrs[0].ep)
            plan = reference.Plan(g, [(formats.f32_to_bf16(x), ids.astype(np.int64), w) for x, ids, w in inp])
            for r in range(R):
                x, ids, w = inp[r]
                xb = formats.bf16_to_f32(formats.f32_to_bf16(x))
                if fp8:
                    xb = formats.dequantize_fp8(*formats.quantize_fp8(formats.f32_to_bf16(x)))
                want = np.zeros_like(xb)
                for t in range(len(x)):
                    for k in range(K):
                        rank, slot = plan.dest[r][t][k]
                        want[t] += w[t, k] * formats.round_bf16(2 * xb[t] + slot)
                np.testing.assert_allclose(formats.bf16_to_f32(outs[r]), want, rtol=2 ** -7,
                                           atol=2 ** -6 * np.abs(want).max())
    finally:
        for m in mgrs:
            m.destroy()


def test_ll_zero_copy_expert_outputs(daemon):
    rng = np.random.default_rng(31)
    mgrs = managers(daemon, "vzc", "ll")
    inp = inputs(rng, 5)

    def rank_fn(r):
        x, ids, w = inp[r]
        recv_x, counts, handle = mgrs[r].dispatch(x, w, ids)
        handle.expert_output_buffer[...] = recv_x  # identity experts, written in place
        return mgrs[r].combine(handle.expert_output_buffer, handle, copy=True)

    outs = run_ranks([lambda r=r: rank_fn(r) for r in range(R)])
    for r in range(R):
        x, ids, w = inp[r]
        want = w.sum(1)[:, None] * formats.round_bf16(x)
        np.testing.assert_allclose(formats.bf16_to_f32(outs[r]), want, rtol=2 ** -7, atol=2 ** -6 * np.abs(want).max())
    for m in mgrs:
        m.destroy()


def test_ht_round_trip(daemon):
    rng = np.random.default_rng(32)
    mgrs = managers(daemon, "vht", "ht")
    inp = inputs(rng, M)

    def rank_fn(r):
        x, ids, w = inp[r]
        recv_x, counts, handle = mgrs[r].dispatch(x, w, ids)
        assert recv_x.shape == (handle.num_recv, H)
        xs = formats.bf16_to_f32(recv_x)
        y = np.zeros(xs.shape, np.float32)
        for k in range(K):
            s = handle.recv_topk_idx[:, k]
            y += np.where(s[:, None] >= 0, handle.recv_topk_weights[:, k, None] * (xs * 0.5), 0)
        return mgrs[r].combine(y, handle, copy=True)

    outs = run_ranks([lambda r=r: rank_fn(r) for r in range(R)])
    for r in range(R):
        x, ids, w = inp[r]
        want = 0.5 * w.sum(1)[:, None] * formats.round_bf16(x)
        np.testing.assert_allclose(formats.bf16_to_f32(outs[r]), want, rtol=2 ** -6, atol=2 ** -6 * np.abs(want).max())
    for m in mgrs:
        m.destroy()


def test_bad_expert_outputs_shape(daemon):
    mgrs = managers(daemon, "vbad", "ll")
    rng = np.random.default_rng(33)
    inp = inputs(rng, 3)
    handles = run_ranks([lambda r=r: mgrs[r].dispatch(inp[r][0], inp[r][2], inp[r][1])[2] for r in range(R)])
    with pytest.raises(ValueError, match="expert_outputs must have shape"):
        mgrs[0].combine(np.zeros((1, 2, H + 1), np.float32), handles[0])
    with pytest.raises(TypeError, match="expert_outputs must be float"):
        mgrs[0].combine(np.zeros((1, 2, H), np.int32), handles[0])
    run_ranks([lambda r=r: mgrs[r].combine(np.zeros((1, 1, H), np.float32), handles[r]) for r in range(R)])
    for m in mgrs:
        m.destroy()
