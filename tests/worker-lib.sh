# worker-lib.sh - sourced by the test scripts and libraries that run epd-worker processes in the
# background (tests/system/30-e2e.sh, cluster-lib.sh; tests/gpu/daemon-lib.sh, two-nodes-lib.sh). They
# start worker NAME with its output in $T/NAME.out and its pid in W_NAME, and define fail().
# expect_ok NAME...: each worker exited 0 and printed its summary ("steps ok"); its summary lines (and
# bench, map-switch and HT counts) are printed, prefixed with its name.
expect_ok() {
  local n pid rc
  for n in "$@"; do
    eval "pid=\$W_$n"
    wait "$pid"; rc=$?
    [ $rc -eq 0 ] || fail "worker $n exited $rc"
    grep -q "steps ok" "$T/$n.out" || fail "worker $n printed no summary"
    grep -h "steps ok\|bench\|seen\|in between" "$T/$n.out" | sed "s/^/   $n: /"
  done
}
