#!/bin/sh
# make run: start the daemon (host backend unless a CUDA backend with GPUs is available), attach one
# worker per rank, run dispatch -> toy expert -> combine steps with random routing checked against the
# reference, show `epdctl status`, and shut everything down cleanly.
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

echo "== starting epd (backend=$BACKEND, $RANKS ranks), socket $sock"
"$B/bin/epd" -s "$sock" -o engine.backend="$BACKEND" -o engine.num_ranks="$RANKS" \
  -o daemon.attach_socket="$dir/attach.sock" 2>"$dir/epd.log" &
dpid=$!
i=0
until [ -S "$sock" ] && [ -S "$dir/attach.sock" ]; do
  i=$((i + 1))
  if [ $i -gt 100 ] || ! kill -0 "$dpid" 2>/dev/null; then
    echo "epd did not start:"; cat "$dir/epd.log"; exit 1
  fi
  sleep 0.1
done

echo "== $RANKS workers, $STEPS LL steps each (random routing, -1 entries), then HT and FP8"
start=$(date +%s%N)
pids=""
r=0
while [ $r -lt "$RANKS" ]; do
  "$B/bin/epd-worker" -s "$sock" -g demo -r $r -n "$RANKS" --steps "$STEPS" --seed 7 &
  pids="$pids $!"
  r=$((r + 1))
done
rc=0
for p in $pids; do wait "$p" || rc=1; done
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

echo "== epdctl status"
"$B/bin/epdctl" -s "$sock" status || rc=1

echo "== shutting down (SIGTERM: drain, then exit)"
kill -TERM "$dpid"
wait "$dpid" || rc=1
dpid=""
if [ $rc -ne 0 ]; then
  echo "demo FAILED; daemon log:"; cat "$dir/epd.log"; exit 1
fi
echo "demo OK"
