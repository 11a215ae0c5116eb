#!/bin/bash
# 166-two-nodes-2gpus-cuda.sh - two nodes of TWO GPUs each simulated on one host (4 GPUs, or fewer shared): two daemons
# with engine.backend=cuda and engine.num_ranks=2 (CUDA_VISIBLE_DEVICES 0,1 / 2,3), told they are different
# hosts (NCCL_HOSTID node0 / node1, NCCL_SHM_DISABLE=1, NCCL_IB_DISABLE=1, sockets on lo), so the
# inter-node stage runs over NCCL's network transport while each node's two GPUs share their LSA team
# over NVLink. This is the path 165 cannot reach with one GPU per node: a token is packed once per
# destination node, sent by the rail GPU (same local index) and expanded by both GPUs of the other node,
# reading a sibling's received rows over NVLink; combine reduces per node in float32 before the way back.
# Four epd-worker processes (world ranks 0..3, rank r on GPU r at node r / 2) check every step against
# the reference: LL BF16 skewed and FP8 (H 7168, 256 experts, top-8, 128 tokens), HT FP8 skewed and BF16
# (256 tokens), small LL steps with a new expert map every 3 steps staged through node 0's daemon (both
# nodes must log the same switches), the same with expert weights that move with the maps (copies between
# the GPUs of a node and between nodes); status shows 4 world ranks and transport nccl-p2p; both daemons stop
# cleanly. With fewer than 4 GPUs the ranks share them (two-nodes-lib.sh: rank r on GPU r mod count; on
# one GPU each node's daemon gets it and engine.devices=0,0, its two ranks in NCCL's multi-rank mode):
# no NVLink then, the copies "between the GPUs of a node" are copies within one; the checks the same.
# Usage (repository root, GPU machine): bash tests/gpu/166-two-nodes-2gpus-cuda.sh [build-dir]; logs go to
# $TWO_NODES_OUT if set. Set-up, daemons and workers: two-nodes-lib.sh.
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=2
# twice the slots an expert needs: the free slots the weight migrations (--weights --map-every) move experts into
TWO_NODES_DAEMON_OPTS="-o engine.slots_factor_pct=200"
. "$(dirname "$0")/two-nodes-lib.sh"

start_nodes

COMMON="--experts 256 --hidden 7168 --topk 8"
echo "== LL BF16, skewed routing, 128 tokens, 20 steps"
start_workers llb --steps 20 --seed 5 --skew $COMMON --tokens 128 --bench 100
expect_ok llb0 llb1 llb2 llb3
echo "== LL FP8, uniform routing, 128 tokens, 20 steps"
start_workers llf --steps 20 --seed 7 --fp8 $COMMON --tokens 128 --bench 100
expect_ok llf0 llf1 llf2 llf3
echo "== HT FP8 skewed and HT BF16 (256 tokens, 8 steps)"
start_workers htf --steps 8 --seed 4 --mode ht --fp8 --skew $COMMON --tokens 256 --bench 20
expect_ok htf0 htf1 htf2 htf3
start_workers htb --steps 8 --seed 8 --mode ht $COMMON --tokens 256 --bench 20
expect_ok htb0 htb1 htb2 htb3
echo "== LL small (hidden 256), a new expert map every 3 steps through node 0's daemon, 60 steps"
start_workers lm --steps 60 --seed 11 --skew --hidden 256 --map-every 3
expect_ok lm0 lm1 lm2 lm3
for n in 0 1; do grep -o "group lm switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/node$n.log" > "$T/sw$n.txt"; done
[ "$(wc -l < "$T/sw0.txt")" -ge 15 ] || fail "lm: node 0 logged $(wc -l < "$T/sw0.txt") switches"
cmp -s "$T/sw0.txt" "$T/sw1.txt" || fail "lm: the nodes switched at different steps: $(diff "$T/sw0.txt" "$T/sw1.txt" | head -4)"
echo "   lm: $(wc -l < "$T/sw0.txt") switches, the same (version, step) on both nodes"
echo "== expert weights move with the maps: copies between GPUs of one node (NVLink) and of two (the daemons' link)"
start_workers wm --steps 60 --seed 14 --hidden 256 --weights 4096 --map-every 3
expect_ok wm0 wm1 wm2 wm3
weights_moved wm 5

kill -TERM "$P_0" "$P_1"
wait "$P_1"; R1=$?
wait "$P_0"; R0=$?
[ $R0 -eq 0 ] && [ $R1 -eq 0 ] || fail "daemons exited $R0 $R1 on SIGTERM"
# NCCL's INFO lines reach the (block-buffered) log file at exit: the rail peers cross by NET/Socket
grep -h " via NET/Socket" "$T/node0.log" "$T/node1.log" > "$T/net.txt" || fail "NCCL did not use its socket transport between the nodes"
head -2 "$T/net.txt" | sed 's/^.*NCCL INFO/   NCCL INFO/'
echo "ok: two nodes of two GPUs, LL and HT equal to the reference, maps switched together"
