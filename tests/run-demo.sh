#!/bin/sh
# make run: start the daemon (host backend unless a CUDA backend with GPUs is available), attach one
# worker per rank, run dispatch -> toy expert -> combine steps with random routing checked against the
# reference, show `epdctl status` while the workers are attached (they hold before the combine of their
# last LL step until it was shown), and shut everything down cleanly.
# With at least one GPU but fewer than the ranks, the ranks share the GPUs (engine.backend=cuda,
# engine.devices: rank r on GPU r mod count). Where the CUDA backend cannot start (the daemon exits at
# start-up saying why: an NCCL too old to share a GPU, ...), one line says why and the demo runs on the
# host backend; not when EPD_DEMO_BACKEND=cuda asks for it.
set -eu
B=${B:-build}
RANKS=${EPD_DEMO_RANKS:-2}
STEPS=${EPD_DEMO_STEPS:-20}
BACKEND=${EPD_DEMO_BACKEND:-auto}
dir=$(mktemp -d /tmp/epd-demo-XXXXXX)
sock=$dir/control.sock
cleanup() {
  [ -n "${dpid:-}" ] && kill "$dpid" 2>/dev/null && wait "$dpid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT INT TERM

# GPUs this process may use (its CUDA_VISIBLE_DEVICES if set, else nvidia-smi's); 0 without.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true)
else
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
devices=
if [ "$BACKEND" != host ] && [ "${ngpu:-0}" -ge 1 ] && [ "$ngpu" -lt "$RANKS" ]; then
  r=0
  while [ $r -lt "$RANKS" ]; do devices="$devices${devices:+,}$((r % ngpu))"; r=$((r + 1)); done
  [ "$BACKEND" = auto ] && BACKEND=cuda
fi

# start_epd BACKEND [-o k=v ...]: the daemon in the background (pid in dpid); 0 once its sockets are up,
# 1 if it exited at start-up (its log in $dir/epd.log).
start_epd() {
  be=$1
  shift
  rm -f "$sock" "$dir/attach.sock"
  echo "== starting epd (backend=$be, $RANKS ranks${devices:+ on GPUs $devices}), socket $sock"
  "$B/bin/epd" -s "$sock" -o engine.backend="$be" -o engine.num_ranks="$RANKS" \
    -o daemon.attach_socket="$dir/attach.sock" "$@" 2>"$dir/epd.log" &
  dpid=$!
  i=0
  until [ -S "$sock" ] && [ -S "$dir/attach.sock" ]; do
    i=$((i + 1))
    if ! kill -0 "$dpid" 2>/dev/null; then
      wait "$dpid" 2>/dev/null || true
      dpid=""
      return 1
    fi
    if [ $i -gt 100 ]; then
      echo "epd did not start:"; cat "$dir/epd.log"; exit 1
    fi
    sleep 0.1
  done
}

if [ -n "$devices" ]; then
  ok=0
  start_epd "$BACKEND" -o engine.devices="$devices" || ok=$?
else
  ok=0
  start_epd "$BACKEND" || ok=$?
fi
if [ $ok -ne 0 ]; then
  if [ "$BACKEND" = host ] || [ "${EPD_DEMO_BACKEND:-auto}" != auto ]; then
    echo "epd did not start:"; cat "$dir/epd.log"; exit 1
  fi
  why=$(sed -n 's/.*start-up failed: //p' "$dir/epd.log" | tail -1)
  echo "== the CUDA backend did not start (${why:-$(tail -1 "$dir/epd.log")}): running on the host backend"
  devices=
  start_epd host || { echo "epd did not start:"; cat "$dir/epd.log"; exit 1; }
fi

echo "== $RANKS workers, $STEPS LL steps each (random routing, -1 entries), then HT and FP8"
start=$(date +%s%N)
# The LL workers hold before the combine of their last step until $dir/go exists, so that `epdctl
# status` shows them attached, with their groups and op counts (after the run they would be gone).
hold=
[ "$STEPS" -ge 1 ] && hold="--hold-at $((STEPS - 1)) --hold-file $dir/go"
rc=0
pids=""
r=0
while [ $r -lt "$RANKS" ]; do
  # shellcheck disable=SC2086
  "$B/bin/epd-worker" -s "$sock" -g demo -r $r -n "$RANKS" --steps "$STEPS" --seed 7 $hold > "$dir/w$r.out" &
  pids="$pids $!"
  r=$((r + 1))
done
# all_holding: every LL worker says it holds (0), or one has ended (1: it failed before the hold).
all_holding() {
  r=0
  for p in $pids; do
    if ! grep -q "holding before the combine" "$dir/w$r.out" 2>/dev/null; then
      kill -0 "$p" 2>/dev/null && return 2
      return 1
    fi
    r=$((r + 1))
  done
  return 0
}
i=0
held=0
while [ -n "$hold" ] && [ $i -lt 600 ]; do
  st=0
  all_holding || st=$?
  [ $st -eq 0 ] && held=1
  [ $st -ne 2 ] && break
  i=$((i + 1))
  sleep 0.1
done
if [ $held -eq 1 ]; then
  echo "== epdctl status (the LL workers attached, holding before their last combine)"
  "$B/bin/epdctl" -s "$sock" status || rc=1
fi
touch "$dir/go"
for p in $pids; do wait "$p" || rc=1; done
cat "$dir"/w*.out
for extra in "--mode ht" "--fp8"; do
  pids=""
  r=0
  while [ $r -lt "$RANKS" ]; do
    # shellcheck disable=SC2086
    "$B/bin/epd-worker" -s "$sock" -g demo -r $r -n "$RANKS" --steps 5 --seed 11 $extra &
    pids="$pids $!"
    r=$((r + 1))
  done
  for p in $pids; do wait "$p" || rc=1; done
done
end=$(date +%s%N)
echo "== wall time for all steps: $(( (end - start) / 1000000 )) ms"

if [ $held -eq 0 ]; then
  echo "== epdctl status (after the run: the workers have detached)"
  "$B/bin/epdctl" -s "$sock" status || rc=1
fi

echo "== shutting down (SIGTERM: drain, then exit)"
kill -TERM "$dpid"
wait "$dpid" || rc=1
dpid=""
if [ $rc -ne 0 ]; then
  echo "demo FAILED; daemon log:"; cat "$dir/epd.log"; exit 1
fi
echo "demo OK"
