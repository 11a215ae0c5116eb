#!/bin/bash
# 14-engine-failure: when the engine can no longer run steps (on GPUs: a sticky CUDA fault; here the
# fault is injected with EPD_TEST_FAIL_AT_STEP into epd-faults, the daemon built with test hooks), every
# step gets a clear error naming the failure and
# the daemon says why: state "failed" in status, health NOT_SERVING, an "error" event, the log. With
# engine.exit_on_failure=0 it stays up like that; with the default (1) it drains and exits with status
# 1, so that systemd (Restart=on-failure) starts a fresh engine.
set -u
B=${EPD_BUILD:-build}
EPD=$B/bin/epd-faults
WORKER=$B/bin/epd-worker
CTL=$B/bin/epdctl
for x in "$EPD" "$WORKER" "$CTL"; do [ -x "$x" ] || { echo "skip: $x is not built"; exit 77; }; done
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$T/run"
LOG=$T/epd.log
SOCK=$T/run/control.sock
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -8; done
  sed 's/^/  log| /' "$LOG" | tail -20
  kill -KILL "$PID" 2>/dev/null
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }

EPD_TEST_FAIL_AT_STEP=5 "$EPD" -s "$SOCK" -f -o engine.backend=host -o engine.num_ranks=2 \
  -o engine.exit_on_failure=0 -o daemon.attach_socket="$T/run/attach.sock" 2> "$LOG" &
PID=$!
wait_for 15 test -S "$SOCK" || fail "no control socket"
wait_for 5 test -S "$T/run/attach.sock" || fail "no attach socket"
"$CTL" -s "$SOCK" health > "$T/health0.out" 2>&1 || fail "health not SERVING before the fault"
timeout 20 "$CTL" -s "$SOCK" watch --count 3 > "$T/watch.out" 2>&1 &
WPID=$!
sleep 0.3

for r in 0 1; do
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 30 "$WORKER" -s "$SOCK" -g f -r $r -n 2 \
    --steps 10 --seed 2 > "$T/w$r.out" 2>&1 &
  eval "W$r=$!"
done
wait "$W0"; rc0=$?
wait "$W1"; rc1=$?
[ $rc0 -eq 2 ] && [ $rc1 -eq 2 ] || fail "workers exited $rc0/$rc1, want 2/2 (an op error)"
grep -q "EPD_ERR_INTERNAL" "$T/w0.out" || fail "worker 0 does not report EPD_ERR_INTERNAL"
grep -q "engine failed" "$T/w1.out" "$LOG" || fail "nobody says the engine failed"
kill -0 "$PID" 2>/dev/null || fail "the daemon died"

"$CTL" -s "$SOCK" health > "$T/health1.out" 2>&1 && fail "health still SERVING after the engine failed"
grep -q "NOT_SERVING" "$T/health1.out" || fail "health does not say NOT_SERVING: $(cat "$T/health1.out")"
"$CTL" -s "$SOCK" --json status > "$T/status.out" 2>&1 || fail "status failed"
/usr/bin/python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); assert s["state"]=="failed", s["state"]' \
  "$T/status.out" || fail "status state is not failed"
wait "$WPID"
grep -q "engine failed" "$T/watch.out" || fail "no 'engine failed' event on Watch: $(cat "$T/watch.out")"

kill -TERM "$PID"
wait "$PID" || fail "daemon exit status $? after SIGTERM"

# Default engine.exit_on_failure=1: the failed daemon drains its clients and exits 1 by itself.
LOG=$T/epd2.log
rm -f "$SOCK" "$T/run/attach.sock"
EPD_TEST_FAIL_AT_STEP=3 "$EPD" -s "$SOCK" -f -o engine.backend=host -o engine.num_ranks=2 \
  -o daemon.drain_timeout_ms=3000 -o daemon.attach_socket="$T/run/attach.sock" 2> "$LOG" &
PID=$!
wait_for 15 test -S "$SOCK" || fail "no control socket (second daemon)"
wait_for 5 test -S "$T/run/attach.sock" || fail "no attach socket (second daemon)"
start=$(date +%s%N)
for r in 0 1; do
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 30 "$WORKER" -s "$SOCK" -g f -r $r -n 2 \
    --steps 10 --seed 3 > "$T/x$r.out" 2>&1 &
  eval "X$r=$!"
done
wait "$X0"; wait "$X1"
wait_for 10 sh -c "! kill -0 $PID" || fail "the failed daemon did not exit"
wait "$PID"; rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ $rc -eq 1 ] || fail "the failed daemon exited $rc, want 1 (so that systemd restarts it)"
grep -q "exiting with status 1" "$LOG" || fail "the log does not say why it exits"
echo "ok: steps fail with a clear error, state failed, health NOT_SERVING, event seen; default: exit 1 after $ms ms"
