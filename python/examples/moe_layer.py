#!/usr/bin/env python3
"""An MoE layer over epd: two worker processes (one per GPU, or per host-backend rank), each holding the
gated-MLP weights of the experts on its slots, run dispatch -> expert MLP -> combine for many steps; the
parent compares every step's output with a single-process reference of the same layer.

    # CI, no GPU: host backend and NumPy (starts a daemon if --daemon is given)
    python3 moe_layer.py --host --daemon build/bin/epd --steps 20
    # two GPUs, torch, a running daemon with the CUDA backend; --graph replays captured CUDA graphs
    python3 moe_layer.py --socket /run/epd/control.sock --steps 200 --graph
    # --one-gpu: each worker sees only its GPU (CUDA_VISIBLE_DEVICES = its entry of the list it inherited,
    # or its rank), as platforms start them

Halfway through, rank 0 stages a new expert map (experts moved between ranks): the workers load the
weights of the experts now on their slots (into the same tensors, so captured graphs stay valid) and the
results must still match. Exit status 0 iff every step matched.
"""

import argparse
import os
import subprocess
import sys
import shutil
import tempfile
import time

import numpy as np

try:
    import epd
except ImportError:  # run from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import epd
from epd import formats

GROUP = "moe-example"


# ---- the layer (deterministic weights and inputs, shared by workers and reference) ---------------------

class Spec:
    def __init__(self, a):
        self.E, self.H, self.I, self.K, self.M, self.R = a.experts, a.hidden, a.inter, a.topk, a.max_tokens, 2
        self.seed, self.steps, self.mode, self.fp8 = a.seed, a.steps, a.mode, a.fp8


def expert_weights(spec, e):
    """(W1 [I, H], W3 [I, H], W2 [H, I]) float32, bf16-representable, of expert e."""
    rng = np.random.default_rng(spec.seed * 1000 + e)
    w1 = rng.standard_normal((spec.I, spec.H), dtype=np.float32) / np.sqrt(spec.H)
    w3 = rng.standard_normal((spec.I, spec.H), dtype=np.float32) / np.sqrt(spec.H)
    w2 = rng.standard_normal((spec.H, spec.I), dtype=np.float32) / np.sqrt(spec.I)
    return tuple(formats.round_bf16(w) for w in (w1, w3, w2))


def gate_weights(spec):
    rng = np.random.default_rng(spec.seed * 1000 - 1)
    return rng.standard_normal((spec.H, spec.E), dtype=np.float32) / np.sqrt(spec.H)


def step_inputs(spec, step, rank, wg):
    """(x bf16 bits [T, H], topk_ids [T, K], topk_weights [T, K]) of one rank at one step."""
    rng = np.random.default_rng((spec.seed, step, rank))
    T = spec.M if step % 3 == 0 else int(rng.integers(1, spec.M + 1))
    x = formats.f32_to_bf16(rng.standard_normal((T, spec.H), dtype=np.float32))
    logits = formats.bf16_to_f32(x) @ wg
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :spec.K].astype(np.int64)
    top = np.take_along_axis(logits, ids, 1)
    w = np.exp(top - top.max(1, keepdims=True))
    w = (w / w.sum(1, keepdims=True)).astype(np.float32)
    return x, ids, w


def mlp_np(x, w):
    w1, w3, w2 = w
    a = x @ w1.T
    return ((a / (1 + np.exp(-a))) * (x @ w3.T)) @ w2.T


