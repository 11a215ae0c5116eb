#!/bin/bash
# epdctl against a live daemon: status (table and --json), clients, metrics, config, experts, set-map,
# health, watch, drain; every output is checked against the state the test created.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${EPD_BUILD:-build}
case $BUILD in /*) ;; *) [ -d "$PWD/$BUILD" ] && BUILD=$PWD/$BUILD || BUILD=$ROOT/$BUILD ;; esac
for b in epd epdctl; do
  [ -x "$BUILD/bin/$b" ] || { echo "skip: $BUILD/bin/$b not built"; exit 77; }
done
PY=/usr/bin/python3
D=$(mktemp -d)
PID=
cleanup() {
  [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  echo "--- daemon log" >&2
  cat "$D/epd.log" >&2 || true
  exit 1
}

cat > "$D/epd.conf" <<CONF
[daemon]
token_ttl_ms = 60000
drain_timeout_ms = 2000
[engine]
backend = host
num_ranks = 3
max_experts = 64
max_hidden = 1024
max_tokens = 64
CONF
SOCK=$D/control.sock
"$BUILD/bin/epd" -f -c "$D/epd.conf" -s "$SOCK" > "$D/epd.log" 2>&1 &
PID=$!
for _ in $(seq 150); do [ -S "$SOCK" ] && break; kill -0 $PID 2>/dev/null || fail "epd exited"; sleep 0.1; done
[ -S "$SOCK" ] || fail "no control socket after 15 s"
ctl() { timeout 20 "$BUILD/bin/epdctl" -s "$SOCK" "$@"; }

# status before any client
out=$(ctl status) || fail "status: $out"
echo "$out" | grep -q '^backend:  host$' || fail "status backend: $out"
echo "$out" | grep -q '^mode:     host-threads$' || fail "status mode: $out"
echo "$out" | grep -q '^state:    ready$' || fail "status state: $out"
echo "$out" | grep -q '^ranks:    3$' || fail "status ranks: $out"
# the rank table: the GPU column says "-" where a rank has no GPU
[ "$(echo "$out" | grep -cE '^ +[0-2] +-1 .* -$')" = 3 ] || fail "status rank rows (GPU column): $out"
echo "$out" | grep -qE '^ +RANK +DEVICE .* GPU$' || fail "status rank header: $out"
echo "$out" | grep -q '^clients:  0$' || fail "status clients: $out"
[ "$(ctl health)" = SERVING ] || fail "health not SERVING"

# one client on rank 2 of group "grp"
read -r CID SECRET CPID < <(PYTHONPATH=$ROOT/tests/py EPD_BUILD=$BUILD $PY "$ROOT/tests/py/attach_once.py" "$SOCK" grp 2 ctl-client) \
  || fail "attach"
[ -n "$CID" ] || fail "attach printed no client id"

out=$(ctl clients) || fail "clients"
echo "$out" | awk -v id="$CID" -v pid="$CPID" -v uid="$(id -u)" '$1 == id && $2 == "ctl-client" && $3 == "grp" && $4 == 2 && $5 == pid && $6 == uid {ok=1} END {exit !ok}' \
  || fail "clients table lacks the client: $out"

ctl status --json > "$D/status.json" || fail "status --json"
$PY - "$D/status.json" "$CID" "$CPID" <<'PYEOF' || fail "status --json does not match the daemon state"
import json, sys
s = json.load(open(sys.argv[1]))
cid, pid = int(sys.argv[2]), int(sys.argv[3])  # the pid is SO_PEERCRED's, not AttachRequest.pid (4242)
assert s["backend"] == "host" and s["engine_mode"] == "host-threads" and s["state"] == "ready", s
assert s["num_ranks"] == 3 and [r["rank"] for r in s["ranks"]] == [0, 1, 2], s["ranks"]
assert [r["clients"] for r in s["ranks"]] == [0, 0, 1], s["ranks"]
assert s["ranks"][2]["buffer_bytes"] > 0, s["ranks"]
assert [(r["device"], r["device_uuid"]) for r in s["ranks"]] == [(-1, "")] * 3, s["ranks"]  # host: no GPU
assert [(c["client_id"], c["name"], c["group"], c["rank"], c["pid"]) for c in s["clients"]] == [(cid, "ctl-client", "grp", 2, pid)], s["clients"]
assert [(g["name"], g["num_experts"], g["hidden"], g["topk"], g["max_tokens"]) for g in s["groups"]] == [("grp", 8, 128, 2, 16)], s["groups"]
assert s["draining"] is False and s["protocol_version"] == 1
PYEOF
ctl --json clients | $PY -c 'import json,sys; c=json.load(sys.stdin); assert len(c)==1 and c[0]["name"]=="ctl-client", c' \
  || fail "clients --json"

# metrics: valid exposition format with the same numbers
ctl metrics > "$D/metrics.txt" || fail "metrics"
if command -v promtool > /dev/null; then
  promtool check metrics < "$D/metrics.txt" > "$D/promtool.out" 2>&1 || fail "promtool: $(cat "$D/promtool.out")"
fi
grep -qx 'epd_clients 1' "$D/metrics.txt" || fail "metrics epd_clients"
grep -qx 'epd_ranks 3' "$D/metrics.txt" || fail "metrics epd_ranks"
grep -q '^epd_info{backend="host",mode="host-threads"' "$D/metrics.txt" || fail "metrics epd_info"
[ "$(grep -c '^epd_expert_tokens_total{group="grp"' "$D/metrics.txt")" = 8 ] || fail "metrics expert tokens"

# config: the effective values, as text and JSON
out=$(ctl config) || fail "config"
echo "$out" | grep -qx 'engine.num_ranks = 3' || fail "config num_ranks: $out"
echo "$out" | grep -qx "daemon.control_socket = $SOCK" || fail "config control_socket: $out"
echo "$out" | grep -qx "daemon.attach_socket = $(dirname "$SOCK")/attach.sock" || fail "config attach_socket: $out"
ctl --json config | $PY -c 'import json,sys; c=json.load(sys.stdin); assert c["engine.backend"]=="host" and c["daemon.token_ttl_ms"]=="60000", c' \
  || fail "config --json"

# experts and set-map: the listing is accepted back as a map file
ctl experts grp > "$D/map.txt" || fail "experts"
head -1 "$D/map.txt" | grep -q '^group grp version 1 num_ranks 3 slots_per_rank 3$' || fail "experts header: $(head -1 "$D/map.txt")"
[ "$(grep -c '^expert ' "$D/map.txt")" = 8 ] || fail "experts lines: $(cat "$D/map.txt")"
grep -qx 'expert 7: 2:1' "$D/map.txt" || fail "expert 7 placement: $(cat "$D/map.txt")"
sed -e 's/^expert 0: 0:0$/expert 0: 2:2/' "$D/map.txt" > "$D/map2.txt"
out=$(ctl set-map "$D/map2.txt") || fail "set-map: $out"
[ "$out" = "staged expert map version 2 for group grp (8 experts)" ] || fail "set-map output: $out"
sed -e 's/^expert 1: 0:1$/expert 1: 0:1 0:1/' "$D/map.txt" > "$D/bad.txt"
if out=$(ctl set-map "$D/bad.txt" 2>&1); then fail "set-map accepted a duplicate replica"; fi
echo "$out" | grep -q 'INVALID_ARGUMENT' || fail "set-map error text: $out"
printf 'expert x: 1:1\n' > "$D/bad2.txt"
if out=$(ctl set-map "$D/bad2.txt" 2>&1); then fail "set-map accepted garbage"; fi
echo "$out" | grep -q "bad2.txt:1:" || fail "set-map parse error text: $out"
if out=$(ctl experts nosuch 2>&1); then fail "experts of an unknown group"; fi
echo "$out" | grep -q 'NOT_FOUND' || fail "experts unknown group text: $out"

# watch sees the drain; drain flips health
ctl watch --count 1 --timeout 15000 > "$D/watch.out" 2>&1 &
WPID=$!
sleep 1
out=$(ctl drain) || fail "drain"
echo "$out" | grep -q '^draining; 1 client still attached$' || fail "drain output: $out"
wait $WPID || fail "watch: $(cat "$D/watch.out")"
grep -q ' drain ' "$D/watch.out" || fail "watch did not print the drain event: $(cat "$D/watch.out")"
for _ in $(seq 50); do ctl health > /dev/null 2>&1 || break; sleep 0.1; done
if out=$(ctl health 2>&1); then fail "health still serving after drain: $out"; fi
echo "$out" | grep -q '^NOT_SERVING' || fail "health text: $out"
ctl status | grep -q '^state:    draining (draining)$' || fail "status after drain: $(ctl status)"

# errors: unknown command, missing socket
if ctl bogus > /dev/null 2>&1; then fail "unknown command accepted"; fi
if out=$(timeout 20 "$BUILD/bin/epdctl" -s "$D/none.sock" status 2>&1); then fail "status without daemon"; fi
echo "$out" | grep -q 'none.sock: No such file' || fail "missing socket text: $out"

kill -TERM $PID
for _ in $(seq 150); do kill -0 $PID 2>/dev/null || break; sleep 0.1; done
if kill -0 $PID 2>/dev/null; then fail "epd still running 15 s after SIGTERM"; fi
wait $PID || fail "epd exit status $?"
PID=
echo "ok: epdctl output matches the daemon state"
