#!/usr/bin/python3
"""Masked ranks under chaos (host backend): one group of 4 ranks attached with on_rank_loss = mask and an
expert map that places every expert on two ranks. For EPD_MASK_CHAOS_SECONDS (default 20) a random worker
is SIGKILLed about every 0.4 s (at most two ranks down at once) and a new worker of its rank starts
0.1-0.5 s later. Every third step is an HT dispatch/combine, the others LL. Every worker (epd-worker --mask) checks each step against the reference computed with
the mask its completion reports: no tokens from masked ranks, the map without their replicas, exactly
the entries of experts without a live replica dropped. Then every worker runs to its end.

Fails on: a result mismatch or a wrong dropped count (exit 1), a worker that hangs (no exit 60 s after
the chaos), survivors that did not keep stepping (fewer than 1000 checked steps in all), fewer masks
than kills, a daemon fd count above its baseline
once every worker left, or a daemon that is not ready afterwards."""
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "py"))
import epdtest  # noqa: E402

epdtest.need_daemon()
pb, pbg, _, _ = epdtest.stubs()
import grpc  # noqa: E402

WORKER = epdtest.BUILD / "bin" / "epd-worker"
if not WORKER.exists():
    epdtest.skip(f"{WORKER} not built")
SECONDS = float(os.environ.get("EPD_MASK_CHAOS_SECONDS", "20"))
R, E, STEPS = 4, 16, 400
rng = random.Random(int(os.environ.get("EPD_CHAOS_SEED", "4321")))
failures = []


def fail(msg):
    print("FAIL:", msg, flush=True)
    failures.append(msg)


# a worker killed between its Attach and the attach socket holds its rank until the token expires
d = epdtest.Daemon(num_ranks=R, extra=["[engine]", "slots_factor_pct = 200", "step_timeout_ms = 2000",
                                       "[daemon]", "token_ttl_ms = 3000"])
logdir = Path(d.dir)
procs = {}     # rank -> Popen of its current worker
finished = []  # (rank, returncode, output) of workers that exited on their own
killed = 0
seq = 0


def start(rank):
    global seq
    seq += 1
    out = open(logdir / f"w{rank}.{seq}.out", "w+")
    p = subprocess.Popen([str(WORKER), "-s", d.sock, "-g", "chaos", "-r", str(rank), "-n", str(R),
                          "--steps", str(STEPS), "--seed", "9", "--experts", str(E), "--hidden", "64",
                          "--topk", "4", "--tokens", "16", "--same-inputs", "--mask", "--ht-every", "3",
                          "--until-streak", "1000000"],
                         stdout=out, stderr=subprocess.STDOUT)
    p.out = out
    p.rank = rank
    procs[rank] = p


busy = 0


def reap(down):
    """Collect the workers that exited; one whose attach found its rank still held by the worker killed
    before it (the daemon has not seen that one's hang-up yet) starts again a moment later."""
    global busy
    for r, p in list(procs.items()):
        if p.poll() is not None:
            p.out.seek(0)
            out = p.out.read()
            del procs[r]
            if p.returncode == 2 and "is already attached" in out:
                busy += 1
                down[r] = time.time() + 0.2
                continue
            finished.append((r, p.returncode, out))


