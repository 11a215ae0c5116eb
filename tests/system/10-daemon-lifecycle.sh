#!/bin/bash
# 10-daemon-lifecycle: start epd (host backend) with a temp config and socket dir, wait for its
# sockets, reload on SIGHUP (log level change visible in the log), drain and exit 0 on SIGTERM, and
# refuse bad configurations with a message naming the key.
set -u
B=${EPD_BUILD:-build}
EPD=$B/bin/epd
[ -x "$EPD" ] || { echo "skip: $EPD is not built"; exit 77; }
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$T/run"
LOG=$T/epd.log
PID=
fail() { echo "FAIL: $*"; [ -f "$LOG" ] && sed 's/^/  log| /' "$LOG" | tail -40; [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null; exit 1; }
# wait_for SECONDS COMMAND...: poll until the command succeeds.
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }

write_conf() { # level num_ranks
  cat > "$T/epd.conf" <<CONF
[daemon]
control_socket = $T/run/control.sock
socket_mode = 0660
drain_timeout_ms = 3000
[log]
level = $1
[engine]
backend = host
num_ranks = $2
CONF
}

# --- bad configurations exit 1 and name the key ------------------------------------------------
write_conf info 0
out=$("$EPD" -c "$T/epd.conf" -f 2>&1); rc=$?
[ $rc -eq 1 ] || fail "num_ranks=0 exited $rc"
echo "$out" | grep -q "engine.num_ranks: 0 is out of range \[1, 64\] at line 9" || fail "no key in: $out"
out=$("$EPD" -c "$T/epd.conf" --check-config 2>&1); rc=$?
[ $rc -eq 1 ] || fail "--check-config on a bad file exited $rc"
echo "$out" | grep -q "engine.num_ranks" || fail "--check-config message: $out"
write_conf info 2
out=$("$EPD" -c "$T/epd.conf" -o log.level=loud -f 2>&1); rc=$?
[ $rc -eq 1 ] && echo "$out" | grep -q "log.level: 'loud' is not one of" || fail "-o log.level=loud: rc $rc: $out"
out=$("$EPD" -c "$T/epd.conf" -o bogus.key=1 -f 2>&1); rc=$?
[ $rc -eq 1 ] && echo "$out" | grep -q "unknown key 'bogus.key'" || fail "-o bogus.key: rc $rc: $out"
printf '[engine]\nbackend = gpu\n' > "$T/bad2.conf"
out=$("$EPD" -c "$T/bad2.conf" -f 2>&1); rc=$?
[ $rc -eq 1 ] && echo "$out" | grep -q "engine.backend: 'gpu' is not one of auto/host/cuda at line 2" || fail "backend=gpu: rc $rc: $out"
out=$("$EPD" -c "$T/epd.conf" -o engine.devices=0,0,0 -f 2>&1); rc=$?
[ $rc -eq 1 ] && echo "$out" | grep -q "engine.devices names 3 GPU(s) for engine.num_ranks = 2 ranks" ||
  fail "engine.devices of 3 for 2 ranks: rc $rc: $out"
out=$("$EPD" -c "$T/epd.conf" -o engine.devices=0,a -f 2>&1); rc=$?
[ $rc -eq 1 ] && echo "$out" | grep -q "engine.devices: entry 2 'a' is not an integer" || fail "engine.devices=0,a: rc $rc: $out"
out=$("$EPD" -c "$T/missing.conf" -f 2>&1); rc=$?
[ $rc -eq 1 ] && echo "$out" | grep -q "cannot open config file" || fail "missing file: rc $rc: $out"

# --- --check-config prints the effective configuration -------------------------------------------
out=$("$EPD" -c "$T/epd.conf" -o engine.max_tokens=128 --check-config 2>&1) || fail "--check-config: $out"
echo "$out" | grep -qx "engine.backend = host" || fail "check-config output: $out"
echo "$out" | grep -qx "engine.max_tokens = 128" || fail "-o not applied: $out"
echo "$out" | grep -qx "daemon.control_socket = $T/run/control.sock" || fail "socket path: $out"
# The attach socket is left empty in the file: the resolved path is shown, not "".
echo "$out" | grep -qx "daemon.attach_socket = $T/run/attach.sock" || fail "attach socket path: $out"

# --- start, sockets, reload -----------------------------------------------------------------------
"$EPD" -c "$T/epd.conf" -f 2> "$LOG" &
PID=$!
wait_for 15 test -S "$T/run/control.sock" || fail "no control socket after 15 s"
wait_for 5 test -S "$T/run/attach.sock" || fail "no attach socket"
wait_for 5 grep -q "INFO main: ready" "$LOG" || fail "no ready line"
mode=$(stat -c %a "$T/run/attach.sock")
[ "$mode" = 660 ] || fail "attach socket mode $mode"
grep -q " DEBUG " "$LOG" && fail "DEBUG lines at level info"

write_conf debug 4
kill -HUP "$PID"
wait_for 5 grep -q "reload done" "$LOG" || fail "no reload"
grep -q "reload: log.level: info -> debug (applied)" "$LOG" || fail "log level change not logged"
grep -q "reload: engine.num_ranks: 2 -> 4 (needs restart)" "$LOG" || fail "restart-only change not logged"
grep -q " DEBUG conf: log level is now debug" "$LOG" || fail "debug logging not active after reload"
kill -0 "$PID" || fail "daemon died on reload"

# A broken file on reload keeps the running configuration.
printf '[engine]\nnum_ranks = 99\n' > "$T/epd.conf"
kill -HUP "$PID"
wait_for 5 grep -q "reload failed, keeping the running configuration: .*engine.num_ranks: 99 is out of range" "$LOG" \
  || fail "bad reload not reported"
kill -0 "$PID" || fail "daemon died on a bad reload"

# --- SIGTERM drains and exits 0 within the drain timeout -----------------------------------------
start=$(date +%s%N)
kill -TERM "$PID"
wait_for 8 sh -c "! kill -0 $PID" || fail "still running 8 s after SIGTERM (drain timeout 3 s)"
wait "$PID"; rc=$?
PID=
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ $rc -eq 0 ] || fail "exit status $rc after SIGTERM"
grep -q "draining (Terminated)" "$LOG" || fail "no drain line"
[ -e "$T/run/attach.sock" ] && fail "attach socket left behind"
echo "ok: lifecycle (exit 0 ${ms} ms after SIGTERM)"
exit 0
