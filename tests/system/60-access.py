#!/usr/bin/python3
"""Access control: a daemon whose allow list excludes our uid refuses control and attach connections
(and logs pid/uid/gid), telling the client why (PERMISSION_DENIED / EPD_ERR_PERMISSION naming the uid, in
Python gRPC, epdctl and libepd); admin-only SetExpertMap and Drain are refused (PERMISSION_DENIED) for a
non-admin uid and allowed for a member (supplementary group) of daemon.admin_gid; max_pending_tokens
bounds the unredeemed attaches (RESOURCE_EXHAUSTED). The non-admin part needs root (to run a client
under another uid); it is skipped otherwise."""
import os
import socket
import struct
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

failures = []
ME = os.getuid()


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def wait_log(d, text, timeout=5):
    end = time.time() + timeout
    while time.time() < end:
        if text in d.logtext():
            return True
        time.sleep(0.05)
    return False


# ---- 1. allow list without our uid ----
d = epdtest.Daemon(extra=["[daemon]", "allow_uids = 12345", "allow_gids = 23456"])
try:
    ch = grpc.insecure_channel("unix:" + d.sock)
    try:
        pbg.ControlStub(ch).GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=3)
        check(False, "control connection of a uid outside allow_uids refused")
    except grpc.RpcError as e:
        # Told why, not dropped as if no daemon listened (UNAVAILABLE).
        check(e.code() == grpc.StatusCode.PERMISSION_DENIED and
              f"uid {ME} gid {os.getgid()} is not allowed on this daemon" in e.details(),
              f"control connection of uid {ME} refused with PERMISSION_DENIED naming the uid "
              f"({e.code()}: {e.details()})")
    ch.close()
    # epdctl and libepd (epd-worker) say the same.
    r = subprocess.run([str(epdtest.EPDCTL), "-s", d.sock, "status"], capture_output=True,
                       text=True, timeout=30)
    check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr and f"uid {ME} " in r.stderr,
          f"epdctl of a refused uid names the refusal: rc {r.returncode} {r.stderr.strip()!r}")
    r = subprocess.run([str(epdtest.BUILD / "bin" / "epd-worker"), "-s", d.sock, "-g", "g", "-r", "0", "-n", "2",
                        "--steps", "1"], capture_output=True, text=True, timeout=30)
    check(r.returncode != 0 and "EPD_ERR_PERMISSION" in r.stderr and f"uid {ME} " in r.stderr,
          f"epd-worker of a refused uid gets EPD_ERR_PERMISSION: rc {r.returncode} {r.stderr.strip()!r}")
    check(wait_log(d, f"control connection refused: pid {os.getpid()} uid {ME} gid {os.getgid()}"),
          "refused control connection logged with pid/uid/gid")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(os.path.join(d.dir, "attach.sock"))
    msg = s.recv(256)
    s.close()
    st = struct.unpack_from("<IIiI", msg)[2] if len(msg) == 256 else None
    check(st == -16 and b"is not allowed on this daemon" in msg, f"attach connection refused (status {st})")
    check(wait_log(d, f"attach connection refused: pid {os.getpid()} uid {ME}"), "refused attach connection logged")
    check(d.proc.poll() is None, "daemon still running after refusals")
finally:
    d.stop()
    d.cleanup()