try:
    ch = grpc.insecure_channel("unix:" + d.sock)
    grpc.channel_ready_future(ch).result(timeout=30)
    stub = pbg.ControlStub(ch)
    pid = d.proc.pid
    # warm-up: one clean round, then the baseline with nobody attached
    for r in range(R):
        start(r)
    while procs:
        reap({})
        time.sleep(0.05)
    for r, rc, out in finished:
        if rc != 0:
            fail(f"warm-up: rank {r}'s worker exited {rc}:\n{out}")
    finished.clear()
    time.sleep(0.5)
    base_fds = len(os.listdir(f"/proc/{pid}/fd"))
    for r in range(R):
        start(r)
    # every expert on its rank and on the next one: one rank down drops nothing
    deadline = time.time() + 20
    while True:
        try:
            cur = stub.GetExpertMap(pb.GetExpertMapRequest(protocol_version=1, group="chaos"), timeout=5)
            break
        except grpc.RpcError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    S, per = cur.slots_per_rank, (E + R - 1) // R
    m = pb.ExpertMap(group="chaos", num_ranks=R, slots_per_rank=S, experts=[
        pb.ExpertPlacement(expert=e, replicas=[pb.Replica(rank=e // per, slot=e % per),
                                               pb.Replica(rank=(e // per + 1) % R, slot=per + e % per)])
        for e in range(E)])
    stub.SetExpertMap(pb.SetExpertMapRequest(protocol_version=1, map=m), timeout=5)
    maps = 1

    def replicated_map():
        """When every worker of the group left at once (they end together) the group was made again
        with the default map: stage the replicated one again."""
        global maps
        try:
            cur = stub.GetExpertMap(pb.GetExpertMapRequest(protocol_version=1, group="chaos"), timeout=5)
        except grpc.RpcError:
            return  # no group right now
        if all(len(p.replicas) == 1 for p in cur.experts):
            try:
                stub.SetExpertMap(pb.SetExpertMapRequest(protocol_version=1, map=m), timeout=5)
                maps += 1
            except grpc.RpcError:
                pass

    stop = time.time() + SECONDS
    down = {}  # rank -> when its new worker starts
    next_kill = time.time() + 0.5
    next_map_check = time.time() + 0.5
    while time.time() < stop:
        if time.time() >= next_map_check:
            replicated_map()
            next_map_check = time.time() + 0.5
        reap(down)
        for r in range(R):  # a worker that ran all its steps: a new one of its rank
            if r not in procs and r not in down:
                start(r)
        now = time.time()
        for r, at in list(down.items()):
            if now >= at:
                start(r)
                del down[r]
        if now >= next_kill and len(down) < 2:
            alive = [r for r, p in procs.items() if p.poll() is None]
            if len(alive) > 2:
                r = rng.choice(alive)
                procs[r].send_signal(signal.SIGKILL)
                procs[r].wait()
                procs[r].out.close()
                del procs[r]
                killed += 1
                down[r] = now + rng.uniform(0.1, 0.5)
            next_kill = now + rng.uniform(0.2, 0.6)
        if d.proc.poll() is not None:
            fail(f"the daemon exited ({d.proc.returncode})")
            break
        time.sleep(0.02)
    # the group may have been made again (every worker gone at once): count the daemon's events, not the
    # group's counter; a worker killed before it attached, or while its rank was masked, masks nothing
    masks = len(re.findall(r"event rank_masked: group chaos rank \d+ masked", d.logtext()))
    if masks < 1:
        fail(f"the group masked no rank for {killed} kills")
    end = time.time() + 60
    while (procs or down) and time.time() < end:
        for r, at in list(down.items()):
            if time.time() >= at:
                start(r)
                del down[r]
        reap(down)
        time.sleep(0.05)
    if procs:
        st = stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=10)
        print("status at the hang:", [(g.name, g.steps, g.masked_ranks, g.attached_ranks) for g in st.groups],
              [(c.rank, c.ops) for c in st.clients], "\n", d.logtext()[-3000:], flush=True)
    for r, p in procs.items():
        p.out.seek(0)
        fail(f"rank {r}'s worker still running 60 s after the chaos: a hang; its output ends:\n" +
             "\n".join(p.out.read().splitlines()[-6:]))
        p.kill()
    reap({})

    steps = 0
    for r, rc, out in finished:
        if rc != 0:
            fail(f"rank {r}'s worker exited {rc}:\n" + "\n".join(out.splitlines()[:12]))
        mo = re.search(r"rank \d+: (\d+) steps ok", out)
        if mo:
            steps += int(mo.group(1))
    print(f"killed {killed} workers, {masks} ranks masked; {len(finished)} workers finished ({busy} attaches "
          f"retried, {maps} replicated maps staged); {steps} checked steps", flush=True)
    if killed < max(3, int(SECONDS)):
        fail(f"only {killed} kills in {SECONDS} s: the run exercised too little")
    if steps < 1000:
        fail(f"only {steps} checked steps (want 1000+)")
    st = stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=10)
    if st.state != "ready":
        fail(f"daemon state {st.state!r} after the chaos")
    # once every worker left: the group is gone and the daemon's fds are back to the baseline
    end = time.time() + 20
    while time.time() < end and (st.groups or len(os.listdir(f"/proc/{pid}/fd")) > base_fds + 2):
        time.sleep(0.1)
        st = stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=10)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    if fds > base_fds + 2:  # as 62-chaos: the loop's own fds may grow by one or two
        fail(f"daemon fds {base_fds} -> {fds} after every worker left")
finally:
    for p in procs.values():
        p.kill()
    d.stop()

if failures:
    sys.exit(1)
print("66-mask-chaos: every checked step matched the reference with its mask")
