#!/usr/bin/python3
"""Masked ranks, measured: a group of 4 ranks attached with on_rank_loss = mask, LL steps
of 64 tokens (hidden 256 unless --hidden), top-4 of 32 experts. Ranks 0-2 step in threads of this process,
rank 3 in a child process that is SIGKILLed mid-run. One daemon of 4 ranks, or with --nodes 2 two daemons
on this host as the nodes of one world (2 ranks each, ranks 2 and 3 on node 1; the second replica of
every expert on the other node). --lose workers (two nodes): ranks 2 and 3 step in the child, both killed
at once: node 1 has no worker of the group left and node 0 goes on without that node; --lose daemon: the
same ranks, and node 1's daemon is SIGKILLed instead (its data link goes down); --lose hang: rank 3's
process is stopped (SIGSTOP: alive, its socket open, it never submits), so the rank is masked after the
step timeout (--step-timeout MS, default 2000). --backend cuda: the
daemons run the CUDA backend (--devices: their engine.devices, e.g. 0,0 where a node's ranks share GPU 0;
two nodes on one host get the NCCL settings of tests/gpu/two-nodes-lib.sh), the steps use the torch views
of the buffers. Reported, per expert map (every expert on two ranks, or on one):
  - recovery: from the SIGKILL to the survivors' first step (dispatch + combine) completed with rank 3
    masked, and the same minus the median step time (the target is <= 10 ms plus one step);
  - ops failed by the loss (the step in flight);
  - step time (rank 0's dispatch + combine, median and p90) before the kill and with the mask;
  - top-k entries dropped per step: with a replica of every expert on a live rank there must be none.

Usage: bench/mask/bench_mask.py [BUILD] [--steps N] [--hidden H] [--rounds N] [--nodes 1|2]
                                [--lose rank|workers|daemon|hang] [--step-timeout MS]
                                [--backend host|cuda] [--devices LIST]
                                [--json FILE] [--logs DIR]
(BUILD: default build). Each round runs both maps with a daemon of its own.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

R, E, K, M = 4, 32, 4, 64
H = 256
NODES = 1
LOSE = "rank"
STEP_WAIT_S = 60  # a phase that takes longer fails the run (the daemons' logs are printed)


def placement(replicas):
    per = E // R
    if not replicas:
        return [[(e // per, e % per)] for e in range(E)]
    other = 1 if NODES == 1 else R // NODES  # the next rank, or the same rank of the other node
    return [[(e // per, e % per), ((e // per + other) % R, per + e % per)] for e in range(E)]


def inputs(np, rank, seed):
    rng = np.random.default_rng(seed * 10 + rank)
    from epd import formats
    x = formats.f32_to_bf16(rng.standard_normal((M, H)).astype(np.float32))
    idx = np.array([rng.permutation(E)[:K] for _ in range(M)], np.int64)
    w = rng.random((M, K)).astype(np.float32)
    return x, idx, w


def torch_sync():
    import torch
    torch.cuda.synchronize()


def step(ep):
    """One dispatch + toy expert + combine; returns (seconds, dispatch OpStatus) or raises EpdError."""
    t0 = time.monotonic()
    b = ep.bank(0)
    if ep.on_gpu:  # run and wait; the toy expert copies every row (one kernel, waited for)
        ep.dispatch(M, stream="sync")
        st = ep.op_status()
        b.ll_y.copy_(b.ll_recv_x)
        torch_sync()
        ep.combine(stream="sync")
        return time.monotonic() - t0, st
    ep.dispatch(M)
    st = ep.op_status()
    for s in range(ep.slots_per_rank):
        n = int(b.ll_recv_count[s])
        b.ll_y[s, :n] = b.ll_recv_x[s, :n]
    ep.combine()
    return time.monotonic() - t0, st


def child(sock, ranks):
    """These ranks in their own process, a thread each: they step until killed."""
    import numpy as np
    import epd
    conn = epd.connect(sock)
    eps = [conn.attach("bench", rank=r, num_experts=E, hidden=H, topk=K, max_tokens=M, on_rank_loss="mask")
           for r in ranks]
    for r, ep in zip(ranks, eps):
        ep.set_inputs(*inputs(np, r, 1))
    print("ready", flush=True)

    def loop(ep):
        while True:
            try:
                step(ep)
            except epd.EpdError:
                time.sleep(0.001)

    for ep in eps[1:]:
        threading.Thread(target=loop, args=(ep,), daemon=True).start()
    loop(eps[0])


def mask_time(log_path, rank):
    """Wall time (s) of the daemon's first rank_masked event for `rank` (its log's local timestamps)."""
    with open(log_path) as f:
        for line in f:
            mo = re.match(r"(\S+) \S+ main: event rank_masked: group bench rank %d " % rank, line)
            if mo:
                t = datetime.datetime.strptime(mo.group(1), "%Y-%m-%dT%H:%M:%S.%f")
                return time.mktime(t.timetuple()) + t.microsecond / 1e6
    return None


def wait_steps(count, steps, failed, what):
    """Wait until count() reaches steps; past STEP_WAIT_S raise, saying how far rank 0 got."""
    t_end = time.monotonic() + STEP_WAIT_S
    while count() < steps:
        if time.monotonic() > t_end:
            raise RuntimeError("rank 0 completed %d of %d %s in %d s (failed ops per rank: %s)" %
                               (count(), steps, what, STEP_WAIT_S, failed))
        time.sleep(0.01)


def run(build, socks, replicas, steps, log_path, daemons):
    """socks: each node's control socket (world rank r attaches at node r // (R / nodes))."""
    import numpy as np
    import epd
    conns = [epd.connect(s) for s in socks]
    at = lambda r: conns[r * len(socks) // R]  # noqa: E731
    eps = [at(0).attach("bench", rank=0, num_experts=E, hidden=H, topk=K, max_tokens=M, on_rank_loss="mask")]
    lost = [3] if LOSE in ("rank", "hang") else [2, 3]  # the ranks of the child process
    eps += [at(r).attach("bench", rank=r, num_experts=E, hidden=H, topk=K, max_tokens=M, on_rank_loss="mask")
            for r in range(1, R) if r not in lost]
    kid = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", socks[-1],
                            ",".join(map(str, lost)), str(H)], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    if kid.stdout.readline().strip() != "ready":
        raise RuntimeError("the child rank did not attach")
    conns[0].control.set_expert_map(placement(replicas), group="bench")
    for r, ep in enumerate(eps):
        ep.set_inputs(*inputs(np, r, 1))
    log = [[] for _ in eps]  # per rank: (end time, seconds, masked, dropped) of each completed step
    failed = [0] * len(eps)
    stop = threading.Event()

    def loop(r):
        while not stop.is_set():
            try:
                dt, st = step(eps[r])
                log[r].append((time.monotonic(), dt, st.masked, st.dropped))
            except epd.EpdError:
                failed[r] += 1
                time.sleep(0.001)

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in range(len(eps))]
    for t in threads:
        t.start()
    try:
        wait_steps(lambda: len(log[0]), steps, failed, "steps before the kill")
    except RuntimeError:
        kid.kill()
        raise
    t_kill, t_kill_wall = time.monotonic(), time.time()
    if LOSE == "daemon":
        daemons[-1].send_signal(signal.SIGKILL)
        daemons[-1].wait()
    kid.send_signal(signal.SIGSTOP if LOSE == "hang" else signal.SIGKILL)
    if LOSE != "hang":
        kid.wait()
    n0 = len(log[0])
    try:
        wait_steps(lambda: len([e for e in log[0][n0:] if e[2]]), steps, failed, "masked steps")
    finally:
        if LOSE == "hang":  # the stopped process goes now (its rank is masked already)
            kid.kill()
            kid.wait()
    stop.set()
    for t in threads:
        t.join(10)
    before = [e[1] for e in log[0][:n0] if e[0] < t_kill][steps // 10:]  # the first steps warm up
    first = min(e[0] for e in log[0] if e[0] > t_kill and e[2])
    after = [e[1] for e in log[0] if e[0] > first]
    dropped = [e[3] for lg in log for e in lg if e[0] > first]
    med_b, med_a = statistics.median(before), statistics.median(after)
    t_mask = mask_time(log_path, 3)
    res = {
        "lose": LOSE,
        "replicas": 2 if replicas else 1,
        "masked_after_ms": (t_mask - t_kill_wall) * 1e3 if t_mask else None,
        "recovery_ms": (first - t_kill) * 1e3,
        "recovery_minus_step_ms": (first - t_kill - med_a) * 1e3,
        "ops_failed": sum(failed),
        "step_ms_before": {"median": med_b * 1e3, "p90": sorted(before)[int(len(before) * 0.9)] * 1e3,
                           "n": len(before)},
        "step_ms_masked": {"median": med_a * 1e3, "p90": sorted(after)[int(len(after) * 0.9)] * 1e3,
                           "n": len(after)},
        "dropped_per_step": statistics.mean(dropped) if dropped else 0.0,
        "entries_per_step": M * K,
    }
    for ep in eps:
        ep.detach()
    for conn in conns[:len(conns) - (LOSE == "daemon")]:
        conn.close()
    return res


def report(r):
    print("lose %s, replicas %d: masked %.1f ms after the loss; recovery %.2f ms (%.2f ms past one masked step); "
          "%d ops failed; step %.3f ms (p90 %.3f) before, %.3f ms (p90 %.3f) masked; %.2f of %d entries "
          "dropped per step" %
          (r["lose"], r["replicas"], r["masked_after_ms"] or -1, r["recovery_ms"], r["recovery_minus_step_ms"],
           r["ops_failed"], r["step_ms_before"]["median"], r["step_ms_before"]["p90"],
           r["step_ms_masked"]["median"], r["step_ms_masked"]["p90"], r["dropped_per_step"],
           r["entries_per_step"]), flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        globals()["H"] = int(sys.argv[4])
        return child(sys.argv[2], [int(r) for r in sys.argv[3].split(",")])
    ap = argparse.ArgumentParser()
    ap.add_argument("build", nargs="?", default=os.path.join(REPO, "build"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=H)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=1, choices=(1, 2))
    ap.add_argument("--lose", default="rank", choices=("rank", "workers", "daemon", "hang"))
    ap.add_argument("--step-timeout", type=int, default=2000, help="engine.step_timeout_ms of the daemons")
    ap.add_argument("--backend", default="host", choices=("host", "cuda"))
    ap.add_argument("--devices", help="engine.devices of each daemon (cuda), e.g. 0,0")
    ap.add_argument("--json")
    ap.add_argument("--logs", help="a folder to keep the daemons' logs in (replicas2-epd0.log, ...)")
    a = ap.parse_args()
    if a.lose in ("workers", "daemon") and a.nodes != 2:
        ap.error("--lose workers|daemon needs --nodes 2")
    globals()["H"] = a.hidden
    globals()["NODES"] = a.nodes
    globals()["LOSE"] = a.lose
    os.environ.setdefault("EPD_LIBRARY", os.path.join(a.build, "lib", "libepd.so"))
    results = []
    for replicas in [True, False] * a.rounds:
        d = tempfile.mkdtemp(prefix="epd-bench-mask-")
        conf = os.path.join(d, "epd.conf")
        open(conf, "w").close()
        import socket
        ps = socket.socket()
        ps.bind(("127.0.0.1", 0))
        port = ps.getsockname()[1]
        ps.close()
        socks, daemons = [], []
        try:
            for n in range(a.nodes):
                socks.append(os.path.join(d, "control%d.sock" % n))
                cluster = [] if a.nodes == 1 else [
                    "-o", "cluster.nodes=%d" % a.nodes, "-o", "cluster.node_rank=%d" % n,
                    "-o", "cluster.data_listen=127.0.0.1:0",
                    "-o", ("cluster.listen=127.0.0.1:%d" if n == 0 else "cluster.coordinator=127.0.0.1:%d") % port]
                env = dict(os.environ)
                if a.backend == "cuda" and a.nodes > 1:  # nodes on one host, as two-nodes-lib.sh
                    env.update(NCCL_HOSTID="node%d" % n, NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1",
                               NCCL_SOCKET_IFNAME="lo")
                devices = ["-o", "engine.devices=%s" % a.devices] if a.devices else []
                daemons.append(subprocess.Popen(
                    [os.path.join(a.build, "bin", "epd"), "-f", "-c", conf, "-s", socks[-1],
                     "-o", "daemon.attach_socket=%s" % os.path.join(d, "attach%d.sock" % n),
                     "-o", "engine.backend=%s" % a.backend, "-o", "engine.num_ranks=%d" % (R // a.nodes),
                     "-o", "engine.slots_factor_pct=200", "-o", "engine.step_timeout_ms=%d" % a.step_timeout,
                     "-o", "engine.max_hidden=%d" % H] + devices + cluster,
                    stdout=open(os.path.join(d, "epd%d.log" % n), "w"), stderr=subprocess.STDOUT, env=env))
            for _ in range(1200):  # the CUDA backend makes its communicators first
                if all(os.path.exists(os.path.join(d, "attach%d.sock" % n)) for n in range(a.nodes)):
                    break
                time.sleep(0.05)
            time.sleep(0.3)
            # the rank_masked event of rank 3: on its node for a rank's loss, on node 0 for a node's
            log = os.path.join(d, "epd%d.log" % (a.nodes - 1 if a.lose in ("rank", "hang") else 0))
            try:
                results.append(run(a.build, socks, replicas, a.steps, log, daemons))
            except RuntimeError as e:
                print("FAILED: %s" % e, flush=True)
                for n in range(a.nodes):
                    with open(os.path.join(d, "epd%d.log" % n)) as f:
                        tail = [ln for ln in f if " DEBUG " not in ln and "NCCL" not in ln][-40:]
                    print("--- node %d's log, last lines:\n%s" % (n, "".join(tail)), flush=True)
                return 1
            report(results[-1])
        finally:
            for daemon in daemons:
                if daemon.poll() is None:
                    daemon.terminate()
            for daemon in daemons:
                daemon.wait(15)
            if a.logs:
                os.makedirs(a.logs, exist_ok=True)
                for n in range(a.nodes):
                    shutil.copy(os.path.join(d, "epd%d.log" % n),
                                os.path.join(a.logs, "replicas%d-epd%d.log" % (2 if replicas else 1, n)))
            shutil.rmtree(d, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"geometry": {"ranks": R, "nodes": a.nodes, "experts": E, "hidden": H, "topk": K,
                                    "tokens": M, "lose": a.lose, "backend": a.backend, "devices": a.devices,
                                    "step_timeout_ms": a.step_timeout},
                       "results": results}, f, indent=1)
    return 0 if all(r["dropped_per_step"] == 0 for r in results if r["replicas"] == 2) else 1


if __name__ == "__main__":
    sys.exit(main())
