#!/usr/bin/python3
"""13-attach-drain: the daemon end to end over its real sockets (host backend). Attach through the
control RPC (Python gRPC + protoc-generated messages), redeem the token on the attach socket for two
fds, see an unredeemed token expire (its client detached), see the effective config in GetStatus, then
SIGTERM with a client attached: the daemon waits (state draining, health NOT_SERVING) until the client's
attach connection closes, then exits 0. A second run exits through the Drain RPC with exit=true."""
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

build = os.environ.get("EPD_BUILD", "build")
epd = os.path.join(build, "bin", "epd")
if not os.access(epd, os.X_OK):
    print(f"skip: {epd} is not built")
    sys.exit(77)
try:
    import grpc
except ImportError:
    print("FAIL: /usr/bin/python3 lacks grpc (python3-grpcio)")
    sys.exit(1)

tmp = os.environ.get("EPD_TEST_TMPDIR") or tempfile.mkdtemp()
os.makedirs(os.path.join(tmp, "run"), exist_ok=True)
gen = os.path.join(tmp, "gen")
os.makedirs(gen, exist_ok=True)
subprocess.check_call(["protoc", "--proto_path=proto", f"--python_out={gen}", "proto/epd.proto"])
sys.path.insert(0, gen)
import epd_pb2 as pb  # noqa: E402

ctl = os.path.join(tmp, "run", "control.sock")
conf = os.path.join(tmp, "epd.conf")
with open(conf, "w") as f:
    f.write(f"[daemon]\ncontrol_socket = {ctl}\ntoken_ttl_ms = 400\ndrain_timeout_ms = 6000\n"
            "[engine]\nbackend = host\nnum_ranks = 2\n")
proc = None
log = None


def fail(why):
    print("FAIL:", why)
    if log:
        log.flush()
        log.seek(0)
        print("log:\n" + log.read()[-5000:])
    if proc and proc.poll() is None:
        proc.kill()
    sys.exit(1)


def start(*extra):
    global proc, log
    log = open(os.path.join(tmp, f"epd-{time.monotonic_ns()}.log"), "w+")
    proc = subprocess.Popen([epd, "-c", conf, "-f", *extra], stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 15
    while not os.path.exists(ctl) or not os.path.exists(os.path.join(tmp, "run", "attach.sock")):
        if proc.poll() is not None:
            fail(f"daemon exited {proc.returncode} during start-up")
        if time.monotonic() > end:
            fail("no sockets after 15 s")
        time.sleep(0.05)
    ch = grpc.insecure_channel(f"unix:{ctl}")
    grpc.channel_ready_future(ch).result(timeout=10)
    return ch


def rpc(ch, name, req, reply_cls, timeout=5):
    f = ch.unary_unary(f"/epd.v1.Control/{name}", request_serializer=lambda m: m.SerializeToString(),
                       response_deserializer=reply_cls.FromString)
    return f(req, timeout=timeout)


def health(ch):
    # grpc.health.v1: HealthCheckRequest{service=1}, HealthCheckResponse{status=1}; 1 SERVING, 2 NOT_SERVING.
    f = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                       response_deserializer=lambda b: b)
    raw = f(b"", timeout=5)
    return raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0


def status(ch):
    return rpc(ch, "GetStatus", pb.GetStatusRequest(protocol_version=1), pb.StatusReply)


def attach(ch, rank):
    return rpc(ch, "Attach", pb.AttachRequest(protocol_version=1, group="g", rank=rank, num_experts=8,
                                              hidden=128, topk=2, max_tokens=8, client_name=f"t{rank}",
                                              pid=os.getpid()), pb.AttachReply)


