#!/usr/bin/python3
"""Chaos (host backend): 4 groups x 2 ranks of epd-worker processes attach, run checked steps and detach
in loops for EPD_CHAOS_SECONDS (default 40) while random workers are SIGKILLed and valid expert maps
arrive through SetExpertMap at random; one Drain at the very end. Every worker that was not killed
either matches the reference on every step (exit 0) or, when its peer was killed, fails with
EPD_ERR_PEER/EPD_ERR_TIMEOUT (exit 2); a result mismatch (exit 1) is always a failure. A pair whose
second worker attached more than a step timeout after the first (both fail step 0 naming each other)
is tolerated now and then: more than 2% of the pairs is a failure. Afterwards the
daemon's open fds and RSS are back near their baseline (taken after a warm-up round, no client attached)
and it still answers GetStatus. EPD_CHAOS_DAEMON_PREFIX (e.g. "valgrind --leak-check=full") runs the
daemon under a tool."""
import os
import random
import signal
import subprocess
import sys
import threading
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
SECONDS = float(os.environ.get("EPD_CHAOS_SECONDS", "40"))
GROUPS = 4
rng = random.Random(int(os.environ.get("EPD_CHAOS_SEED", "1234")))
failures = []
lock = threading.Lock()
stats = {"pairs": 0, "clean": 0, "killed": 0, "peer_errors": 0, "maps": 0, "map_refused": 0, "workers_ok": 0,
         "startup_skew": 0}


def fail(msg):
    with lock:
        failures.append(msg)
    print("FAIL", msg, flush=True)


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Pair:
    """Both ranks of one group, run again and again."""

    def __init__(self, d, g):
        self.d, self.g, self.procs, self.killed = d, f"chaos{g}", [None, None], [False, False]
        self.seed = 100 * g

    def start(self):
        self.seed += 1
        steps = rng.randint(4, 24)
        mode = rng.choice(["ll", "ht"])
        self.killed = [False, False]
        env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
        for r in range(2):
            self.procs[r] = subprocess.Popen(
                [str(WORKER), "-s", self.d.sock, "-g", self.g, "-r", str(r), "-n", "2", "--steps", str(steps),
                 "--seed", str(self.seed), "--mode", mode, "--experts", "16", "--tokens", "32", "--hidden", "256",
                 "--topk", "4"] + (["--skew"] if self.seed % 3 == 0 else []),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def kill_one(self):
        live = [r for r in range(2) if self.procs[r] and self.procs[r].poll() is None]
        if not live:
            return False
        r = rng.choice(live)
        self.procs[r].send_signal(signal.SIGKILL)
        self.killed[r] = True
        return True

    def finish(self, timeout=30):
        outs, rcs = [], []
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                fail(f"{self.g}: worker hung (killed after {timeout} s): {out[-300:]}")
            outs.append(out)
            rcs.append(p.returncode)
        stats["pairs"] += 1
        # Neither killed, and both failed their first step with the other named (TIMEOUT / PEER): the
        # second worker attached more than a step timeout after the first, which a loaded 2-core machine
        # does now and then (an 8 s skew was seen: the first waits the step timeout, fails and leaves, the
        # second then waits in vain). Both got the documented errors and the daemon went on; counted, and
        # a failure only when it is more than an occasional pair (below).
        if (not any(self.killed) and rcs == [2, 2] and all("step 0:" in o for o in outs) and
                all("EPD_ERR_TIMEOUT" in o or "EPD_ERR_PEER" in o for o in outs)):
            stats["startup_skew"] += 1
            return
        for r in range(2):
            if self.killed[r]:
                continue
            rc, out = rcs[r], outs[r]
            if rc == 0:
                stats["workers_ok"] += 1
                continue
            other_killed = self.killed[1 - r] or rcs[1 - r] == -signal.SIGKILL
            if rc == 2 and other_killed and ("EPD_ERR_PEER" in out or "EPD_ERR_TIMEOUT" in out):
                stats["peer_errors"] += 1
                continue
            if rc == 2 and ("EPD_ERR_BUSY" in out or "EPD_ERR_PEER" in out) and any(self.killed):
                continue  # attached while the killed rank's old client was still being reaped
            fail(f"{self.g} rank {r}: exit {rc} (peer killed: {other_killed}): {out.strip()[-400:]}")
        if not any(self.killed) and rcs == [0, 0]:
            stats["clean"] += 1


def new_map(stub, group):
    try:
        cur = stub.GetExpertMap(pb.GetExpertMapRequest(protocol_version=1, group=group), timeout=5)
    except grpc.RpcError:
        return  # no such group right now (all its clients left)
    slots = [(r, s) for r in range(cur.num_ranks) for s in range(cur.slots_per_rank)]
    rng.shuffle(slots)
    m = pb.ExpertMap(group=group, num_ranks=cur.num_ranks, slots_per_rank=cur.slots_per_rank,
                     experts=[pb.ExpertPlacement(expert=e, replicas=[pb.Replica(rank=slots[e][0], slot=slots[e][1])])
                              for e in range(len(cur.experts))])
    try:
        stub.SetExpertMap(pb.SetExpertMapRequest(protocol_version=1, map=m), timeout=5)
        stats["maps"] += 1
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            fail(f"SetExpertMap {group}: {e.code()} {e.details()}")
        stats["map_refused"] += 1


def clients(stub):
    return len(stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=10).clients)


def settle(stub, d, timeout=20):
    """Wait until no client is attached (the daemon has reaped every attach connection)."""
    end = time.time() + timeout
    while time.time() < end:
        if clients(stub) == 0:
            return True
        time.sleep(0.1)
    return False


