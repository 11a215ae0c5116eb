#!/usr/bin/python3
"""Daemon restart: with daemon.state_dir the expert map set by SetExpertMap (and its version) survives a
kill -9 of the daemon; clients of the dead daemon get EPD_ERR_CLOSED (not a hang) and, once a new
daemon is up on the same socket, the same process re-attaches, sees the restored map and version
(GetExpertMap and its mapped map table), runs a checked step, and the next SetExpertMap continues the
numbering. A corrupt state file is ignored with a warning (the group starts from the default map)."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "py"))
import epdtest  # noqa: E402

epdtest.need_daemon()
pb, pbg, _, _ = epdtest.stubs()
import grpc  # noqa: E402

os.environ.setdefault("EPD_BUILD", str(epdtest.BUILD))
sys.path.insert(0, str(epdtest.ROOT / "python"))
try:
    import numpy as np
    import epd
except (ImportError, OSError) as e:
    epdtest.skip(f"python client unavailable: {e}")

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


T = Path(tempfile.mkdtemp(prefix="epd-restart-"))
SOCK, STATE, CONF = str(T / "control.sock"), T / "state", T / "epd.conf"
CONF.write_text(f"[daemon]\nstate_dir = {STATE}\ndrain_timeout_ms = 2000\n"
                "[engine]\nbackend = host\nnum_ranks = 2\nstep_timeout_ms = 2000\n")
logf = open(T / "epd.log", "a+")


def start():
    p = subprocess.Popen([str(epdtest.EPD), "-f", "-c", str(CONF), "-s", SOCK], stdout=logf, stderr=subprocess.STDOUT)
    end = time.time() + 15
    while time.time() < end:
        try:
            ch = grpc.insecure_channel("unix:" + SOCK)
            pbg.ControlStub(ch).GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=1)
            return p, ch
        except grpc.RpcError:
            ch.close()
            time.sleep(0.05)
    raise AssertionError("daemon did not come up:\n" + open(T / "epd.log").read()[-2000:])


def permuted_map(cur, shift):
    slots = [(r, s) for r in range(cur.num_ranks) for s in range(cur.slots_per_rank)]
    slots = slots[shift:] + slots[:shift]
    return pb.ExpertMap(group=cur.group, num_ranks=cur.num_ranks, slots_per_rank=cur.slots_per_rank,
                        experts=[pb.ExpertPlacement(expert=e, replicas=[pb.Replica(rank=slots[e][0], slot=slots[e][1])])
                                 for e in range(len(cur.experts))])


def placement(m):
    return [[(x.rank, x.slot) for x in p.replicas] for p in sorted(m.experts, key=lambda p: p.expert)]


def step(eps):
    """One LL dispatch on every rank at once (threads); returns the results or exceptions."""
    res = [None] * len(eps)

    def body(i):
        try:
            ep = eps[i]
            T_ = 4
            x = np.ones((T_, 128), dtype=np.float32)
            idx = np.tile(np.array([0, 5], dtype=np.int64), (T_, 1))
            w = np.full((T_, 2), 0.5, dtype=np.float32)
            ep.set_inputs(x, idx, w)
            res[i] = ep.dispatch(T_, mode="ll")
        except Exception as e:  # noqa: BLE001
            res[i] = e
    th = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(eps))]
    for t in th:
        t.start()
    for t in th:
        t.join(15)
    return res


proc = None
try:
    proc, ch = start()
    stub = pbg.ControlStub(ch)
    conn = epd.connect(SOCK)
    eps = [conn.attach("rs", r, num_experts=8, hidden=128, topk=2, max_tokens=8) for r in range(2)]
    res = step(eps)
    check(all(not isinstance(r, Exception) for r in res), f"a step before the restart: {res}")
    cur = stub.GetExpertMap(pb.GetExpertMapRequest(protocol_version=1, group="rs"), timeout=5)
    v1 = stub.SetExpertMap(pb.SetExpertMapRequest(protocol_version=1, map=permuted_map(cur, 3)), timeout=5).version
    want = permuted_map(cur, 5)
    v2 = stub.SetExpertMap(pb.SetExpertMapRequest(protocol_version=1, map=want), timeout=5).version
    check(v2 == v1 + 1 >= 3, f"SetExpertMap versions {v1}, {v2}")
    files = sorted(os.listdir(STATE))
    check(files == ["map-" + "rs".encode().hex()], f"state dir holds one map file, no temporaries: {files}")

    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    ch.close()
    t0 = time.time()
    res = step(eps)
    dt = time.time() - t0
    codes = [getattr(r, "code", None) for r in res]
    check(all(isinstance(r, epd.errors.EpdError) and "EPD_ERR_CLOSED" in str(r) for r in res) and dt < 5,
          f"clients of the killed daemon get EPD_ERR_CLOSED in {dt:.2f} s: {res} {codes}")

    proc, ch = start()
    stub = pbg.ControlStub(ch)
    for ep in eps:
        ep.detach()
    conn.close()
    t0 = time.time()
    conn = epd.connect(SOCK)
    eps = [conn.attach("rs", r, num_experts=8, hidden=128, topk=2, max_tokens=8) for r in range(2)]
    check(time.time() - t0 < 2, f"the same process re-attached in {1000 * (time.time() - t0):.0f} ms")
    got = stub.GetExpertMap(pb.GetExpertMapRequest(protocol_version=1, group="rs"), timeout=5)
    check(got.version == v2 and placement(got) == placement(want),
          f"GetExpertMap after the restart: version {got.version} (want {v2}), placement restored: "
          f"{placement(got) == placement(want)}")
    check(all(ep.map_version == v2 for ep in eps), f"clients' mapped map table shows version {v2}: "
          f"{[ep.map_version for ep in eps]}")
    res = step(eps)
    check(all(not isinstance(r, Exception) for r in res), f"a step after the restart: {res}")
    v3 = stub.SetExpertMap(pb.SetExpertMapRequest(protocol_version=1, map=permuted_map(got, 1)), timeout=5).version
    check(v3 == v2 + 1, f"the next SetExpertMap continues the numbering: {v3}")
    for ep in eps:
        ep.detach()

    # a corrupt state file: ignored with a warning, the group starts from the default map
    (STATE / ("map-" + "bad".encode().hex())).write_text("epd-map 1\nversion 9 experts 8 ranks 2 slots 4\n0 1 7 7\n")
    ep = conn.attach("bad", 0, num_experts=8, hidden=128, topk=2, max_tokens=8)
    check(ep.map_version == 1, f"corrupt state file ignored (version {ep.map_version})")
    ep.detach()
    conn.close()
    logtext = open(T / "epd.log").read()
    check("is corrupt: group bad starts from the default map" in logtext, "corrupt state file logged")
    check(f"expert map version {v2} restored from the state dir" in logtext, "restore logged")
    proc.send_signal(signal.SIGTERM)
    check(proc.wait(15) == 0, "daemon exits 0 on SIGTERM")
finally:
    if proc and proc.poll() is None:
        proc.kill()
    if failures:
        print(open(T / "epd.log").read()[-3000:])
    logf.close()
    shutil.rmtree(T, ignore_errors=True)
print(f"63-restart: {'FAILED' if failures else 'ok'}")
sys.exit(1 if failures else 0)
