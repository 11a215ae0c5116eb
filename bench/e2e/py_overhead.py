#!/usr/bin/env python3
"""Per-step cost of the Python path (epd package over libepd with ctypes, torch tensors and streams) for
LL at 128 tokens, hidden 7168, top-8, 256 experts, FP8 and BF16 dispatch + BF16 combine: the same
measurements as bench_e2e.c's memop/graph modes, made from Python, so the difference is the overhead of
the Python layer. Two ranks (spawned processes) on a running daemon with engine.backend=cuda.

    python3 bench/e2e/py_overhead.py --socket SOCK --out PREFIX [--iters 300]

Writes PREFIX.rankR.json with raw per-iteration times (µs) under the same keys as bench_e2e, plus
"<dt>.py.enqueue_call_host_us" (one ep.dispatch / ep.combine call). bench/e2e/report.py merges.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

E, H, K, M = 256, 7168, 8, 128


class Barrier:
    """Two-process spin barrier: each rank bumps its own counter (single writer, no lock)."""

    def __init__(self, shm, rank):
        self.c = np.ndarray((2,), dtype=np.int64, buffer=shm.buf)
        self.r, self.gen = rank, 0

    def wait(self):
        self.gen += 1
        self.c[self.r] = self.gen
        t0 = time.monotonic()
        while self.c[1 - self.r] < self.gen:
            if time.monotonic() - t0 > 30:
                raise SystemExit("barrier: the other rank did not arrive in 30 s")


def worker(rank, sock, group, iters, shm_name, prefix):
    import torch
    from multiprocessing import shared_memory
    import epd
    shm = shared_memory.SharedMemory(name=shm_name)
    bar = Barrier(shm, rank)
    # the rank's GPU as the daemon places it: rank r on GPU r, or r % count where the ranks share fewer
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    res = {"rank": rank, "iters": iters}
    with epd.connect(sock) as conn, conn.attach(group, rank=rank, num_experts=E, hidden=H, topk=K,
                                                max_tokens=M) as ep:
        g = torch.Generator().manual_seed(1234 + rank)
        for bank in range(2):
            x = (torch.randn(M, H, generator=g) * 0.5).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)])
            w = torch.full((M, K), 1.0 / K)
            ep.set_inputs(x.to(dev), ids.to(dev), w.to(dev), bank=bank)
            ep.bank(bank).ll_y.fill_(0.0115)
        torch.cuda.synchronize()
        st = torch.cuda.Stream(device=dev)
        for tag, fp8 in (("fp8", True), ("bf16", False)):
            with torch.cuda.stream(st):
                bar.wait()
                for i in range(20):
                    ep.dispatch(M, mode="ll", fp8=fp8, bank=i & 1)
                    ep.combine(mode="ll", bank=i & 1)
                st.synchronize()
                ep.op_status(check=True)
                # sync: per step, host clock, both ranks released by the barrier
                a = []
                for i in range(iters):
                    bar.wait()
                    t0 = time.perf_counter()
                    ep.dispatch(M, mode="ll", fp8=fp8, bank=i & 1)
                    ep.combine(mode="ll", bank=i & 1)
                    st.synchronize()
                    a.append((time.perf_counter() - t0) * 1e6)
                ep.op_status(check=True)
                res[tag + ".memop.sync.step_host_us"] = a
                # pipe: iters steps back to back; host cost of each call
                bar.wait()
                enq = 0.0
                t0 = time.perf_counter()
                for i in range(iters):
                    a0 = time.perf_counter()
                    ep.dispatch(M, mode="ll", fp8=fp8, bank=i & 1)
                    ep.combine(mode="ll", bank=i & 1)
                    enq += time.perf_counter() - a0
                st.synchronize()
                res[tag + ".memop.pipe.period_host_us"] = (time.perf_counter() - t0) * 1e6 / iters
                res[tag + ".py.enqueue_call_host_us"] = enq * 1e6 / (2 * iters)
                ep.op_status(check=True)
            # graph: 4 steps (one ring of 8 slots) captured, replayed
            while ep._lib.epd_info(ep._h, 12) != 0:  # EPD_INFO_NEXT_SLOT: align to the ring
                with torch.cuda.stream(st):
                    ep.dispatch(M, mode="ll", fp8=fp8, bank=0)
                    ep.combine(mode="ll", bank=0)
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr, stream=st):
                for i in range(4):
                    ep.dispatch(M, mode="ll", fp8=fp8, bank=i & 1)
                    ep.combine(mode="ll", bank=i & 1)
            gr.replay()
            torch.cuda.synchronize()
            a = []
            for i in range(iters):
                bar.wait()
                t0 = time.perf_counter()
                gr.replay()
                torch.cuda.current_stream().synchronize()
                a.append((time.perf_counter() - t0) * 1e6 / 4)
            res[tag + ".graph.sync.step_host_us"] = a
            bar.wait()
            t0 = time.perf_counter()
            for i in range(iters):
                gr.replay()
            torch.cuda.synchronize()
            res[tag + ".graph.pipe.period_host_us"] = (time.perf_counter() - t0) * 1e6 / (4 * iters)
            ep.op_status(check=True)
            del gr
        bar.wait()
    with open("%s.rank%d.json" % (prefix, rank), "w") as f:
        json.dump(res, f)
    shm.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--group", default="py-overhead")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default="py_overhead")
    a = ap.parse_args()
    import multiprocessing as mp
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=64)
    np.ndarray((2,), dtype=np.int64, buffer=shm.buf)[:] = 0
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=worker, args=(r, a.socket, a.group, a.iters, shm.name, a.out)) for r in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(240)
    shm.close()
    shm.unlink()
    bad = [p.exitcode for p in ps if p.exitcode != 0]
    print("py_overhead: %s" % ("ok" if not bad else "FAILED %s" % bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
