#!/usr/bin/python3
"""11-notify: the daemon speaks sd_notify. Bind a datagram NOTIFY_SOCKET, start epd with it and
WATCHDOG_USEC=2000000 (WATCHDOG_PID unset), expect READY=1 with STATUS=, WATCHDOG=1 repeatedly (about
every second), RELOADING=1 then READY=1 on SIGHUP, STOPPING=1 after SIGTERM, and exit 0."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

build = os.environ.get("EPD_BUILD", "build")
epd = os.path.join(build, "bin", "epd")
if not os.access(epd, os.X_OK):
    print(f"skip: {epd} is not built")
    sys.exit(77)

tmp = os.environ.get("EPD_TEST_TMPDIR") or tempfile.mkdtemp()
os.makedirs(os.path.join(tmp, "run"), exist_ok=True)
conf = os.path.join(tmp, "epd.conf")
with open(conf, "w") as f:
    f.write(f"[daemon]\ncontrol_socket = {tmp}/run/control.sock\ndrain_timeout_ms = 2000\n"
            "[engine]\nbackend = host\n")
nsock_path = os.path.join(tmp, "notify.sock")
ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
ns.bind(nsock_path)

env = dict(os.environ)
env["NOTIFY_SOCKET"] = nsock_path
env["WATCHDOG_USEC"] = "2000000"
env.pop("WATCHDOG_PID", None)
env.pop("JOURNAL_STREAM", None)
log = open(os.path.join(tmp, "epd.log"), "w+")
proc = subprocess.Popen([epd, "-c", conf, "-f"], env=env, stdout=log, stderr=subprocess.STDOUT)
msgs = []  # (time, dict)


def fail(why):
    log.flush()
    log.seek(0)
    print("FAIL:", why)
    print("messages:", [m for _, m in msgs])
    print("log:\n" + log.read()[-4000:])
    if proc.poll() is None:
        proc.kill()
    sys.exit(1)


def recv_until(pred, timeout):
    """Collect notify messages until pred(fields) holds for one; return it or None."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ns.settimeout(max(0.01, end - time.monotonic()))
        try:
            data = ns.recv(4096).decode()
        except socket.timeout:
            break
        fields = dict(line.split("=", 1) for line in data.split("\n") if "=" in line)
        msgs.append((time.monotonic(), fields))
        if pred(fields):
            return fields
    return None


ready = recv_until(lambda m: m.get("READY") == "1", 15)
if not ready:
    fail("no READY=1 within 15 s")
if not ready.get("STATUS", "").startswith("ready"):
    fail(f"READY=1 without a ready STATUS=: {ready}")
if "host" not in ready["STATUS"]:
    fail(f"STATUS does not name the backend: {ready['STATUS']}")

# Watchdog: WATCHDOG_USEC=2 s -> a ping about every second. Expect at least 3 in 3.5 s.
t0 = time.monotonic()
pings = []
while time.monotonic() - t0 < 3.5:
    m = recv_until(lambda m: m.get("WATCHDOG") == "1", 3.5 - (time.monotonic() - t0))
    if m:
        pings.append(msgs[-1][0])
if len(pings) < 3:
    fail(f"{len(pings)} WATCHDOG=1 in 3.5 s (expected >= 3)")
gaps = [b - a for a, b in zip(pings, pings[1:])]
if max(gaps) > 1.8:
    fail(f"watchdog gap {max(gaps):.2f} s is close to WATCHDOG_USEC (2 s)")

# Reload: RELOADING=1 then READY=1 again.
proc.send_signal(signal.SIGHUP)
if not recv_until(lambda m: m.get("RELOADING") == "1", 5):
    fail("no RELOADING=1 after SIGHUP")
if not recv_until(lambda m: m.get("READY") == "1", 5):
    fail("no READY=1 after the reload")

# Stop: STOPPING=1, then exit 0.
proc.send_signal(signal.SIGTERM)
if not recv_until(lambda m: m.get("STOPPING") == "1", 5):
    fail("no STOPPING=1 after SIGTERM")
try:
    rc = proc.wait(timeout=8)
except subprocess.TimeoutExpired:
    fail("still running 8 s after SIGTERM")
if rc != 0:
    fail(f"exit status {rc}")
print(f"ok: READY, {len(pings)} watchdog pings (max gap {max(gaps):.2f} s), RELOADING/READY, STOPPING, exit 0")