def redeem(rep, token=None):
    """Send epd_redeem_req_t (client/epd_wire.h); return (socket, status, message, fds)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(rep.attach_socket)
    tok = token if token is not None else rep.token
    s.sendall(struct.pack("<IIQ32s", 0x45504457, 1, rep.client_id, tok))
    msg, fds, _, _ = socket.recv_fds(s, 256, 4)
    if len(msg) != 256:
        fail(f"short redeem reply: {len(msg)} bytes")
    magic, ver, st, nfds = struct.unpack_from("<IIiI", msg)
    text = msg[16:].split(b"\0", 1)[0].decode()
    if magic != 0x45504457 or ver != 1:
        fail(f"bad reply header {magic:#x} {ver}")
    if nfds != len(fds):
        fail(f"reply says {nfds} fds, got {len(fds)}")
    return s, st, text, fds


# ---- run 1: attach, redeem, expiry, SIGTERM drain ----
ch = start()
if health(ch) != 1:
    fail("health is not SERVING when ready")
st = status(ch)
if st.state != "ready":
    fail(f"state {st.state!r}")
if "daemon.token_ttl_ms = 400" not in st.config:
    fail(f"GetStatus config lacks the effective token ttl: {st.config[:300]!r}")

a0 = attach(ch, 0)
if len(a0.token) != 32 or not a0.attach_socket.endswith("/run/attach.sock"):
    fail(f"attach reply: token {len(a0.token)} bytes, socket {a0.attach_socket!r}")
bad = bytes([a0.token[0] ^ 1]) + a0.token[1:]
s, code, text, fds = redeem(a0, bad)
s.close()
if code != -16 or "unknown or expired attach token" not in text or fds:
    fail(f"wrong token: status {code} {text!r} fds {fds}")
conn0, code, text, fds = redeem(a0)
if code != 0 or len(fds) != 2:
    fail(f"redeem: status {code} {text!r}, {len(fds)} fds")
sizes = [os.fstat(fd).st_size for fd in fds]
if sizes[0] < a0.queue_bytes or sizes[1] < a0.arena_bytes:
    fail(f"fd sizes {sizes} vs queue {a0.queue_bytes} arena {a0.arena_bytes}")
for fd in fds:
    os.close(fd)
s, code, text, fds = redeem(a0)  # reuse
s.close()
if code != -16:
    fail(f"token reused: status {code} {text!r}")

a1 = attach(ch, 1)  # never redeemed: detached when the token expires (400 ms)
end = time.monotonic() + 5
while time.monotonic() < end and len(status(ch).clients) != 1:
    time.sleep(0.05)
st = status(ch)
if [c.client_id for c in st.clients] != [a0.client_id]:
    fail(f"after token expiry clients are {[c.client_id for c in st.clients]}, want [{a0.client_id}]")
s, code, text, fds = redeem(a1)
s.close()
if code != -16:
    fail(f"expired token redeemed: {code} {text!r}")

t0 = time.monotonic()
proc.send_signal(signal.SIGTERM)
time.sleep(0.8)
if proc.poll() is not None:
    fail("exited while a client was still attached")
st = status(ch)
if st.state != "draining" or not st.draining:
    fail(f"state {st.state!r} draining={st.draining} after SIGTERM")
if health(ch) != 2:
    fail("health is not NOT_SERVING while draining")
try:
    attach(ch, 1)
    fail("attach accepted while draining")
except grpc.RpcError:
    pass
conn0.close()  # the client dies: hang-up detaches it, the drain completes
try:
    rc = proc.wait(timeout=5)
except subprocess.TimeoutExpired:
    fail("still running 5 s after the last client left")
dt = time.monotonic() - t0
if rc != 0:
    fail(f"exit status {rc}")
if dt > 5:
    fail(f"exit took {dt:.1f} s (should follow the client's hang-up, not the 6 s timeout)")
ch.close()

# ---- run 2: Drain RPC with exit=true ----
ch = start()
rep = rpc(ch, "Drain", pb.DrainRequest(protocol_version=1, exit=True), pb.DrainReply)
if rep.clients != 0:
    fail(f"Drain reply says {rep.clients} clients")
try:
    rc = proc.wait(timeout=5)
except subprocess.TimeoutExpired:
    fail("Drain(exit=true) with no client did not exit within 5 s")
if rc != 0:
    fail(f"exit status {rc} after Drain")
ch.close()

# ---- run 3: a client that never leaves: exit at the drain timeout; a second SIGTERM exits at once ----
for second_signal in (False, True):
    ch = start("-o", "daemon.drain_timeout_ms=1000")
    a = attach(ch, 0)
    conn, code, text, fds = redeem(a)
    if code != 0:
        fail(f"redeem: {code} {text!r}")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if second_signal:
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        fail("still running 5 s after SIGTERM with drain_timeout_ms=1000")
    dt3 = time.monotonic() - t0
    if rc != 0:
        fail(f"exit status {rc} after the drain timeout")
    if second_signal and dt3 > 0.8:
        fail(f"a second SIGTERM took {dt3:.2f} s to exit")
    if not second_signal and not 0.9 <= dt3 <= 3:
        fail(f"exit {dt3:.2f} s after SIGTERM, drain timeout is 1 s")
    log.flush()
    log.seek(0)
    text = log.read()
    want = "again while draining: exiting now" if second_signal else "drain timeout: 1 client(s) still attached"
    if want not in text:
        fail(f"log lacks {want!r}")
    conn.close()
    for fd in fds:
        os.close(fd)
    ch.close()
print(f"ok: attach/redeem/expiry; SIGTERM drain waited for the client and exited {dt:.2f} s later; Drain RPC exit")