def new_placement(spec):
    """The map of the second half: rank 0's experts and rank 1's swap places slot by slot, and the
    first expert of each rank trades with the other's last (a real move of weights)."""
    per = -(-spec.E // spec.R)
    pl = [[((e // per + 1) % spec.R, e % per)] for e in range(spec.E)]
    pl[0], pl[per - 1] = pl[per - 1], pl[0]
    return pl


# ---- the reference: one process, the whole layer ------------------------------------------------------

def reference_step(spec, xf, ids, w, weights, use_torch):
    """(out, mag), [T, H] float32: out = sum_k w * bf16(expert(xf)), each expert output rounded to BF16
    as the workers send it (xf: the float32 tokens the experts see); mag = sum_k |w * expert(xf)|, the
    scale of the terms, for the tolerance (a GPU expert computed in another summation order may round
    to the neighbouring BF16 value). With torch: a PyTorch computation in float32 on the CPU."""
    if use_torch:
        import torch
        xt = torch.from_numpy(np.ascontiguousarray(xf, dtype=np.float32))
        out = torch.zeros(xt.shape, dtype=torch.float32)
        mag = torch.zeros(xt.shape, dtype=torch.float32)
        for k in range(spec.K):
            for e in np.unique(ids[:, k]):
                if e < 0:
                    continue
                rows = torch.from_numpy(np.nonzero(ids[:, k] == e)[0])
                w1, w3, w2 = (torch.from_numpy(a) for a in weights[int(e)])
                xe = xt[rows]
                y = (torch.nn.functional.silu(xe @ w1.T) * (xe @ w3.T)) @ w2.T
                wk = torch.from_numpy(w[:, k])[rows, None]
                mag[rows] += (wk * y).abs()
                y = y.to(torch.bfloat16).to(torch.float32)
                out[rows] += wk * y
        return formats.round_bf16(out.numpy()), mag.numpy()
    out = np.zeros(xf.shape, np.float32)
    mag = np.zeros(xf.shape, np.float32)
    for k in range(spec.K):
        for e in np.unique(ids[:, k]):
            if e < 0:
                continue
            rows = np.nonzero(ids[:, k] == e)[0]
            y = mlp_np(xf[rows], weights[int(e)])
            mag[rows] += np.abs(w[rows, k, None] * y)
            out[rows] += w[rows, k, None] * formats.round_bf16(y)
    return formats.round_bf16(out), mag


# ---- workers ------------------------------------------------------------------------------------------

def host_worker(spec, socket, rank, barrier, results):
    """Host backend, NumPy: the arena arrays are the mapped memory itself."""
    wg = gate_weights(spec)
    with epd.connect(socket) as conn, conn.attach(GROUP, rank=rank, num_experts=spec.E, hidden=spec.H,
                                                  topk=spec.K, max_tokens=spec.M) as ep:
        version, slots = load_map(conn, ep)
        weights = {e: expert_weights(spec, e) for e in slots if e >= 0}
        for step in range(spec.steps):
            if step == spec.steps // 2:
                version = change_map(spec, conn, rank, barrier, version)
            bank = step % 2
            x, ids, w = step_inputs(spec, step, rank, wg)
            ep.set_inputs(x, ids, w, bank=bank)
            st = ep.dispatch(len(x), mode=spec.mode, fp8=spec.fp8, bank=bank)
            if st.map_version != version:  # the map of this step: load the weights of its experts
                version, slots = load_map(conn, ep)
                weights = {e: weights.get(e) or expert_weights(spec, e) for e in slots if e >= 0}
            b = ep.bank(bank)
            if spec.mode == "ll":
                for s, e in enumerate(slots):
                    n = int(b.ll_recv_count[s])
                    if n == 0:
                        continue
                    xs = (formats.dequantize_fp8(b.ll_recv_x_fp8[s, :n], b.ll_recv_scales[s, :n])
                          if spec.fp8 else formats.bf16_to_f32(b.ll_recv_x[s, :n]))
                    b.ll_y[s, :n] = formats.f32_to_bf16(mlp_np(xs, weights[e]))
            else:
                n = st.num_recv
                xs = (formats.dequantize_fp8(b.ht_recv_x_fp8[:n], b.ht_recv_scales[:n]) if spec.fp8
                      else formats.bf16_to_f32(b.ht_recv_x[:n]))
                y = np.zeros((n, spec.H), np.float32)
                for k in range(spec.K):
                    sl = b.ht_recv_topk_idx[:n, k]
                    for s in np.unique(sl[sl >= 0]):
                        rows = np.nonzero(sl == s)[0]
                        ye = formats.round_bf16(mlp_np(xs[rows], weights[slots[s]]))
                        y[rows] += b.ht_recv_topk_weights[rows, k, None] * ye
                b.ht_y[:n] = formats.f32_to_bf16(y)
            ep.combine(mode=spec.mode, bank=bank)
            results.put((step, rank, st.map_version, formats.bf16_to_f32(b.out[:len(x)]).copy()))


def torch_worker(spec, socket, rank, barrier, results, use_graph):
    """CUDA backend, torch: arena tensors over the device memory (DLPack), ops on the current stream."""
    import torch
    wg = gate_weights(spec)
    with epd.connect(socket) as conn, conn.attach(GROUP, rank=rank, num_experts=spec.E, hidden=spec.H,
                                                  topk=spec.K, max_tokens=spec.M) as ep:
        assert ep.on_gpu, "the daemon runs the host backend: use --host"
        # The rank's GPU as this process numbers it (libepd finds it by UUID: with CUDA_VISIBLE_DEVICES
        # set to one GPU it is 0, whatever the daemon's ordinal).
        torch.cuda.set_device(ep.device)
        dev = torch.device("cuda", ep.device)
        S, N = ep.slots_per_rank, ep.num_ranks * ep.max_tokens
        # Stacked slot weights [S, ...]: a map change copies new experts into these same tensors.
        W1 = torch.zeros(S, spec.I, spec.H, device=dev)
        W3 = torch.zeros(S, spec.I, spec.H, device=dev)
        W2 = torch.zeros(S, spec.H, spec.I, device=dev)

        def load(slots):
            for s, e in enumerate(slots):
                if e >= 0:
                    for dst, a in zip((W1, W3, W2), expert_weights(spec, e)):
                        dst[s].copy_(torch.from_numpy(a))

        version, slots = load_map(conn, ep)
        load(slots)

        def experts(bank):
            """LL: every slot's MLP on all its rows (rows past the count are ignored by combine)."""
            b = ep.bank(bank)
            if spec.fp8:
                q = b.ll_recv_x_fp8.to(torch.float32)
                sc = b.ll_recv_scales.repeat_interleave(128, dim=-1)[..., :spec.H]
                xs = q * sc
            else:
                xs = b.ll_recv_x.to(torch.float32)
            a = torch.bmm(xs, W1.transpose(1, 2))
            y = torch.bmm(torch.nn.functional.silu(a) * torch.bmm(xs, W3.transpose(1, 2)), W2.transpose(1, 2))
            b.ll_y.copy_(y.to(torch.bfloat16))

        def body(bank, n):
            ep.dispatch(n, mode="ll", fp8=spec.fp8, bank=bank)  # on the current stream
            experts(bank)
            ep.combine(mode="ll", bank=bank)

        graphs = {}
        for step in range(spec.steps):
            if step == spec.steps // 2:
                torch.cuda.synchronize()
                version = change_map(spec, conn, rank, barrier, version)
            bank = step % 2
            x, ids, w = step_inputs(spec, step, rank, wg)
            ep.set_inputs(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(dev),
                          torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev), bank=bank)
            map_step = step == spec.steps // 2
            if map_step:  # eager, with a sync, to learn the step's map version before running experts
                ep.dispatch(len(x), mode="ll", fp8=spec.fp8, bank=bank)
                torch.cuda.synchronize()
                st = ep.op_status(check=True)
                if st.map_version != version:
                    version, slots = load_map(conn, ep)
                    load(slots)
                experts(bank)
                ep.combine(mode="ll", bank=bank)
            elif use_graph and len(x) == spec.M:
                key = bank
                if key not in graphs:
                    # warm up on a side stream, then capture one step of this bank
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        body(bank, spec.M)
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        body(bank, spec.M)
                    graphs[key] = g
                graphs[key].replay()
            else:
                body(bank, len(x))
            torch.cuda.synchronize()
            st = ep.op_status(check=True)
            out = ep.bank(bank).out[:len(x)].to(torch.float32).cpu().numpy()
            results.put((step, rank, st.map_version, out))


def load_map(conn, ep):
    """(version, [expert of each of this rank's slots, -1 if unused]), from the map table in the
    attachment's memory (no round trip)."""
    return ep.slot_experts()


def change_map(spec, conn, rank, barrier, version):
    barrier.wait()  # every rank finished the previous step
    if rank == 0:
        conn.set_expert_map(new_placement(spec), group=GROUP)
    barrier.wait()  # staged before anyone dispatches again
    return version


def worker_main(kind, spec, socket, rank, barrier, results, use_graph=False, visible=None):
    if visible is not None:  # --one-gpu: this worker sees only its GPU (set before CUDA starts)
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        if kind == "host":
            host_worker(spec, socket, rank, barrier, results)
        else:
            torch_worker(spec, socket, rank, barrier, results, use_graph)
    except BaseException as e:
        results.put(("error", rank, repr(e), None))
        raise


# ---- driver -------------------------------------------------------------------------------------------

def start_daemon(binary, backend, tmp, opts=()):
    """opts: extra KEY=VALUE daemon options (-o), e.g. engine.devices=0,0 for two ranks on one GPU."""
    conf = os.path.join(tmp, "epd.conf")
    open(conf, "w").close()
    sock = os.path.join(tmp, "control.sock")
    log = open(os.path.join(tmp, "epd.log"), "w")
    extra = [a for o in opts for a in ("-o", o)]
    p = subprocess.Popen([binary, "-f", "-c", conf, "-s", sock, "-o", "engine.backend=" + backend,
                          "-o", "engine.num_ranks=2"] + extra, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit("epd exited at start; log: " + os.path.join(tmp, "epd.log"))
        try:
            epd.connect(sock).close()
            return p, sock
        except epd.EpdError:
            time.sleep(0.05)
    p.kill()
    raise SystemExit("epd did not start")


def visible_gpu(r):
    """The CUDA_VISIBLE_DEVICES entry of this process's GPU r (the daemon started here sees the same); with
    fewer entries than r + 1, entry r mod count (ranks sharing a GPU, as engine.devices=0,0 places them)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not vis:
        return str(r)
    ents = vis.split(",")
    return ents[r % len(ents)].strip()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", action="store_true", help="host backend with NumPy (no GPU)")
    ap.add_argument("--socket", default=None, help="control socket of a running daemon")
    ap.add_argument("--daemon", default=None, help="start this epd binary in a temp dir for the run")
    ap.add_argument("--daemon-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="with --daemon: an extra daemon option (-o KEY=VALUE), e.g. engine.devices=0,0 "
                    "for both ranks on one GPU; may be repeated")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=512, help="expert intermediate size")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mode", choices=("ll", "ht"), default="ll", help="ht: host mode only")
    ap.add_argument("--fp8", action="store_true", help="FP8 dispatch (the reference uses FP8 inputs too)")
    ap.add_argument("--graph", action="store_true", help="torch: replay full-batch steps from CUDA graphs")
    ap.add_argument("--one-gpu", action="store_true",
                    help="torch: each worker sees only its rank's GPU (CUDA_VISIBLE_DEVICES = entry `rank` "
                    "of the inherited list, mod its length, else the rank)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    spec = Spec(a)
    if spec.mode == "ht" and not a.host:
        ap.error("--mode ht is implemented in --host mode only")
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="epd-moe-")
    daemon = None
    socket = a.socket
    if a.daemon:
        lib = os.path.join(os.path.dirname(os.path.abspath(a.daemon)), "..", "lib", "libepd.so")
        if "EPD_LIBRARY" not in os.environ and os.path.exists(lib):
            os.environ["EPD_LIBRARY"] = os.path.normpath(lib)  # the libepd of the same build
        daemon, socket = start_daemon(a.daemon, "host" if a.host else "cuda", tmp, a.daemon_opt)
    try:
        barrier = ctx.Barrier(spec.R)
        results = ctx.Queue()
        procs = [ctx.Process(target=worker_main, args=("host" if a.host else "torch", spec, socket, r,
                                                        barrier, results, a.graph,
                                                        visible_gpu(r) if a.one_gpu and not a.host else None))
                 for r in range(spec.R)]
        for p in procs:
            p.start()
        return check(spec, a, results, procs)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)  # kept only when the daemon did not start (its log)


def check(spec, a, results, procs):
    use_torch = not a.host
    wg = gate_weights(spec)
    all_weights = [expert_weights(spec, e) for e in range(spec.E)]
    worst, failures, got = 0.0, 0, 0
    versions = set()
    t0 = time.monotonic()
    while got < spec.steps * spec.R:
        try:
            step, rank, version, out = results.get(timeout=120)
        except Exception:
            print("FAIL: no result for 120 s (workers: %s)" % [p.exitcode for p in procs])
            return 1
        if step == "error":
            print("FAIL: worker %d: %s" % (rank, version))
            return 1
        got += 1
        versions.add(version)
        x, ids, w = step_inputs(spec, step, rank, wg)
        xf = formats.dequantize_fp8(*formats.quantize_fp8(x)) if spec.fp8 else formats.bf16_to_f32(x)
        ref, mag = reference_step(spec, xf, ids, w, all_weights, use_torch)
        err = np.abs(out - ref)
        scale = np.sqrt(np.mean(ref ** 2)) + 1e-6
        rel = float(err.max() / scale)
        # BF16 rounding: of the output (2^-8 relative each side) and of each expert's output (one BF16
        # step, 2^-7 relative, of each weighted term), plus a floor at the output's scale.
        ok = np.all(err <= 2 ** -7 * (np.abs(ref) + mag + scale))
        worst = max(worst, rel)
        if not ok:
            failures += 1
            print("step %3d rank %d: mismatch, max |out-ref| / rms(ref) = %.3g" % (step, rank, rel))
    for p in procs:
        p.join(30)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    print("%d steps x %d ranks, %s mode%s%s, map versions %s: %d mismatches, worst max|out-ref|/rms(ref) "
          "%.3g, %.2fs" % (spec.steps, spec.R, spec.mode, " fp8" if spec.fp8 else "",
                           " graph" if a.graph else "", sorted(versions), failures, worst,
                           time.monotonic() - t0))
    if len(versions) < 2 and spec.steps >= 2:
        print("FAIL: the expert map change did not take effect")
        return 1
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main())
