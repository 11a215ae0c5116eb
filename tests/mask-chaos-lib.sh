# mask-chaos-lib.sh - sourced by the chaos tests of masked ranks (tests/system/67-mask-two-nodes.sh,
# tests/gpu/168-mask-chaos-cuda.sh): 4 workers of one group attached with on_rank_loss = mask, killed and
# restarted at random, every step checked by the workers against the reference with the mask their
# completions report. Before sourcing: T (the test's directory), fail, ctl (epdctl at the daemon that
# stages maps), E (experts), REP_NEXT (the rank offset of every expert's second replica), and
#   run_worker RANK STEPS OUT   start an epd-worker of RANK with --steps STEPS in the background (output
#                              to OUT) with the group's options: -g "$GROUP" --mode "$MODE" --mask ...
#   may_kill RANK              succeed when the worker of RANK may be killed now (WP, DOWN as below)
#   daemons_alive              fail the test when a daemon exited
#   group_gone                 (optional) succeed when no daemon has the group any more (default: the one
#                              ctl reaches)
# Defines warm_up, chaos_phases SECONDS, clean_round (after which steps, nfin and killed hold the counts).
R=4
declare -A WP=() WO=() DOWN=() # rank -> its worker's pid, its output; rank -> when its new worker starts
GROUP=chaos MODE=ll
seq_no=0 killed=0 retried=0 maps=0
FINISHED=$T/finished # rank rc outfile, one line per worker that exited on its own
: > "$FINISHED"
now_ms() { date +%s%3N; }
fds() { ls /proc/"$1"/fd | wc -l; }
start() { # start RANK [STEPS]: a new worker of the rank
  local r=$1
  seq_no=$((seq_no + 1))
  WO[$r]=$T/w$r.$seq_no.out
  run_worker "$r" "${2:-$CHAOS_STEPS}" "${WO[$r]}"
  WP[$r]=$!
}
reap() { # collect the workers that exited; one whose attach found its rank still held retries soon
  local r rc
  for r in "${!WP[@]}"; do
    kill -0 "${WP[$r]}" 2> /dev/null && continue
    wait "${WP[$r]}"
    rc=$?
    if [ $rc -eq 2 ] && grep -q "is already attached" "${WO[$r]}"; then
      retried=$((retried + 1))
      DOWN[$r]=$(($(now_ms) + 200))
    else
      echo "$r $rc ${WO[$r]}" >> "$FINISHED"
    fi
    unset "WP[$r]"
  done
}
restart_due() { # start the workers whose restart time came (STEPS: theirs)
  local r
  for r in "${!DOWN[@]}"; do
    if [ "$(now_ms)" -ge "${DOWN[$r]}" ]; then
      start "$r" "$@"
      unset "DOWN[$r]"
    fi
  done
}
group_made() { ctl experts "$GROUP" 2> /dev/null | grep -q '^expert'; }
declare -F group_gone > /dev/null || group_gone() { ! group_made; }
# every expert on its rank and on a second one: one rank down drops nothing (staged again when the group
# was made anew: every worker left at once)
replicated_map() {
  local head S per e
  head=$(ctl experts "$GROUP" 2> /dev/null | head -1)
  [ -n "$head" ] || return 0
  ctl experts "$GROUP" 2> /dev/null | grep -q '^expert [0-9]*: [0-9]*:[0-9]* [0-9]' && return 0 # replicated
  S=$(echo "$head" | sed -n 's/.*slots_per_rank \([0-9]*\).*/\1/p')
  per=$(((E + R - 1) / R))
  [ "$S" -ge $((2 * per)) ] || fail "slots_per_rank $S: no room for the replicas"
  {
    echo "$head"
    for e in $(seq 0 $((E - 1))); do
      echo "expert $e: $((e / per)):$((e % per)) $(((e / per + REP_NEXT) % R)):$((per + e % per))"
    done
  } > "$T/map.txt"
  ctl set-map "$T/map.txt" > /dev/null 2>&1 && maps=$((maps + 1))
  return 0
}
# warm_up: one clean round of the 4 workers
warm_up() {
  local r rc f
  for r in 0 1 2 3; do start $r; done
  while [ ${#WP[@]} -gt 0 ]; do
    reap
    sleep 0.05
  done
  while read -r r rc f; do [ "$rc" = 0 ] || fail "warm-up: rank $r's worker exited $rc: $(head -5 "$f")"; done < "$FINISHED"
  : > "$FINISHED"
  sleep 0.5
}
# chaos SECONDS: SIGKILL a random worker about every 0.5 s (may_kill), a new one of its rank 0.1-0.5 s
# later, for SECONDS; then kill the ones still running (a worker that outlives every other one may not be
# able to step)
chaos() {
  local stop next_kill next_map t r alive
  for r in 0 1 2 3; do start $r; done
  wait_for 20 group_made || fail "group $GROUP not made"
  replicated_map
  stop=$(($(now_ms) + $1 * 1000))
  next_kill=$(($(now_ms) + 700))
  next_map=$(($(now_ms) + 500))
  while [ "$(now_ms)" -lt $stop ]; do
    t=$(now_ms)
    if [ "$t" -ge $next_map ]; then
      replicated_map
      next_map=$((t + 500))
    fi
    reap
    for r in 0 1 2 3; do # a worker that ran all its steps: a new one of its rank
      [ -z "${WP[$r]:-}" ] && [ -z "${DOWN[$r]:-}" ] && start $r
    done
    restart_due
    if [ "$t" -ge $next_kill ] && [ ${#DOWN[@]} -lt 2 ]; then
      alive=()
      for r in "${!WP[@]}"; do kill -0 "${WP[$r]}" 2> /dev/null && may_kill "$r" && alive+=("$r"); done
      if [ ${#alive[@]} -gt 0 ]; then
        r=${alive[$((RANDOM % ${#alive[@]}))]}
        kill -KILL "${WP[$r]}" 2> /dev/null
        wait "${WP[$r]}" 2> /dev/null
        unset "WP[$r]"
        killed=$((killed + 1))
        DOWN[$r]=$((t + 100 + RANDOM % 400))
      fi
      next_kill=$((t + 300 + RANDOM % 400))
    fi
    daemons_alive
    sleep 0.02
  done
  reap
  for r in "${!WP[@]}"; do kill -KILL "${WP[$r]}" 2> /dev/null; done
  for r in "${!WP[@]}"; do wait "${WP[$r]}" 2> /dev/null; done
  WP=() DOWN=()
}
# chaos_phases SECONDS: LL steps for half the time, then HT steps in another group (workers that restart
# at any step agree on a step's kind only without a cadence)
chaos_phases() {
  local half=$((($1 + 1) / 2))
  echo "== LL steps, chaos for $half s: SIGKILL a random worker about every 0.5 s, a new one of its rank 0.1-0.5 s later"
  GROUP=chaos MODE=ll
  chaos $half
  echo "== HT steps, the same for $half s"
  GROUP=chaos-ht MODE=ht
  chaos $half
}
# clean_round: every step a worker checked, killed or not, matched the reference with its mask (printed as
# it runs); the workers that ran to their end exited 0 (steps: the steps they checked, nfin: how many);
# then 4 new workers of 100 steps must all run
clean_round() {
  local pat bad r rc f n end
  echo "== then one clean round of 4 workers"
  pat="differs from the reference\|, want \|dropped [0-9]* entries\|entries dropped"
  bad=$(grep -l "$pat" "$T"/w*.out | head -3)
  # shellcheck disable=SC2086 # bad: file names without spaces
  [ -z "$bad" ] || fail "steps differ from the reference: $(grep -h "$pat" $bad | head -8)"
  steps=0
  while read -r r rc f; do
    [ "$rc" = 0 ] || fail "rank $r's worker exited $rc: $(grep -v '^  ' "$f" | head -12)"
    n=$(sed -n 's/^rank [0-9]*: \([0-9]*\) steps ok.*/\1/p' "$f")
    steps=$((steps + ${n:-0}))
  done < "$FINISHED"
  nfin=$(wc -l < "$FINISHED")
  : > "$FINISHED"
  # A worker killed between its Attach call and its attachment leaves its rank held until the attach token
  # expires (5 s): the 4 new workers start once the group is gone everywhere, so that none comes alone
  # after the others ran their steps (its steps would wait for parts no node sends).
  wait_for 15 group_gone || fail "group $GROUP still there 15 s after the chaos"
  for r in 0 1 2 3; do start $r 100; done
  end=$(($(now_ms) + 60000))
  while { [ ${#WP[@]} -gt 0 ] || [ ${#DOWN[@]} -gt 0 ]; } && [ "$(now_ms)" -lt $end ]; do
    reap
    restart_due 100 # its rank still held by a killed worker's attach: again
    sleep 0.05
  done
  [ ${#WP[@]} -eq 0 ] && [ ${#DOWN[@]} -eq 0 ] || fail "the clean round after the chaos did not end within 60 s: a hang"
  [ "$(wc -l < "$FINISHED")" -eq 4 ] || fail "the clean round: $(wc -l < "$FINISHED") of 4 workers ran"
  while read -r r rc f; do
    [ "$rc" = 0 ] || fail "after the chaos: rank $r's worker exited $rc: $(grep -v '^  ' "$f" | head -12)"
  done < "$FINISHED"
}
