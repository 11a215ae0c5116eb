#!/bin/bash
# 32-two-nodes: scale-out with the host backend standing in for GPUs. Two daemons on this host are told
# they are nodes 0 and 1 of one EP world (cluster.nodes=2, 2 ranks each: 4 world ranks), node 0 the
# coordinator on 127.0.0.1:<free port>; the data plane runs over their TCP link ("host-tcp").
# - epd-worker processes attach each world rank at its node's daemon and check every step against the
#   single-node reference of the same world size and map: LL and HT, BF16 and FP8, skewed routing, two
#   groups at once; status, epdctl and metrics show the cluster and the bytes that crossed the link;
# - an attach of another node's rank is refused naming the node; a step whose other node never
#   submits fails with EPD_ERR_TIMEOUT naming a rank of that node; a node that drains between a
#   dispatch and its combine (every worker held there) still runs the combine (equal to the reference),
#   then the other node's next dispatches fail with EPD_ERR_DRAINING at once (not after the step
#   timeout), and so does a group made after the drain; a killed node fails steps with
#   EPD_ERR_PEER promptly; a group with another geometry on each node fails with EPD_ERR_MISMATCH;
# - start-up refusals: a node that never joins (both sides name it, within cluster.timeout_ms),
#   disagreeing configurations (the key that differs is named), a duplicate node rank, backend cuda
#   (no GPU here: refused before the rendezvous; with GPUs node 1 never joins).
set -u
STEP_TIMEOUT_MS=3000 WORKER_TIMEOUT=40
. "$(dirname "$0")/cluster-lib.sh"
# world GROUP STEPS ARGS...: the 4 world ranks of GROUP, ranks 0-1 at node a, 2-3 at node b.
world() {
  local g=$1 s=$2; shift 2
  for r in 0 1; do worker "${g}$r" a -g "$g" -r $r -n 4 --steps "$s" --seed 11 "$@"; done
  for r in 2 3; do worker "${g}$r" b -g "$g" -r $r -n 4 --steps "$s" --seed 11 "$@"; done
}

two_nodes

echo "== status and metrics show the cluster"
"$EPDCTL" -s "$T/b/control.sock" status > "$T/status.out" || fail "epdctl status"
grep -q "cluster:  node 1 of 2, 4 world ranks, inter-node transport host-tcp, rendezvous plaintext$" "$T/status.out" || fail "status: $(cat "$T/status.out")"
grep -q "^gin:" "$T/status.out" && fail "the host backend shows a GIN line: $(cat "$T/status.out")"
grep -q "^links:    node 0 up$" "$T/status.out" || fail "status: no 'links: node 0 up': $(cat "$T/status.out")"
"$EPDCTL" -s "$T/a/control.sock" --json status > "$T/status.json" || fail "epdctl --json status"
/usr/bin/python3 - "$T/status.json" <<'EOF' || fail "status json"
import json, sys
s = json.load(open(sys.argv[1]))
want = {"nodes": 2, "node_rank": 0, "world_ranks": 4, "num_ranks": 2, "inter_node_transport": "host-tcp",
        "gin": "", "links": "node 1 up"}
bad = {k: (s.get(k), v) for k, v in want.items() if s.get(k) != v}
assert not bad, bad
EOF