# ---- 2. our uid allowed by list, tokens bounded ----
d = epdtest.Daemon(extra=["[daemon]", f"allow_uids = 12345,{ME}", "max_pending_tokens = 2", "max_watches = 3"])
try:
    ch = grpc.insecure_channel("unix:" + d.sock)
    stub = pbg.ControlStub(ch)
    check(stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=5).state == "ready",
          "uid in allow_uids is served")
    codes = []
    for r in range(2):
        for grp in ("a", "b"):
            try:
                stub.Attach(pb.AttachRequest(protocol_version=1, group=grp, rank=r, num_experts=8, hidden=128,
                                             topk=2, max_tokens=8), timeout=5)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name + ":" + e.details())
    check(codes[:2] == ["OK", "OK"] and all("RESOURCE_EXHAUSTED" in c and "too many pending" in c
                                            for c in codes[2:]),
          f"max_pending_tokens = 2 bounds unredeemed attaches: {codes}")
    # max_watches = 3: a fourth stream is refused, one more fits once a stream is cancelled
    watches = [stub.Watch(pb.WatchRequest(protocol_version=1), timeout=30) for _ in range(3)]
    time.sleep(0.5)
    extra = stub.Watch(pb.WatchRequest(protocol_version=1), timeout=10)
    try:
        next(extra)
        got = "a message"
    except grpc.RpcError as e:
        got = f"{e.code().name}: {e.details()}"
    check(got.startswith("RESOURCE_EXHAUSTED") and "daemon.max_watches is 3" in got,
          f"fourth Watch with max_watches = 3: {got}")
    watches[0].cancel()
    time.sleep(0.5)
    again = stub.Watch(pb.WatchRequest(protocol_version=1), timeout=2)
    try:
        next(again)
        got = "a message"
    except grpc.RpcError as e:
        got = e.code().name
    check(got == "DEADLINE_EXCEEDED", f"a Watch fits again after one is cancelled (no event: {got})")
    for w in watches[1:]:
        w.cancel()
    ch.close()
finally:
    d.stop()
    d.cleanup()

# ---- 3. admin-only SetExpertMap and Drain ----
if ME != 0:
    print("skip: admin checks need root to run a client under another uid")
    sys.exit(1 if failures else 77)

CLIENT = r"""
import sys
sys.path.insert(0, sys.argv[2])
import grpc, epd_pb2 as pb, epd_pb2_grpc as pbg
stub = pbg.ControlStub(grpc.insecure_channel("unix:" + sys.argv[1]))
out = []
for name, call in (("SetExpertMap", lambda: stub.SetExpertMap(pb.SetExpertMapRequest(protocol_version=1,
                       map=pb.ExpertMap(group="nosuch", experts=[pb.ExpertPlacement(expert=0,
                       replicas=[pb.Replica(rank=0, slot=0)])])), timeout=5)),
                   ("Drain", lambda: stub.Drain(pb.DrainRequest(protocol_version=1), timeout=5)),
                   ("GetStatus", lambda: stub.GetStatus(pb.GetStatusRequest(protocol_version=1), timeout=5))):
    try:
        call()
        out.append(name + "=OK")
    except grpc.RpcError as e:
        out.append(name + "=" + e.code().name + ":" + e.details())
print("|".join(out))
"""


def as_user(uid, gid, groups, sock):
    def drop():
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)
    r = subprocess.run(["/usr/bin/python3", "-c", CLIENT, sock, str(epdtest.BUILD.resolve() / "py-gen")],
                       capture_output=True, text=True, timeout=30, preexec_fn=drop)
    return r.stdout.strip() + r.stderr.strip()[-300:]


d = epdtest.Daemon(extra=["[daemon]", "socket_mode = 0666", "admin_uids = 4242", "admin_gid = 12346"])
try:
    os.chmod(d.dir, 0o755)
    os.chmod(epdtest.BUILD / "py-gen", 0o755)
    out = as_user(12345, 12345, [], d.sock)
    check("SetExpertMap=PERMISSION_DENIED:SetExpertMap needs admin rights" in out, f"non-admin SetExpertMap: {out}")
    check("Drain=PERMISSION_DENIED:Drain needs admin rights" in out and "GetStatus=OK" in out,
          "non-admin Drain refused, GetStatus still served")
    check(wait_log(d, "Drain refused: pid") and "uid 12345" in d.logtext(), "refusal logged")
    out = as_user(12345, 12345, [12346], d.sock)
    check("SetExpertMap=NOT_FOUND" in out and "Drain=OK" in out,
          f"member of admin_gid (supplementary group) may SetExpertMap and Drain: {out}")
finally:
    d.stop()
    d.cleanup()

print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
