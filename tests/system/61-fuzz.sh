#!/bin/bash
# 61-fuzz: the libFuzzer targets of tests/fuzz (RPC request decoding + validation + handling for every
# method, the attach socket protocol, the configuration parser, the answer to refused control
# connections), built with clang + ASan by `make fuzz`,
# each run for a fixed time (EPD_FUZZ_SECONDS, default 15) over its seed corpus tests/fuzz/corpus/<t>,
# with a fixed random seed (EPD_FUZZ_SEED, default 20261122; 0 = a new one each run, for exploring by
# hand): a run then follows the same sequence of inputs, so CI tests a prefix of what was run before
# landing instead of new random inputs on every landing.
# New inputs go to a temp dir; a crash fails the test and leaves its input in the temp dir: add it to
# the corpus as a regression input with the fix. Skips (77) without clang or its libFuzzer runtime.
set -u
B=${EPD_BUILD:-build}
SECS=${EPD_FUZZ_SECONDS:-15}
SEED=${EPD_FUZZ_SEED:-20261122}
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
command -v clang > /dev/null || { echo "skip: clang is not installed (deploy/deps.sh installs it)"; exit 77; }
printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }\n' > "$T/probe.c"
clang -fsanitize=fuzzer,address "$T/probe.c" -o "$T/probe" > /dev/null 2>&1 ||
  { echo "skip: clang cannot link -fsanitize=fuzzer (libclang-rt-14-dev missing?)"; exit 77; }
make --no-print-directory -s B="$B" fuzz > "$T/build.log" 2>&1 || { tail -30 "$T/build.log"; echo "FAIL: make fuzz"; exit 1; }
rc=0
for t in rpc attach conf refuse; do
  bin=$B/fuzz/bin/fuzz_$t
  mkdir -p "$T/corpus-$t" "$T/crash-$t"
  # Seeds first (also the regression inputs of earlier crashes), then fuzz for the fixed time.
  timeout $((SECS + 60)) "$bin" -max_total_time="$SECS" -seed="$SEED" -timeout=10 -rss_limit_mb=3072 -print_final_stats=1 \
    -artifact_prefix="$T/crash-$t/" "$T/corpus-$t" "tests/fuzz/corpus/$t" > "$T/$t.log" 2>&1
  r=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$T/$t.log")
  cov=$(grep -o 'cov: [0-9]*' "$T/$t.log" | tail -1)
  if [ $r -ne 0 ] || ls "$T/crash-$t"/* > /dev/null 2>&1; then
    echo "FAIL: fuzz_$t exited $r"; grep -A25 "ERROR\|SUMMARY" "$T/$t.log" | head -40
    ls "$T/crash-$t"/ 2>/dev/null | sed 's/^/  crash input: /'
    rc=1
  else
    echo "ok   fuzz_$t: ${runs:-?} inputs in ${SECS} s (seed $SEED), $cov, seeds $(ls tests/fuzz/corpus/$t | wc -l)"
  fi
done
exit $rc
