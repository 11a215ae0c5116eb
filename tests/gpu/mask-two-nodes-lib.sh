#!/bin/bash
# mask-two-nodes-lib.sh - helpers of the GPU tests with a masking group across the nodes of
# two-nodes-lib.sh (170 and 174: two nodes of 2 ranks; 175, 176: three of one), sourced after it and
# start_nodes. Workers run with --mask (each step checked against the reference computed with the mask
# its completion reports) on an expert map that places every expert on two ranks (E experts, the second
# replica REP_NEXT ranks on: replicated_map of mask-chaos-lib.sh; REP_NEXT = 2 with two nodes of 2: on
# the other node). GROUP and MODE name the group the workers attach to.
E=16 REP_NEXT=2
ctl() { "$EPDCTL" -s "$T/n0/control.sock" "$@"; }
run_worker() { # RANK STEPS OUT [ARGS...]: at its node (rank r at node r / GPN)
  local r=$1 steps=$2 out=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$(gpu_of "$r") "$WORKER" -s "$T/n$((r / GPN))/control.sock" -g "$GROUP" --mode "$MODE" \
    -r "$r" -n "$WR" --steps "$steps" --seed 9 --experts $E --hidden 128 --topk 4 --tokens 16 --same-inputs --mask \
    --until-streak 1000000 --node-ranks $GPN "$@" > "$out" 2>&1 &
}
# the steps a worker (-v) checked and found equal to the reference (0 before its output exists)
checked() { cat "$1" 2> /dev/null | grep -c " ok$"; }
stepping() { # stepping N OUT...: each worker of these outputs checked N more steps (within 60 s)
  local n=$1 f c=""
  shift
  for f in "$@"; do c="$c [ \$(cat $f 2> /dev/null | grep -c ' ok\$') -ge $(($(checked "$f") + n)) ] &&"; done
  wait_for 60 sh -c "$c true"
}
pair() { # pair NODE TAG: new -v workers of every rank of NODE, outputs $T/TAGr.out, pids in V_r
  local r
  for r in $(seq $(($1 * GPN)) $(($1 * GPN + GPN - 1))); do
    run_worker $r 1000000 "$T/$2$r.out" -v
    eval "V_$r=\$!"
  done
}
