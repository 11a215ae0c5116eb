#!/bin/bash
# 30-e2e: the real daemon (host backend) with epd-worker processes checking every step against the
# reference: LL with skewed routing, HT with FP8, two groups at once, detach and re-attach of the same
# ranks, and a worker killed mid-step: its peer gets a clear error (EPD_ERR_PEER or EPD_ERR_TIMEOUT)
# promptly, the daemon keeps serving, and a new client of that rank attaches and runs; SIGTERM while two
# workers hold between a dispatch and its combine: the combines run and match, the next dispatches fail
# with EPD_ERR_DRAINING, and the daemon exits 0.
set -u
B=${EPD_BUILD:-build}
EPD=$B/bin/epd
WORKER=$B/bin/epd-worker
[ -x "$EPD" ] || { echo "skip: $EPD is not built"; exit 77; }
[ -x "$WORKER" ] || { echo "skip: $WORKER is not built"; exit 77; }
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$T/run"
LOG=$T/epd.log
SOCK=$T/run/control.sock
PID=
fail() {
  echo "FAIL: $*"
  for f in "$T"/w*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -8; done
  [ -f "$LOG" ] && sed 's/^/  log| /' "$LOG" | tail -30
  [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }

"$EPD" -s "$SOCK" -f -o engine.backend=host -o engine.num_ranks=2 -o engine.step_timeout_ms=4000 \
  -o daemon.attach_socket="$T/run/attach.sock" -o daemon.drain_timeout_ms=10000 2> "$LOG" &
PID=$!
wait_for 15 test -S "$SOCK" || fail "no control socket"
wait_for 5 test -S "$T/run/attach.sock" || fail "no attach socket"

# worker NAME ARGS...: start one worker in the background, output in $T/NAME.out, pid in W_NAME.
# Workers leave on error paths without freeing (exit codes matter here): no leak check for them.
worker() {
  local n=$1; shift
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 60 "$WORKER" -s "$SOCK" "$@" > "$T/$n.out" 2>&1 &
  eval "W_$n=$!"
}
. "$(dirname "${BASH_SOURCE[0]}")/../worker-lib.sh"

echo "== LL, skewed routing, 12 steps"
worker wa0 -g ll -r 0 -n 2 --steps 12 --seed 5 --skew
worker wa1 -g ll -r 1 -n 2 --steps 12 --seed 5 --skew
expect_ok wa0; expect_ok wa1

echo "== two groups at once: HT + FP8 + skew, and LL + FP8 with special values (detach and re-attach of the same ranks)"
worker wb0 -g ht -r 0 -n 2 --steps 8 --seed 9 --mode ht --fp8 --skew --experts 12 --topk 3 --tokens 40
worker wb1 -g ht -r 1 -n 2 --steps 8 --seed 9 --mode ht --fp8 --skew --experts 12 --topk 3 --tokens 40
worker wc0 -g ll -r 0 -n 2 --steps 8 --seed 6 --fp8 --specials
worker wc1 -g ll -r 1 -n 2 --steps 8 --seed 6 --fp8 --specials
expect_ok wb0; expect_ok wb1; expect_ok wc0; expect_ok wc1

echo "== HT dense layout (EPD_DESC_HT_DENSE), BF16 and FP8, uneven token counts: every rank gets every token"
worker wn0 -g htd -r 0 -n 2 --steps 8 --seed 19 --mode ht --dense --skew --experts 12 --topk 3 --tokens 40 -v
worker wn1 -g htd -r 1 -n 2 --steps 8 --seed 19 --mode ht --dense --skew --experts 12 --topk 3 --tokens 40 -v
worker wo0 -g htd8 -r 0 -n 2 --steps 6 --seed 20 --mode ht --dense --fp8 --experts 16 --hidden 256 --topk 4 --tokens 24 --specials
worker wo1 -g htd8 -r 1 -n 2 --steps 6 --seed 20 --mode ht --dense --fp8 --experts 16 --hidden 256 --topk 4 --tokens 24 --specials
expect_ok wn0; expect_ok wn1; expect_ok wo0; expect_ok wo1
# num_recv is the sum of both ranks' tokens (the worker checks every row against the reference's dense plan)
grep -q "recv=" "$T/wn0.out" || fail "no verbose step lines from the dense worker"

echo "== a worker dies mid-step"
worker wd0 -g die -r 0 -n 2 --steps 20 --seed 3
worker wd1 -g die -r 1 -n 2 --steps 20 --seed 3 --die-at-step 4
start=$(date +%s%N)
wait "$W_wd1"; rc=$?
[ $rc -eq 3 ] || fail "dying worker exited $rc, want 3"
wait "$W_wd0"; rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ $rc -eq 2 ] || fail "survivor exited $rc, want 2 (an op error)"
grep -Eq "EPD_ERR_PEER|EPD_ERR_TIMEOUT" "$T/wd0.out" || fail "survivor's error names neither PEER nor TIMEOUT"
grep -q "peer rank 1" "$T/wd0.out" || fail "survivor's error does not name rank 1"
grep -h "failed" "$T/wd0.out"
[ $ms -lt 5000 ] || fail "the survivor took $ms ms to fail"
echo "survivor failed after $ms ms"
kill -0 "$PID" 2>/dev/null || fail "the daemon died"
wait_for 5 grep -q "client_lost" "$LOG" || fail "no client_lost event in the log"

echo "== a new client of the dead rank attaches and runs"
worker we0 -g die -r 0 -n 2 --steps 6 --seed 4 --mode ht
worker we1 -g die -r 1 -n 2 --steps 6 --seed 4 --mode ht
expect_ok we0; expect_ok we1

echo "== SIGTERM between a dispatch and its combine: the combines run and match, the next dispatches fail with EPD_ERR_DRAINING"
worker wf0 -g drn -r 0 -n 2 --steps 50 --seed 6 --fp8 --hold-at 3 --hold-file "$T/drn.go"
worker wf1 -g drn -r 1 -n 2 --steps 50 --seed 6 --fp8 --hold-at 3 --hold-file "$T/drn.go"
wait_for 20 all_holding 3 wf0 wf1 || fail "group drn did not reach the hold: $(tail -qn1 "$T"/wf[01].out)"
kill -TERM "$PID"
wait_for 5 grep -q "draining (" "$LOG" || fail "the daemon does not say it drains: $(tail -3 "$LOG")"
touch "$T/drn.go"
expect_drained 3 wf0 wf1
echo "   $(grep -h "EPD_ERR_DRAINING" "$T/wf0.out" | head -1 | cut -c1-150)"
echo "== the daemon exits 0 once the workers left"
wait "$PID"; rc=$?
PID=
[ $rc -eq 0 ] || fail "daemon exited $rc on SIGTERM"
grep -q "drained: no client attached" "$LOG" || fail "the daemon did not exit because its clients left: $(tail -3 "$LOG")"
echo "30-e2e: all ok"
