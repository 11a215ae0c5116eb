#!/usr/bin/python3
"""65-attach-flood: a local user floods the attach socket with connections that never send a token.
The daemon (host backend) runs with an open-file limit of 256 while two workers step a group throughout.
1. Bounded: daemon.max_unredeemed_per_uid = 16; 2000 idle connections: 16 are held, the others are
   answered and closed at accept (epd_attach_refused_total{reason="uid"}), logged about once a second.
2. Out of fds: a SIGHUP raises the bounds above the fd limit and the flood comes again: accept fails
   with EMFILE, the listener pauses and logs at most once a second with a count (it used to log the error
   in a tight loop: 277 MB in 10 s).
Both times the daemon's log stays small, the workers keep stepping without an error, and after the flood
closes a new pair of workers attaches and runs."""
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

B = os.environ.get("EPD_BUILD", "build")
EPD, WORKER = (os.path.join(B, "bin", n) for n in ("epd", "epd-worker"))
for p in (EPD, WORKER):
    if not os.access(p, os.X_OK):
        print(f"skip: {p} is not built")
        sys.exit(77)

DAEMON_FDS = 256
FLOOD = 2000
PER_UID, TOTAL = 16, 32
LOG_LINES_MAX, LOG_BYTES_MAX = 200, 64 * 1024

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = FLOOD + 200
if hard != resource.RLIM_INFINITY and hard < want:
    FLOOD = hard - 200
    want = hard
if FLOOD < 2 * DAEMON_FDS:
    print(f"skip: an open-file limit of {hard} leaves too few fds for the flood")
    sys.exit(77)
if soft != resource.RLIM_INFINITY and soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

T = os.environ.get("EPD_TEST_TMPDIR") or tempfile.mkdtemp(prefix="epd-flood-")
os.makedirs(os.path.join(T, "run"), exist_ok=True)
CTL = os.path.join(T, "run", "control.sock")
ATT = os.path.join(T, "run", "attach.sock")
CONF = os.path.join(T, "epd.conf")
LOG = os.path.join(T, "epd.log")
procs, flood = [], []


def fail(why):
    print("FAIL:", why)
    for n in ("w0", "w1", "n0", "n1"):
        p = os.path.join(T, n + ".out")
        if os.path.exists(p):
            print(f"--- {n}:\n" + "".join(open(p, errors="replace").readlines()[-5:]))
    if os.path.exists(LOG):
        print("--- daemon log (tail):\n" + open(LOG, errors="replace").read()[-4000:])
    for s in flood:
        s.close()
    for p in procs:
        if p.poll() is None:
            p.kill()
    sys.exit(1)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


PORT = free_port()


def write_conf(per_uid, total):
    with open(CONF, "w") as f:
        f.write(f"[daemon]\ncontrol_socket = {CTL}\ndrain_timeout_ms = 3000\n"
                f"max_unredeemed_conns = {total}\nmax_unredeemed_per_uid = {per_uid}\n"
                "[engine]\nbackend = host\nnum_ranks = 2\nstep_timeout_ms = 10000\n"
                f"[metrics]\nprometheus_listen = 127.0.0.1:{PORT}\n")