echo "== LL BF16 and HT FP8, skewed routing, two groups at once, every step against the reference"
world ll 8 --skew
world ht 8 --skew --mode ht --fp8
expect_ok ll0 ll1 ll2 ll3 ht0 ht1 ht2 ht3
grep -h "steps ok" "$T"/ll0.out "$T"/ht2.out
echo "== LL FP8 and HT BF16, uniform routing, 12 tokens max"
world lf 6 --fp8 --tokens 12 --specials
world hb 6 --mode ht --tokens 12
expect_ok lf0 lf1 lf2 lf3 hb0 hb1 hb2 hb3
"$EPDCTL" -s "$T/a/control.sock" metrics > "$T/metrics.out" || fail "epdctl metrics"
grep -q '^epd_cluster_nodes 2$' "$T/metrics.out" || fail "metrics: no epd_cluster_nodes 2"
grep -q '^epd_cluster_world_ranks 4$' "$T/metrics.out" || fail "metrics: no epd_cluster_world_ranks 4"
grep -q '^epd_cluster_info{transport="host-tcp"} 1$' "$T/metrics.out" || fail "metrics: no transport"
grep -q '^epd_cluster_link_up{node="1"} 1$' "$T/metrics.out" || fail "metrics: node 1's link not up: $(grep link_up "$T/metrics.out")"
TX=$(sed -n 's/^epd_cluster_bytes_total{direction="tx"} //p' "$T/metrics.out")
FR=$(sed -n 's/^epd_cluster_frames_total{direction="rx"} //p' "$T/metrics.out")
[ "${TX:-0}" -gt 100000 ] || fail "metrics: only ${TX:-0} bytes sent to node 1"
# 4 groups x (dispatch + combine) x steps: one frame per step from the other node; and per group node
# 1's notice of its creation, its reply to node 0's, and its removal notice (which may still be on its way).
STEPF=$(( (8 + 8 + 6 + 6) * 2 ))
[ "${FR:-0}" -ge $((STEPF + 8)) ] && [ "${FR:-0}" -le $((STEPF + 12)) ] ||
  fail "metrics: $FR frames from node 1, want $STEPF step frames and 8-12 group notices"
echo "   node 0 sent $TX bytes, received $FR frames"

echo "== a rank of the other node is refused, naming the node"
worker wrong a -g ll -r 2 -n 4 --steps 1
wait "$W_wrong"; [ $? -eq 2 ] || fail "attach of rank 2 at node 0 did not fail"
grep -q "node 0 of 2 and owns world ranks 0..1" "$T/wrong.out" || fail "refusal does not name the node: $(cat "$T/wrong.out")"

echo "== the same group with another hidden size on each node: EPD_ERR_MISMATCH on every rank"
for r in 0 1; do worker geo$r a -g geo -r $r -n 4 --steps 1 --hidden 128; done
for r in 2 3; do worker geo$r b -g geo -r $r -n 4 --steps 1 --hidden 256; done
for r in 0 1 2 3; do
  eval "pid=\$W_geo$r"; wait "$pid"; rc=$?
  [ $rc -eq 2 ] || fail "geometry mismatch: worker $r exited $rc"
  grep -q "EPD_ERR_MISMATCH" "$T/geo$r.out" || fail "geometry mismatch: worker $r: $(cat "$T/geo$r.out")"
done
grep -q "group geo has num_experts 16, hidden 256, topk 4, max_tokens 64 on node 1 but 16, 128, 4, 64 on node 0" "$T/a.log" ||
  fail "the log does not explain the geometry mismatch"

# node0_step GROUP CASE: ranks 0 and 1 of GROUP at node 0 run one step, which must fail (both exit 2);
# MS gets how long they took.
node0_step() {
  worker "${1}0" a -g "$1" -r 0 -n 4 --steps 1
  worker "${1}1" a -g "$1" -r 1 -n 4 --steps 1
  local S=$(date +%s%N) R0 R1 w0 w1
  eval "w0=\$W_${1}0 w1=\$W_${1}1"
  wait "$w0"; R0=$?
  wait "$w1"; R1=$?
  MS=$(( ($(date +%s%N) - S) / 1000000 ))
  [ $R0 -eq 2 ] && [ $R1 -eq 2 ] || fail "$2: workers exited $R0 $R1"
}

echo "== node 1's workers die and restart: the group made again there takes node 0's step and map, node 0's workers go on"
# node 0's workers skip the ops that fail meanwhile (--until-streak) and stop after 20 steps in a row with
# the restarted workers; every step's inputs are step 0's (--same-inputs), so workers that started at
# different steps check the same reference
for r in 0 1; do worker "rj$r" a -g rj -r $r -n 4 --steps 3000 --seed 12 --same-inputs --until-streak 20; done
for r in 2 3; do worker "rj$r" b -g rj -r $r -n 4 --steps 3000 --seed 12 --same-inputs -v; done
wait_for 20 grep -q "^rank 2 step 10:" "$T/rj2.out" || fail "rejoin: rank 2 did not reach step 10: $(tail -2 "$T/rj2.out")"
pkill -KILL -P "$W_rj2"; pkill -KILL -P "$W_rj3"
wait_for 10 grep -q "group rj: removed on node 1" "$T/a.log" || fail "rejoin: node 0 did not hear of the removal"
wait_for 10 grep -q "rank 0 step [0-9]*: dispatch failed (skipped).*EPD_ERR_PEER" "$T/rj0.out" || fail "rejoin: node 0's worker did not fail meanwhile: $(tail -2 "$T/rj0.out")"
for r in 2 3; do worker "rjb$r" b -g rj -r $r -n 4 --steps 20 --seed 12 --same-inputs; done
expect_ok rjb2 rjb3 rj0 rj1
grep -q "group rj: made again here while the other nodes step it: it runs from their step [1-9]" "$T/b.log" ||
  fail "rejoin: node 1's log: $(grep 'group rj' "$T/b.log" | tail -3)"
