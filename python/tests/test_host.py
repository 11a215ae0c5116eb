"""The epd package against a real daemon on the host backend: attach, LL/HT steps (BF16 and FP8)
compared with the NumPy reference of docs/SEMANTICS.md, errors, detach, bad shapes and dtypes."""

import time

import numpy as np
import pytest

import epd
from epd import formats, reference
from conftest import run_ranks, run_ranks_all

R, E, H, K, M = 2, 8, 256, 4, 32


def attach_all(conn, group, E=E, H=H, K=K, M=M):
    eps = [conn.attach(group, rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M)]
    eps += [conn.attach(group, rank=r) for r in range(1, R)]
    return eps


def make_inputs(rng, g, ntok, skew=False, invalid=True):
    """Random inputs per rank: BF16 x, top-k ids with -1 and duplicate entries, weights."""
    out = []
    for r in range(g.num_ranks):
        T = ntok[r]
        x = formats.f32_to_bf16(rng.standard_normal((T, g.hidden)).astype(np.float32))
        if skew:
            idx = np.where(rng.random((T, g.topk)) < 0.7, 0, rng.integers(0, g.num_experts, (T, g.topk)))
        else:
            idx = np.array([rng.permutation(g.num_experts)[:g.topk] for _ in range(T)],
                           np.int64).reshape(T, g.topk)
        if invalid and T:
            idx[rng.random((T, g.topk)) < 0.15] = -1
            if T > 1 and g.topk > 1:
                idx[1, 1] = idx[1, 0]  # a duplicate entry: ignored
        w = rng.random((T, g.topk)).astype(np.float32)
        out.append((x, idx.astype(np.int64), w))
    return out


def expert_fn(x_bf16, slot, rank):
    """A cheap 'expert' for combine checks: y = bf16(x * (1 + slot/8) - rank)."""
    return formats.f32_to_bf16(formats.bf16_to_f32(x_bf16) * np.float32(1 + slot / 8) - np.float32(rank))


def check_ll(eps, plan, bank, fp8, comps):
    g = plan.g
    for r, ep in enumerate(eps):
        want = plan.ll_dispatch(r, fp8=fp8)
        b = ep.bank(bank)
        np.testing.assert_array_equal(b.ll_recv_count, want["count"], err_msg="rank %d counts" % r)
        assert comps[r].num_recv == int(want["count"].sum())
        for (s, j), row in want["rows"].items():
            assert b.ll_recv_src[s, j] == row["src"], (r, s, j)
            if fp8:
                np.testing.assert_allclose(b.ll_recv_scales[s, j], row["scales"], rtol=1e-6)
                got = formats.dequantize_fp8(b.ll_recv_x_fp8[s, j], b.ll_recv_scales[s, j])
                np.testing.assert_allclose(got, formats.dequantize_fp8(row["q"], row["scales"]),
                                           rtol=0.07, atol=float(row["scales"].max()) * 2 ** -8)
            else:
                np.testing.assert_array_equal(b.ll_recv_x[s, j], row["x"])


def fill_ll_y(ep, bank):
    b = ep.bank(bank)
    for s in range(ep.slots_per_rank):
        n = int(b.ll_recv_count[s])
        b.ll_y[s, :n] = expert_fn(b.ll_recv_x[s, :n], s, ep.rank)


def check_out(eps, plan, want_fn, bank):
    for r, ep in enumerate(eps):
        want = want_fn(r)
        T = len(want)
        got = formats.bf16_to_f32(ep.bank(bank).out[:T])
        # BF16 output; implementations may carry per-rank partials as BF16.
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -6 * (1 + np.abs(want).max(initial=0)),
                                   err_msg="rank %d OUT" % r)


def ll_step(eps, inputs, bank, fp8=False, placement=None):
    g = reference.geom_of(eps[0])
    for ep, (x, idx, w) in zip(eps, inputs):
        assert ep.set_inputs(x, idx, w, bank=bank) == len(x)
    comps = run_ranks([lambda ep=ep, n=len(inp[0]): ep.dispatch(n, mode="ll", fp8=fp8, bank=bank)
                       for ep, inp in zip(eps, inputs)])
    plan = reference.Plan(g, inputs, placement)
    check_ll(eps, plan, bank, fp8, comps)
    if fp8:
        return plan, comps  # combine of FP8 steps is checked on BF16 data in test_ll_fp8_then_combine
    for ep in eps:
        fill_ll_y(ep, bank)
    run_ranks([lambda ep=ep: ep.combine("ll", bank=bank) for ep in eps])
    ys = [ep.bank(bank).ll_y for ep in eps]
    check_out(eps, plan, lambda r: plan.ll_combine(r, ys), bank)
    return plan, comps