def metrics():
    """{'name{labels}': value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def log_size():
    with open(LOG, "rb") as f:
        data = f.read()
    return data.count(b"\n"), len(data)


def worker(name, group, rank, steps, verbose=False):
    env = dict(os.environ, ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") + ":detect_leaks=0")
    out = open(os.path.join(T, name + ".out"), "w")
    p = subprocess.Popen([WORKER, "-s", CTL, "-g", group, "-r", str(rank), "-n", "2", "--steps", str(steps),
                          "--seed", "5"] + (["-v"] if verbose else []), stdout=out, stderr=subprocess.STDOUT,
                         env=env)
    procs.append(p)
    return p


def out_size(name):
    return os.path.getsize(os.path.join(T, name + ".out"))


def do_flood(n, seconds):
    """Open up to n connections to the attach socket that never send a byte, for at most seconds; a
    full backlog (EAGAIN) is tried again. Returns how many were connected."""
    end = time.monotonic() + seconds
    while len(flood) < n and time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        rc = s.connect_ex(ATT)
        if rc == 0:
            flood.append(s)
        else:
            s.close()
            time.sleep(0.002)
    return len(flood)


def end_flood():
    for s in flood:
        s.close()
    flood.clear()


def check_workers(what):
    for i, w in enumerate(procs[1:3]):
        if w.poll() is not None:
            fail(f"{what}: worker w{i} exited {w.returncode}")


def set_limits(lim):
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim, lim))


t_start = time.monotonic()
write_conf(PER_UID, TOTAL)
log = open(LOG, "w")
d = subprocess.Popen([EPD, "-f", "-c", CONF], stdout=log, stderr=subprocess.STDOUT,
                     preexec_fn=lambda: set_limits(DAEMON_FDS))
procs.append(d)
end = time.monotonic() + 15
while not (os.path.exists(CTL) and os.path.exists(ATT)):
    if d.poll() is not None:
        fail(f"daemon exited {d.returncode} during start-up")
    if time.monotonic() > end:
        fail("no sockets after 15 s")
    time.sleep(0.05)

worker("w0", "flood", 0, 1000000, verbose=True)
worker("w1", "flood", 1, 1000000, verbose=True)
end = time.monotonic() + 15
while True:
    try:
        if metrics().get('epd_group_steps_total{group="flood"}', 0) >= 20:
            break
    except OSError:
        pass
    check_workers("start")
    if time.monotonic() > end:
        fail("the workers did not step within 15 s")
    time.sleep(0.1)

# ---- 1. bounded by daemon.max_unredeemed_per_uid ----
m0 = metrics()
lines0, bytes0 = log_size()
steps0 = m0['epd_group_steps_total{group="flood"}']
t0 = time.monotonic()
got = do_flood(FLOOD, 10)
time.sleep(0.5)
m1 = metrics()
lines1, bytes1 = log_size()
dt1 = time.monotonic() - t0
check_workers("flood under the bounds")
if d.poll() is not None:
    fail(f"daemon exited {d.returncode} during the flood")
refused = m1['epd_attach_refused_total{reason="uid"}'] - m0['epd_attach_refused_total{reason="uid"}']
held = m1["epd_attach_unredeemed_connections"]
if got < FLOOD:
    fail(f"only {got} of {FLOOD} flood connections were made")
if held != PER_UID:
    fail(f"{held} unredeemed connections held, want daemon.max_unredeemed_per_uid = {PER_UID}")
if refused < FLOOD - PER_UID - 64:
    fail(f"epd_attach_refused_total{{reason=\"uid\"}} rose by {refused:.0f}, want about {FLOOD - PER_UID}")
steps1 = m1['epd_group_steps_total{group="flood"}']
if steps1 <= steps0:
    fail(f"the group did not step during the flood ({steps0:.0f} -> {steps1:.0f})")
if lines1 - lines0 > LOG_LINES_MAX or bytes1 - bytes0 > LOG_BYTES_MAX:
    fail(f"the flood wrote {lines1 - lines0} lines, {bytes1 - bytes0} bytes of log")
print(f"bounded: {got} idle connections in {dt1:.1f} s: {held:.0f} held, {refused:.0f} refused (uid); "
      f"log +{lines1 - lines0} lines, +{bytes1 - bytes0} bytes; group stepped {steps0:.0f} -> {steps1:.0f}")
end_flood()

# ---- 2. bounds above the fd limit: accept runs out of fds ----
write_conf(4096, 4096)
d.send_signal(signal.SIGHUP)
end = time.monotonic() + 10
while open(LOG, errors="replace").read().count("reload done") < 1:
    if time.monotonic() > end:
        fail("no 'reload done' after SIGHUP")
    time.sleep(0.05)
# The refused connections of step 1 are gone once the daemon saw their hang-up.
end = time.monotonic() + 10
while metrics()["epd_attach_unredeemed_connections"] != 0:
    if time.monotonic() > end:
        fail("the connections of the first flood are still held 10 s after they closed")
    time.sleep(0.05)
m2 = metrics()
lines2, bytes2 = log_size()
w_before = (out_size("w0"), out_size("w1"))
t0 = time.monotonic()
got = do_flood(FLOOD, 2.5)
time.sleep(0.5)
w_mid = (out_size("w0"), out_size("w1"))
time.sleep(1.5)
w_after = (out_size("w0"), out_size("w1"))
dt2 = time.monotonic() - t0
lines3, bytes3 = log_size()
check_workers("flood past the fd limit")
if d.poll() is not None:
    fail(f"daemon exited {d.returncode} during the flood past the fd limit")
if got <= DAEMON_FDS:
    fail(f"only {got} connections were made: not past the daemon's {DAEMON_FDS} fds")
# The workers print a line per step (-v), so their output grows while they step.
if not (w_after[0] > w_mid[0] > w_before[0] and w_after[1] > w_mid[1] > w_before[1]):
    fail(f"the workers stopped stepping while the daemon was out of fds (output sizes {w_before} {w_mid} {w_after})")
text = open(LOG, errors="replace").read()[bytes2:]
accept_lines = text.count("attach socket accept:")
if "Too many open files" not in text:
    fail("the daemon never ran out of fds: the flood did not reach the limit")
if accept_lines > dt2 + 2:
    fail(f"{accept_lines} accept error lines in {dt2:.1f} s (at most one a second)")
if lines3 - lines2 > LOG_LINES_MAX or bytes3 - bytes2 > LOG_BYTES_MAX:
    fail(f"the flood past the fd limit wrote {lines3 - lines2} lines, {bytes3 - bytes2} bytes of log")
end_flood()
end = time.monotonic() + 10
while True:
    try:
        m3 = metrics()
        if m3["epd_attach_unredeemed_connections"] == 0:
            break
    except OSError:
        pass
    if time.monotonic() > end:
        fail("the daemon did not recover within 10 s of the flood's end")
    time.sleep(0.1)
errs = m3["epd_attach_accept_errors_total"] - m2["epd_attach_accept_errors_total"]
if errs < 1:
    fail("epd_attach_accept_errors_total did not count the failed accepts")
if errs > 12 * dt2 + 10:
    fail(f"{errs:.0f} failed accepts in {dt2:.1f} s: the listener did not pause")
print(f"out of fds: {got} idle connections (fd limit {DAEMON_FDS}); {errs:.0f} failed accepts, "
      f"{accept_lines} log lines for them; log +{lines3 - lines2} lines, +{bytes3 - bytes2} bytes; "
      f"worker output grew {w_before} -> {w_after} bytes")

# ---- after the flood: the stepping workers never failed, and new ones attach and run ----
check_workers("after the flood")
n0, n1 = worker("n0", "after", 0, 20), worker("n1", "after", 1, 20)
for name, p in (("n0", n0), ("n1", n1)):
    try:
        rc = p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        fail(f"new worker {name} did not finish 20 steps in 30 s")
    if rc != 0 or "steps ok" not in open(os.path.join(T, name + ".out")).read():
        fail(f"new worker {name} exited {rc}")
for name in ("w0", "w1"):
    bad = [ln for ln in open(os.path.join(T, name + ".out"), errors="replace")
           if "MISMATCH" in ln or "EPD_ERR" in ln or "failed" in ln or "differs" in ln]
    if bad:
        fail(f"worker {name} reported an error: {bad[0].strip()}")
check_workers("at the end")
for p in procs[1:3]:
    p.kill()
    p.wait()
d.send_signal(signal.SIGTERM)
try:
    rc = d.wait(timeout=15)
except subprocess.TimeoutExpired:
    fail("the daemon did not exit within 15 s of SIGTERM")
if rc != 0:
    fail(f"daemon exit status {rc} after SIGTERM")
print(f"ok: new workers attached and ran after the flood; {time.monotonic() - t_start:.1f} s in all")