# An ASan build keeps freed memory in its quarantine, which would read as RSS growth: turn it off (LSan
# still reports leaks at exit, checked below).
if b"__asan_init" in epdtest.EPD.read_bytes():
    os.environ["ASAN_OPTIONS"] = (os.environ.get("ASAN_OPTIONS", "") +
                                  ":quarantine_size_mb=0:thread_local_quarantine_size_kb=0").lstrip(":")
prefix = os.environ.get("EPD_CHAOS_DAEMON_PREFIX", "").split()
# The step timeout covers the start-up skew of a pair of workers on a loaded 2-core machine (a pair whose
# second worker attaches more than the timeout after the first fails by design, which is not what this
# test is about); killed peers are seen at once through the attach-socket hang-up anyway.
d = epdtest.Daemon(extra=["[engine]", "step_timeout_ms = 8000", "max_clients_per_rank = 8", "max_groups = 8",
                          "[daemon]", "token_ttl_ms = 5000"]) if not prefix else None
if prefix:  # the same daemon under a tool
    orig = epdtest.EPD
    wrapper = Path(os.environ.get("EPD_TEST_TMPDIR", "/tmp")) / "epd-wrapped"
    wrapper.write_text("#!/bin/sh\nexec " + " ".join(prefix) + f" {orig} \"$@\"\n")
    wrapper.chmod(0o755)
    epdtest.EPD = wrapper
    d = epdtest.Daemon(extra=["[engine]", "step_timeout_ms = 15000", "max_clients_per_rank = 8", "max_groups = 8",
                              "[daemon]", "token_ttl_ms = 20000"])
try:
    ch = grpc.insecure_channel("unix:" + d.sock)
    grpc.channel_ready_future(ch).result(timeout=30)
    stub = pbg.ControlStub(ch)
    pid = d.proc.pid
    pairs = [Pair(d, g) for g in range(GROUPS)]
    # warm-up: every group once, cleanly; then the baseline with nobody attached
    for p in pairs:
        p.start()
    for p in pairs:
        p.finish()
    if failures:
        raise SystemExit(1)
    if not settle(stub, d):
        fail("clients still attached after the warm-up")
    time.sleep(0.5)
    base_fds, base_rss = fds(pid), rss_kib(pid)
    print(f"baseline: {base_fds} fds, RSS {base_rss} KiB", flush=True)

    stop = time.time() + SECONDS
    for p in pairs:
        p.start()
    next_kill = time.time() + rng.uniform(0.2, 1.0)
    next_map = time.time() + rng.uniform(0.2, 1.0)
    while time.time() < stop:
        for p in pairs:
            if all(x.poll() is not None for x in p.procs):
                p.finish()
                p.start()
        now = time.time()
        if now >= next_kill:
            if rng.choice(pairs).kill_one():
                stats["killed"] += 1
            next_kill = now + rng.uniform(0.2, 1.0)
        if now >= next_map:
            new_map(stub, f"chaos{rng.randrange(GROUPS)}")
            next_map = now + rng.uniform(0.2, 1.0)
        if d.proc.poll() is not None:
            fail(f"the daemon exited ({d.proc.returncode})")
            break
        time.sleep(0.02)
    for p in pairs:
        p.finish()
    print("stats:", stats, flush=True)
    if not settle(stub, d):
        fail(f"{clients(stub)} client(s) still attached after every worker left")
    time.sleep(1.0)
    end_fds, end_rss = fds(pid), rss_kib(pid)
    print(f"after: {end_fds} fds, RSS {end_rss} KiB (baseline {base_fds} fds, {base_rss} KiB)", flush=True)
    if end_fds > base_fds + 2:
        fail(f"fd count grew: {base_fds} -> {end_fds}: {sorted(os.readlink(f'/proc/{pid}/fd/{x}') for x in os.listdir(f'/proc/{pid}/fd'))}")
    if end_rss > base_rss * 1.25 + 16384:
        fail(f"RSS grew: {base_rss} -> {end_rss} KiB")
    if stats["startup_skew"] > max(2, stats["pairs"] // 50):
        fail(f"{stats['startup_skew']} of {stats['pairs']} pairs failed their first step on start-up skew alone")
    if stats["killed"] == 0 or stats["clean"] == 0 or (stats["maps"] == 0 and SECONDS >= 20):
        fail(f"the run exercised too little: {stats}")
    st = stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=10)
    if st.state != "ready":
        fail(f"daemon state {st.state!r} after the chaos")
    stub.Drain(pb.DrainRequest(protocol_version=1), timeout=10)
    st = stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=10)
    if st.state != "draining":
        fail(f"state after Drain: {st.state!r}")
    ch.close()
    rc = d.stop(timeout=60)
    if rc != 0:
        fail(f"daemon exit {rc} on SIGTERM")
    log = d.logtext()
    if prefix:
        print("\n".join(x for x in log.splitlines() if "lost:" in x or "ERROR SUMMARY" in x or "All heap" in x))
    if prefix and "definitely lost: 0 bytes" not in log and "definitely lost" in log:
        fail("valgrind: definite leaks:\n" + "\n".join(x for x in log.splitlines() if "lost" in x))
    if "ERROR: AddressSanitizer" in log or "ERROR: LeakSanitizer" in log:
        fail("sanitizer report in the daemon log:\n" + log[log.find("ERROR:"):][:3000])
finally:
    if failures:
        print(d.logtext()[-3000:])
    d.cleanup()
print(f"62-chaos: {'FAILED' if failures else 'ok'} ({len(failures)} failure(s))")
sys.exit(1 if failures else 0)