echo "   $(grep -o 'group rj: made again here.*' "$T/b.log" | head -1); node 0's worker: $(grep -c 'failed (skipped)' "$T/rj0.out") ops skipped meanwhile"

echo "== node 1 never submits: EPD_ERR_TIMEOUT naming a rank of node 1"
node0_step to "timeout case"
grep -q "EPD_ERR_TIMEOUT.*peer rank 2" "$T/to0.out" || fail "timeout does not name rank 2: $(cat "$T/to0.out")"
[ $MS -lt 8000 ] || fail "timeout took $MS ms (step_timeout_ms 3000)"
grep -q "node 1 (ranks 2..3) did not send" "$T/a.log" || fail "the log does not say node 1 was silent"

echo "== node 1 drains between a dispatch and its combine: the combine runs, the next dispatch fails with EPD_ERR_DRAINING"
# every rank holds after the dispatch of step 5 (every rank attached on both nodes and stepping)
for r in 0 1; do worker dr$r a -g dr -r $r -n 4 --steps 100000 --hold-at 5 --hold-file "$T/dr.go"; done
for r in 2 3; do worker dr$r b -g dr -r $r -n 4 --steps 100000 --hold-at 5 --hold-file "$T/dr.go"; done
wait_for 20 all_holding 5 dr0 dr1 dr2 dr3 || fail "group dr did not reach the hold on every rank: $(tail -qn1 "$T"/dr[0-3].out)"
"$EPDCTL" -s "$T/b/control.sock" drain > "$T/drain.out" 2>&1 || fail "epdctl drain: $(cat "$T/drain.out")"
wait_for 5 grep -q "group dr: node 1 is draining" "$T/a.log" || fail "node 0's log does not say node 1 drains"
# node 0's status says so, per group (text and JSON) and on the link
wait_for 5 grep -q "node 1 is draining: the dispatches of groups it does not have" "$T/a.log" || fail "node 0's log lacks node 1's last drain notice"
"$EPDCTL" -s "$T/a/control.sock" status > "$T/drstatus.out" || fail "epdctl status during the drain"
grep -q "^links:    node 1 up, draining$" "$T/drstatus.out" || fail "status links during the drain: $(cat "$T/drstatus.out")"
grep -Eq "across nodes: node 1 drains from step [0-9]+$" "$T/drstatus.out" || fail "status of group dr during the drain: $(cat "$T/drstatus.out")"
"$EPDCTL" -s "$T/a/control.sock" --json status > "$T/drstatus.json" || fail "epdctl --json status during the drain"
/usr/bin/python3 -c 'import json, sys; g = [x for x in json.load(open(sys.argv[1]))["groups"] if x["name"] == "dr"]; assert g and g[0]["nodes"].startswith("node 1 drains from step "), g' \
  "$T/drstatus.json" || fail "JSON status of group dr during the drain: $(cat "$T/drstatus.json")"
touch "$T/dr.go"
S=$(date +%s%N)
expect_drained 5 dr0 dr1 dr2 dr3
MS=$(( ($(date +%s%N) - S) / 1000000 ))
grep -q "EPD_ERR_DRAINING.*peer rank 2" "$T/dr0.out" || fail "drain: node 0's error does not name rank 2: $(tail -2 "$T/dr0.out")"
[ $MS -lt 2500 ] || fail "drain: node 0's workers failed only after $MS ms (step_timeout_ms 3000)"
echo "   the combines of step 5 ran after the drain; node 0's workers failed $MS ms after the release: $(grep -o 'EPD_ERR_DRAINING.*' "$T/dr0.out" | head -1 | cut -c1-150)"
# a group made on node 0 after the drain: node 1 will never take its steps either
node0_step nd "new group after the drain"
grep -q "EPD_ERR_DRAINING.*peer rank 2" "$T/nd0.out" || fail "new group after the drain: $(tail -1 "$T/nd0.out")"
[ $MS -lt 2500 ] || fail "new group after the drain: failed only after $MS ms"