# ---- attach and buffers -------------------------------------------------------------------------------

def test_library_loads():
    from conftest import need_lib
    need_lib()
    assert epd.library_path()


def test_connect_to_missing_socket_raises(tmp_path):
    from conftest import need_lib
    need_lib()
    with pytest.raises(epd.EpdError) as ei:
        epd.connect(str(tmp_path / "nothing.sock"), timeout_ms=500)
    assert ei.value.code < 0 and "nothing.sock" in str(ei.value)


def test_attach_geometry_and_buffers(conn):
    with conn.attach("geo", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M) as ep0, \
            conn.attach("geo", rank=1) as ep1:
        for r, ep in enumerate((ep0, ep1)):
            assert ep.rank == r and ep.num_ranks == R
            assert ep.geometry[:5] == (R, E, H, K, M)
            assert ep.slots_per_rank >= -(-E // R)
            assert ep.ht_capacity > 0
            assert ep.backend == "host" and not ep.on_gpu
            assert ep.map_version >= 1
            assert ep.client_id > 0
            S, C = ep.slots_per_rank, ep.ht_capacity
            b = ep.bank(1)
            assert b.x.shape == (M, H) and b.x.dtype == np.uint16
            assert b.topk_idx.shape == (M, K) and b.topk_idx.dtype == np.int64
            assert b.topk_weights.shape == (M, K) and b.topk_weights.dtype == np.float32
            assert b.ll_recv_x.shape == (S, R * M, H)
            assert b.ll_recv_x_fp8.shape == (S, R * M, H) and b.ll_recv_x_fp8.dtype == np.uint8
            assert b.ll_recv_scales.shape == (S, R * M, H // 128)
            assert b.ll_recv_count.shape == (S,) and b.ll_recv_count.dtype == np.int32
            assert b.ll_y.shape == (S, R * M, H) and b.out.shape == (M, H)
            assert b.ht_recv_x.shape == (C, H) and b.ht_recv_topk_idx.shape == (C, K)
            assert b.ht_recv_src.shape == (C,) and b.ht_y.shape == (C, H)
        assert "geo" in repr(ep0)
    assert ep0.closed and ep1.closed


def test_buffers_are_views_in_place(conn):
    with conn.attach("views", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M) as ep:
        a = ep.array("x", 0)
        a[3, :4] = [1, 2, 3, 4]
        addr, nbytes = ep.buffer_address("x", 0)
        assert nbytes >= M * H * 2
        assert a.__array_interface__["data"][0] == addr  # no copy: the array is the mapped memory
        assert list(ep.bank(0).x[3, :4]) == [1, 2, 3, 4]
        assert ep.array("x", 1).__array_interface__["data"][0] != addr  # banks are distinct
        assert ep.buffer("x", 0) is a  # views are cached


def test_endpoint_properties_survive_context(conn):
    with conn.attach("ctx", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M) as ep:
        pass
    assert ep.closed
    with pytest.raises(epd.StateError, match="detached"):
        ep.dispatch(1)
    with pytest.raises(epd.StateError):
        ep.array("x")
    ep.detach()  # idempotent


def test_reattach_after_detach(conn):
    ep = conn.attach("again", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M)
    cid = ep.client_id
    ep.detach()
    # the group went away with its last client: a new first attach gives the geometry again
    with conn.attach("again", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M) as ep2:
        assert ep2.client_id != cid
        assert ep2.geometry[:5] == (R, E, H, K, M)


def test_connection_close_detaches_endpoints(daemon):
    c = epd.connect(daemon.socket)
    ep = c.attach("closing", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M)
    c.close()
    assert ep.closed and c.closed
    with pytest.raises(epd.Closed):
        c.attach("closing", rank=0)


def test_attach_bad_geometry_raises_with_text(conn):
    with pytest.raises(epd.EpdError) as ei:
        conn.attach("badgeo", rank=0, num_experts=E, hidden=H, topk=99, max_tokens=M)
    assert ei.value.message  # the C per-handle text
    with pytest.raises(epd.EpdError):
        conn.attach("badgeo2", rank=R + 5, num_experts=E, hidden=H, topk=K, max_tokens=M)


def test_attach_mismatched_geometry_raises(conn):
    with conn.attach("mis", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M):
        with pytest.raises(epd.EpdError) as ei:
            conn.attach("mis", rank=1, num_experts=E, hidden=H * 2, topk=K, max_tokens=M)
        assert ei.value.message


# ---- steps --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("skew", [False, True])
def test_ll_steps_match_reference(conn, skew):
    rng = np.random.default_rng(10 + skew)
    eps = attach_all(conn, "ll%d" % skew)
    try:
        g = reference.geom_of(eps[0])
        for step in range(6):
            ntok = [int(rng.integers(0, M + 1)) for _ in range(R)]
            if step == 0:
                ntok = [M, M]
            ll_step(eps, make_inputs(rng, g, ntok, skew=skew), bank=step % 2)
    finally:
        for ep in eps:
            ep.detach()


def test_ll_fp8_dispatch_matches_reference(conn):
    rng = np.random.default_rng(3)
    eps = attach_all(conn, "llfp8")
    g = reference.geom_of(eps[0])
    for step in range(3):
        inputs = make_inputs(rng, g, [M, M - 5])
        ll_step(eps, inputs, bank=step % 2, fp8=True)
        # an FP8 dispatch is followed by a combine of BF16 expert outputs
        for ep in eps:
            ep.bank(step % 2).ll_y[...] = 0
        run_ranks([lambda ep=ep: ep.combine("ll", bank=step % 2) for ep in eps])
    for ep in eps:
        ep.detach()


def test_ll_step_status_fields(conn):
    rng = np.random.default_rng(4)
    eps = attach_all(conn, "llst")
    g = reference.geom_of(eps[0])
    _, comps = ll_step(eps, make_inputs(rng, g, [5, 7]), bank=0)
    for c in comps:
        assert isinstance(c, epd.OpStatus) and c.ok and c.name == "EPD_OK"
        assert c.map_version >= 1
    assert comps[0].step == comps[1].step
    st = eps[0].op_status(check=True)  # the combine
    assert st.ok
    # the last op (the combine) ran in the slot before the next one; its record is the same there
    slot = (eps[0].next_slot - 1) % 8
    ss = eps[0].slot_status(slot)
    assert ss.ok and ss.step == st.step and ss.user_tag == st.user_tag
    with pytest.raises(epd.EpdError):
        eps[0].slot_status(8)
    assert not eps[0].kernel_submit  # host backend: no device twin
    for ep in eps:
        ep.detach()


def ht_step(eps, inputs, bank, fp8=False, dense=False):
    g = reference.geom_of(eps[0])
    for ep, (x, idx, w) in zip(eps, inputs):
        ep.set_inputs(x, idx, w, bank=bank)
    comps = run_ranks([lambda ep=ep, n=len(inp[0]): ep.dispatch(n, mode="ht", fp8=fp8, bank=bank, dense=dense)
                       for ep, inp in zip(eps, inputs)])
    plan = reference.Plan(g, inputs, dense=dense)
    for r, ep in enumerate(eps):
        want = plan.ht_dispatch(r)
        n = len(want["src"])
        assert comps[r].num_recv == n
        b = ep.bank(bank)
        np.testing.assert_array_equal(b.ht_recv_src[:n], want["src"])
        np.testing.assert_array_equal(b.ht_recv_topk_idx[:n], want["topk_idx"])
        np.testing.assert_array_equal(b.ht_recv_topk_weights[:n], want["topk_weights"])
        np.testing.assert_array_equal(b.ht_recv_count, want["count"])
        if fp8:
            q, s = formats.quantize_fp8(want["x"]) if n else (None, None)
            if n:
                np.testing.assert_allclose(b.ht_recv_scales[:n], s, rtol=1e-6)
                np.testing.assert_allclose(formats.dequantize_fp8(b.ht_recv_x_fp8[:n], b.ht_recv_scales[:n]),
                                           formats.dequantize_fp8(q, s), rtol=0.07,
                                           atol=float(s.max()) * 2 ** -8)
        else:
            np.testing.assert_array_equal(b.ht_recv_x[:n], want["x"])
        # the worker reduces over its local experts: y = sum_k w * expert(x)
        y = np.zeros((n, g.hidden), np.float32)
        xs = b.ht_recv_x[:n] if not fp8 else want["x"]
        for j in range(n):
            for k in range(g.topk):
                s = int(b.ht_recv_topk_idx[j, k])
                if s >= 0:
                    y[j] += b.ht_recv_topk_weights[j, k] * formats.bf16_to_f32(expert_fn(xs[j], s, r))
        if dense:  # rows of tokens with no entry here are no partials: NaN shows a combine that sums them
            y[(b.ht_recv_topk_idx[:n] < 0).all(axis=1)] = np.nan
        b.ht_y[:n] = formats.f32_to_bf16(y)
    run_ranks([lambda ep=ep: ep.combine("ht", bank=bank) for ep in eps])
    ys = [ep.bank(bank).ht_y for ep in eps]
    check_out(eps, plan, lambda r: plan.ht_combine(r, ys), bank)
    return plan, comps


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dense", [False, True])
def test_ht_steps_match_reference(conn, fp8, dense):
    rng = np.random.default_rng(20 + fp8 + 2 * dense)
    eps = attach_all(conn, "ht%d%d" % (fp8, dense))
    g = reference.geom_of(eps[0])
    for step in range(4):
        ntok = [M, M] if step == 0 else [int(rng.integers(0, M + 1)) for _ in range(R)]
        plan, comps = ht_step(eps, make_inputs(rng, g, ntok, skew=step == 3), bank=step % 2, fp8=fp8, dense=dense)
        if dense:
            assert all(c.num_recv == sum(ntok) for c in comps)  # every token of every rank
    if dense:
        with pytest.raises(epd.EpdError):  # LL has no dense layout: refused by libepd
            eps[0].dispatch(1, mode="ll", dense=True)
    for ep in eps:
        ep.detach()


def test_zero_tokens_step(conn):
    eps = attach_all(conn, "zero")
    g = reference.geom_of(eps[0])
    rng = np.random.default_rng(5)
    ll_step(eps, make_inputs(rng, g, [0, 0]), bank=0)
    for ep in eps:
        ep.detach()


# ---- errors -------------------------------------------------------------------------------------------

def test_bad_expert_fails_every_rank(conn):
    rng = np.random.default_rng(6)
    eps = attach_all(conn, "badexp")
    g = reference.geom_of(eps[0])
    inputs = make_inputs(rng, g, [4, 4])
    inputs[1][1][2, 0] = E  # out of [-1, E)
    for ep, (x, idx, w) in zip(eps, inputs):
        ep.set_inputs(x, idx, w)
    _, excs = run_ranks_all([lambda ep=ep: ep.dispatch(4) for ep in eps])
    for e in excs:
        assert isinstance(e, epd.BadExpert), e
        assert isinstance(e, ValueError)
        assert e.code == epd.errors.EPD_ERR_BAD_EXPERT
    assert any(e.peer == 1 for e in excs), [e.peer for e in excs]
    st = eps[0].op_status()
    assert st.status == epd.errors.EPD_ERR_BAD_EXPERT and not st.ok
    with pytest.raises(epd.BadExpert):
        st.check()
    # the group recovers: the next step works
    ll_step(eps, make_inputs(rng, g, [3, 3]), bank=1)
    for ep in eps:
        ep.detach()


def test_too_many_tokens_fails_every_rank(conn):
    eps = attach_all(conn, "toomany")
    _, excs = run_ranks_all([lambda: eps[0].dispatch(M + 1), lambda: eps[1].dispatch(1)])
    assert isinstance(excs[0], epd.TooManyTokens), excs[0]
    assert "EPD_ERR_TOO_MANY_TOKENS" in str(excs[0]) and "max_tokens" in excs[0].message
    # SEMANTICS.md wants the same code on every rank; libepd checks T <= M before submitting, so the
    # peer sees the step fail by timeout naming rank 0 instead.
    assert isinstance(excs[1], (epd.TooManyTokens, epd.Timeout)), excs[1]
    if isinstance(excs[1], epd.Timeout):
        assert excs[1].peer == 0
    for ep in eps:
        ep.detach()


def test_combine_without_dispatch_raises(conn):
    eps = attach_all(conn, "nocomb")
    _, excs = run_ranks_all([lambda ep=ep: ep.combine("ll", bank=0) for ep in eps])
    for e in excs:
        assert isinstance(e, epd.EpdError), e
    for ep in eps:
        ep.detach()


def test_peer_detach_mid_step_times_out_or_fails(conn):
    eps = attach_all(conn, "lonely")
    with pytest.raises((epd.Timeout, epd.PeerFailed)) as ei:
        eps[0].dispatch(1)  # rank 1 never submits
    assert ei.value.message
    for ep in eps:
        ep.detach()


# ---- bad shapes and dtypes (raised in Python, before any C call) ------------------------------------

def test_bad_shapes_and_dtypes(conn):
    with conn.attach("shapes", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M) as ep:
        x = np.zeros((4, H), np.float32)
        idx = np.zeros((4, K), np.int64)
        w = np.zeros((4, K), np.float32)
        with pytest.raises(ValueError, match=r"x must have shape \[num_tokens, hidden=256\]"):
            ep.set_inputs(np.zeros((4, H + 1), np.float32), idx, w)
        with pytest.raises(ValueError, match="x must be 2-D"):
            ep.set_inputs(np.zeros(H, np.float32), idx, w)
        with pytest.raises(ValueError, match="topk_idx must have shape"):
            ep.set_inputs(x, np.zeros((4, K + 1), np.int64), w)
        with pytest.raises(ValueError, match="topk_weights must have shape"):
            ep.set_inputs(x, idx, np.zeros((3, K), np.float32))
        with pytest.raises(ValueError, match="max_tokens is 32"):
            ep.set_inputs(np.zeros((M + 1, H), np.float32), np.zeros((M + 1, K), np.int64),
                          np.zeros((M + 1, K), np.float32))
        with pytest.raises(TypeError, match="topk_idx must be an integer dtype, got dtype float32"):
            ep.set_inputs(x, idx.astype(np.float32), w)
        with pytest.raises(TypeError, match="x must be float or bfloat16"):
            ep.set_inputs(x.astype(np.int32), idx, w)
        with pytest.raises(TypeError, match="topk_weights must be a float dtype"):
            ep.set_inputs(x, idx, w.astype(np.int64))
        with pytest.raises(ValueError, match="mode must be 'll' or 'ht'"):
            ep.dispatch(1, mode="xx")
        with pytest.raises(ValueError, match="bank must be <= 1"):
            ep.dispatch(1, bank=2)
        with pytest.raises(ValueError, match="num_tokens must be >= 0"):
            ep.dispatch(-1)
        with pytest.raises(TypeError, match="num_tokens must be an int, got str"):
            ep.dispatch("3")
        with pytest.raises(TypeError, match="num_tokens must be an int, got float"):
            ep.dispatch(3.0)
        with pytest.raises(ValueError, match="host backend runs operations synchronously"):
            ep.dispatch(1, stream=12345)
        with pytest.raises(ValueError, match="unknown buffer 'nope'"):
            ep.array("nope")
        with pytest.raises(ValueError, match="fp8=True applies to"):
            ep.array("x", fp8=True)
        with pytest.raises(AttributeError, match="no buffer 'nope'"):
            ep.bank(0).nope
        with pytest.raises(TypeError, match="rank must be an int"):
            conn.attach("shapes", rank="0")
        # nothing above reached the daemon: the endpoint still works
        assert ep.set_inputs(x, idx, w) == 4


def test_set_inputs_converts_and_writes(conn):
    with conn.attach("conv", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M) as ep:
        rng = np.random.default_rng(7)
        x = rng.standard_normal((5, H))  # float64 -> bf16 with rounding
        idx = rng.integers(-1, E, (5, K)).astype(np.int32)
        w = rng.random((5, K)).astype(np.float64)
        ep.set_inputs(x, idx, w, bank=1)
        b = ep.bank(1)
        np.testing.assert_array_equal(b.x[:5], formats.f32_to_bf16(x.astype(np.float32)))
        np.testing.assert_array_equal(b.topk_idx[:5], idx)
        np.testing.assert_array_equal(b.topk_weights[:5], w.astype(np.float32))
        bits = formats.f32_to_bf16(x)
        ep.set_inputs(bits, idx, w, bank=0)  # uint16 = BF16 bits, copied as is
        np.testing.assert_array_equal(ep.bank(0).x[:5], bits)


# ---- control RPC --------------------------------------------------------------------------------------

def need_grpc():
    pytest.importorskip("grpc", reason="control calls need grpcio")


def test_status_and_metrics(conn):
    need_grpc()
    with conn.attach("stat", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M, client_name="pytest-a"):
        st = conn.status()
        assert st["backend"] == "host"
        assert st["num_ranks"] == R
        assert any(g["name"] == "stat" and g["num_experts"] == E for g in st["groups"])
        assert any(c["name"] == "pytest-a" for c in st["clients"])
        text = conn.metrics()
        assert "# TYPE" in text and "epd_" in text


def test_expert_map_change_reroutes_steps(conn):
    need_grpc()
    rng = np.random.default_rng(8)
    eps = attach_all(conn, "remap")
    g = reference.geom_of(eps[0])
    m = conn.expert_map("remap")
    assert m.version >= 1 and len(m.placement) == E
    assert m.placement == reference.default_placement(E, R)
    _, comps = ll_step(eps, make_inputs(rng, g, [M, M]), bank=0)
    v1 = comps[0].map_version
    # swap expert 0 (rank 0) and expert E-1 (rank 1), and give expert 1 a second replica on rank 1
    new = [list(p) for p in m.placement]
    new[0], new[E - 1] = m.placement[E - 1], m.placement[0]
    S = m.slots_per_rank
    used = {rs for reps in new for rs in reps}
    spare = [(1, s) for s in range(S) if (1, s) not in used]
    if spare:
        new[1] = new[1] + [spare[0]]
    version = conn.set_expert_map(new, group="remap")
    assert version > v1
    _, comps = ll_step(eps, make_inputs(rng, g, [M, M]), bank=1, placement=new)
    assert all(c.map_version == version for c in comps)
    assert conn.expert_map("remap").placement == new
    assert eps[0].map_version == version
    # the same map from the table in each attachment's memory, without gRPC
    for ep in eps:
        v, row = ep.slot_experts()
        assert v == version and row == conn.expert_map("remap").experts_of_rank(ep.rank)
    v, reps = eps[1].expert_slots(1)
    assert v == version and reps == [tuple(rs) for rs in new[1]]
    assert eps[0].expert_slots(0)[1] == [tuple(new[0][0])]
    with pytest.raises(ValueError):
        eps[0].expert_slots(E)
    for ep in eps:
        ep.detach()


def test_invalid_expert_map_rejected(conn):
    need_grpc()
    with conn.attach("badmap", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M):
        bad = reference.default_placement(E, R)
        bad[1] = bad[0]  # (rank, slot) used twice
        with pytest.raises(epd.EpdError) as ei:
            conn.set_expert_map(bad, group="badmap")
        assert isinstance(ei.value, epd.InvalidArgument), ei.value
        assert "INVALID_ARGUMENT" in ei.value.message


# ---- masked ranks ------------------------------------------------------------------------------------

def test_masked_rank_group_goes_on_and_rank_returns(conn):
    """on_rank_loss="mask": rank 1 leaves, rank 0 steps alone (its tokens for rank 1's experts dropped,
    counted in the completion), then a new rank 1 rejoins at its first dispatch."""
    rng = np.random.default_rng(21)
    eps = [conn.attach("mask", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M, on_rank_loss="mask")]
    eps.append(conn.attach("mask", rank=1))  # takes the group's policy
    g = reference.geom_of(eps[0])
    ll_step(eps, make_inputs(rng, g, [M, M]), bank=0)
    eps[1].detach()
    idx = rng.integers(0, E, (M, K)).astype(np.int64)
    eps[0].set_inputs(formats.f32_to_bf16(rng.standard_normal((M, H)).astype(np.float32)), idx,
                      np.full((M, K), 0.5, np.float32))
    eps[0].dispatch(M)
    st = eps[0].op_status(check=True)
    assert st.masked_ranks == [1] and eps[0].masked_ranks == [1]
    per = (E + R - 1) // R  # default map: expert e on rank e // per
    want = sum(1 for t in range(M) for k in range(K)
               if idx[t, k] // per == 1 and idx[t, k] not in idx[t, :k])
    assert st.dropped == want and want > 0
    eps[0].combine()
    assert eps[0].op_status(check=True).masked == 2
    grp = [gr for gr in conn.control.status()["groups"] if gr["name"] == "mask"][0]
    assert grp["on_rank_loss"] == "mask" and int(grp["masked_ranks"]) == 2
    assert int(grp["entries_dropped"]) >= want
    eps[1] = conn.attach("mask", rank=1)
    inputs = make_inputs(rng, g, [M, M])
    for ep, (x, i, w) in zip(eps, inputs):
        ep.set_inputs(x, i, w)

    def rank0_later():  # the returning rank's dispatch is at the step boundary first, so it joins this step
        time.sleep(0.2)
        return eps[0].dispatch(M)

    run_ranks([rank0_later, lambda: eps[1].dispatch(M)])
    assert eps[0].op_status().masked == 0 and eps[1].op_status().masked == 0 and eps[0].masked_ranks == []
    run_ranks([lambda ep=ep: ep.combine() for ep in eps])
    with pytest.raises(ValueError):
        conn.attach("other", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M, on_rank_loss="later")
    for ep in eps:
        ep.detach()
