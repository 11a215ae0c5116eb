#!/bin/bash
# 51-epdctl-top: `epdctl top --iterations N --interval-ms MS` against a live host-backend daemon while two
# epd-worker processes run steps: N frames, both ranks with their client and a rising op count (ops/s > 0),
# a latency p50 for ll_dispatch, the attach events from Watch; the op counts of the last frame never
# exceed what GetStatus reports afterwards. On a terminal (a pty) q quits and restores the terminal.
# Bad arguments and a missing daemon fail with the right code.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
B=${EPD_BUILD:-build}
case $B in /*) ;; *) [ -d "$PWD/$B" ] && B=$PWD/$B || B=$ROOT/$B ;; esac
for b in epd epdctl epd-worker; do [ -x "$B/bin/$b" ] || { echo "skip: $B/bin/$b is not built"; exit 77; }; done
PY=/usr/bin/python3
T=$(mktemp -d)
SOCK=$T/control.sock
PID= W0= W1=
cleanup() {
  for p in $W0 $W1 $PID; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$T"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  [ -f "$T/top.out" ] && sed 's/^/  top| /' "$T/top.out" | tail -40
  sed 's/^/  log| /' "$T/epd.log" | tail -20
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }

"$B/bin/epd" -f -s "$SOCK" -o engine.backend=host -o engine.num_ranks=2 -o engine.step_timeout_ms=3000 \
  -o daemon.attach_socket="$T/attach.sock" -o daemon.drain_timeout_ms=2000 2> "$T/epd.log" &
PID=$!
wait_for 15 test -S "$T/attach.sock" || fail "no attach socket"

# top first, so that the workers' attach events arrive through its Watch stream.
timeout 60 "$B/bin/epdctl" -s "$SOCK" top --iterations 10 --interval-ms 300 > "$T/top.out" 2> "$T/top.err" &
TOP=$!
sleep 0.4
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
timeout 60 "$B/bin/epd-worker" -s "$SOCK" -g top -r 0 -n 2 --steps 10000000 --seed 2 > "$T/w0.out" 2>&1 & W0=$!
timeout 60 "$B/bin/epd-worker" -s "$SOCK" -g top -r 1 -n 2 --steps 10000000 --seed 2 > "$T/w1.out" 2>&1 & W1=$!
wait "$TOP"; rc=$?
[ $rc -eq 0 ] || { cat "$T/top.err"; fail "epdctl top exited $rc"; }
kill -0 "$W0" && kill -0 "$W1" || fail "a worker ended while top ran: $(cat "$T"/w*.out)"
"$B/bin/epdctl" -s "$SOCK" status --json > "$T/status.json" || fail "epdctl status"
kill -TERM "$W0" "$W1"; wait "$W0" "$W1" 2>/dev/null; W0= W1=

$PY - "$T/top.out" "$T/status.json" <<'PYEOF' || fail "top output does not match the daemon"
import json, re, sys
text = open(sys.argv[1]).read()
st = json.load(open(sys.argv[2]))
frames = [f for f in re.split(r"\n(?=epd \S+  backend )", text.strip()) if f]
assert len(frames) == 10, "want 10 frames, got %d" % len(frames)
for i, f in enumerate(frames):
    assert f.rstrip().split("\n")[0].endswith("[%d]" % (i + 1)), "frame %d header: %s" % (i + 1, f.split("\n")[0])
    assert "backend %s" % st["backend"] in f and "mode %s" % st["engine_mode"] in f, "frame %d header" % (i + 1)

def ranks(f):
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+\S+ \S+\s+(\d+)\s+(\d+)$", f, re.M)
    return {int(r[0]): (int(r[1]), int(r[2]), r[3]) for r in rows}

busy = 0
for i, f in enumerate(frames):
    rk = ranks(f)
    assert sorted(rk) == [0, 1], "frame %d: rank rows %s" % (i + 1, rk)
    if all(c == 1 and rate not in ("-", "0.0") and float(rate) > 0 for c, _, rate in rk.values()):
        busy += 1
assert busy >= 2, "fewer than 2 frames show both ranks with a client and ops/s > 0 (%d)" % busy
last = frames[-1]
lr = ranks(last)
for r in st["ranks"]:
    assert lr[r["rank"]][0] == 1, "last frame: rank %d clients %d" % (r["rank"], lr[r["rank"]][0])
    assert 0 < lr[r["rank"]][1] <= r["ops"], "last frame rank %d ops %d vs status %d" % (r["rank"], lr[r["rank"]][1], r["ops"])
m = re.search(r"^ll_dispatch\s+(\d+)\s+(.+)$", last, re.M)
assert m and int(m.group(1)) > 0 and m.group(2).strip() != "-", "ll_dispatch row: %s" % (m and m.group(0))
assert re.search(r"\d+(\.\d+)? (us|ms|s)$", m.group(2).strip()), "p50 not a time: %r" % m.group(2)
ev = re.search(r"^events: (\d+)", last, re.M)
assert ev and int(ev.group(1)) >= 2, "last frame: fewer than 2 events"
for r in (0, 1):
    assert re.search(r"^  \S+ attach\s+group=top rank=%d " % r, last, re.M), "no attach event of rank %d" % r
print("top: %d frames, %d busy, last ops %s" % (len(frames), busy, {k: v[1] for k, v in lr.items()}))
PYEOF

# On a terminal, q quits (no --iterations) and the terminal's settings come back; --help says so.
"$B/bin/epdctl" --help | grep -q "q or Ctrl-C quits" || fail "--help does not say how to quit top"
timeout 30 $PY - "$B/bin/epdctl" "$SOCK" <<'PYEOF' || fail "q on a terminal"
import os, pty, select, subprocess, sys, termios, time
master, slave = pty.openpty()
before = termios.tcgetattr(slave)
p = subprocess.Popen([sys.argv[1], "-s", sys.argv[2], "top", "--interval-ms", "200"], stdin=slave,
                     stdout=slave, stderr=slave, close_fds=True)
out = b""
def drain(seconds):
    global out
    end = time.time() + seconds
    while time.time() < end:
        r, _, _ = select.select([master], [], [], 0.05)
        if r:
            try:
                out += os.read(master, 65536)
            except OSError:
                return
drain(0.3)
while out.count(b"epd ") < 2 and p.poll() is None and len(out) < 10**6:
    drain(0.2)
assert p.poll() is None, "top ended by itself: %r" % out[-500:]
os.write(master, b"q")
deadline = time.time() + 5
while p.poll() is None and time.time() < deadline:
    drain(0.1)
assert p.poll() == 0, "top did not quit on q (rc %s): %r" % (p.poll(), out[-500:])
after = termios.tcgetattr(slave)
assert after[3] & (termios.ICANON | termios.ECHO) == before[3] & (termios.ICANON | termios.ECHO), "terminal not restored"
print("top: q quit after %d frames" % out.count(b"backend "))
PYEOF

# Argument and connection errors.
"$B/bin/epdctl" -s "$SOCK" top --interval-ms 5 --iterations 1 > /dev/null 2>&1; rc=$?
[ $rc -eq 2 ] || fail "--interval-ms 5 exited $rc, want 2"
timeout 20 "$B/bin/epdctl" -s "$T/nope.sock" --timeout 2000 top --iterations 1 > /dev/null 2> "$T/nope.err"; rc=$?
[ $rc -eq 1 ] || fail "top on a missing socket exited $rc, want 1"
grep -q "epdctl:" "$T/nope.err" || fail "top on a missing socket printed no error"

kill -TERM "$PID"
wait_for 15 bash -c "! kill -0 $PID" || fail "epd did not exit after SIGTERM"
wait "$PID"; rc=$?; PID=
[ $rc -eq 0 ] || fail "epd exited $rc"
echo "ok"