echo "== node 1 killed: EPD_ERR_PEER naming a rank of node 1, promptly"
kill -KILL "$P_b"; wait "$P_b" 2>/dev/null
wait_for 5 grep -q "data link to node 1 lost" "$T/a.log" || fail "node 0 did not notice the lost link"
node0_step pe "lost node"
grep -q "EPD_ERR_PEER.*peer rank 2" "$T/pe0.out" || fail "lost node: no EPD_ERR_PEER naming rank 2: $(cat "$T/pe0.out")"
[ $MS -lt 2500 ] || fail "lost node: the step failed only after $MS ms"
"$EPDCTL" -s "$T/a/control.sock" status > "$T/lost-status.out" || fail "node 0 stopped serving after losing node 1"
grep -q "^links:    node 1 down: " "$T/lost-status.out" || fail "status after losing node 1: $(cat "$T/lost-status.out")"
"$EPDCTL" -s "$T/a/control.sock" metrics > "$T/lost-metrics.out" || fail "metrics after losing node 1"
grep -q '^epd_cluster_link_up{node="1"} 0$' "$T/lost-metrics.out" || fail "metrics after losing node 1: $(grep link_up "$T/lost-metrics.out")"
echo "   node 0's status: $(grep '^links:' "$T/lost-status.out")"
kill -TERM "$P_a"; wait "$P_a"; RA=$?
[ $RA -eq 0 ] || fail "node 0 exited $RA on SIGTERM"

echo "== start-up refusals"
# Each case in parallel; every daemon must exit 1 within its cluster.timeout_ms plus a margin.
read -r P1 P2 P3 P4 P5 < <(free_ports 5)
node lone0 0 2 "$P1" -o cluster.timeout_ms=1500          # node 1 never comes
node lone1 1 2 "$P2" -o cluster.timeout_ms=1500          # no coordinator
node cfg0 0 2 "$P3"                                        # max_tokens and gin_probe differ
node cfg1 1 2 "$P3" -o engine.max_tokens=128 -o cluster.gin_probe=0
node dup0 0 3 "$P4" -o cluster.timeout_ms=2500            # two daemons claim node 1
node dup1 1 3 "$P4" -o cluster.timeout_ms=2500
wait_for 3 grep -q "node 1 joined" "$T/dup0.log" || fail "dup1 did not join"
node dup1b 1 3 "$P4" -o cluster.timeout_ms=2500
node cuda 0 2 "$P5" -o engine.backend=cuda -o cluster.timeout_ms=1500
refused 7000 lone0 lone1 cfg0 cfg1 dup0 dup1 dup1b cuda
expect_log lone0 "start-up failed: cluster (node 0 of 2): rendezvous incomplete after cluster.timeout_ms 1500: node(s) 1 did not join"
expect_log lone1 "rendezvous incomplete after cluster.timeout_ms 1500: coordinator (node 0) at 127.0.0.1:$P2 not reachable"
expect_log cfg0 "node 1's configuration disagrees with the coordinator's: engine.max_tokens (node 0: 256, node 1: 128)"
expect_log cfg1 "refused: .*node 1's configuration disagrees with the coordinator's: engine.max_tokens (node 0: 256, node 1: 128)"
expect_log cfg0 "; cluster.gin_probe (node 0: 1, node 1: 0)"
expect_log cfg1 "must be equal on every node"
expect_log dup0 "node(s) 2 did not join"
expect_log dup1b "refused: .*duplicate node_rank 1: already joined with data address"
# backend cuda: without GPUs node 0 fails before the rendezvous; with GPUs node 1 never joins.
expect_log cuda "no usable CUDA device\|node(s) 1 did not join"
echo "32-two-nodes: all checks passed"
