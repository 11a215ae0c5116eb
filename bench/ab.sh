#!/bin/bash
# bench/ab.sh A B [ROUNDS] - a regression guard for the LL kernels: the quick LL benchmark (epd-bench with
# EPD_BENCH_QUICK=1: dispatch and combine kernel p50, FP8 and BF16, at 128 tokens x 7168, top-8, 256 experts)
# of two builds, run alternately ROUNDS times (default 6) in one run on the same GPU(s), so that both
# see the same clocks and neighbours. A and B are build or bundle directories (their bin/epd-bench). Prints
# every round, then per figure: A's and B's median, the median of the paired differences B - A and their
# spread (min..max), in µs and %. On a GPU per rank or with ranks sharing a GPU (then the figures guard
# against regressions only: they are not NVLink figures). Exit 0 unless a run fails.
set -u
A=${1:?usage: bench/ab.sh A B [ROUNDS]}
B=${2:?usage: bench/ab.sh A B [ROUNDS]}
N=${3:-6}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
for i in $(seq 1 "$N"); do
  for s in a b; do
    d=$A; [ $s = b ] && d=$B
    out=$(EPD_BENCH_QUICK=1 timeout 120 "$d/bin/epd-bench" "$T" 2>&1) || { echo "FAIL: $d/bin/epd-bench: $out"; exit 1; }
    line=$(echo "$out" | grep '^quick (a) p50 us:') || { echo "FAIL: no quick line from $d: $out"; exit 1; }
    echo "round $i $s: ${line#quick (a) p50 us: }"
    echo "$line" >> "$T/$s"
    [ "$i" = 1 ] && [ $s = a ] && echo "$out" | grep -m1 'share' | sed 's/^/   /'
  done
done
python3 - "$T/a" "$T/b" "$A" "$B" <<'PY'
import re, statistics, sys
def rows(p):
    return [[float(x) for x in re.findall(r'(\d+\.\d+)', l)] for l in open(p)]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
names = ["dispatch FP8", "combine (after FP8)", "dispatch BF16", "combine (after BF16)"]
print(f"A = {sys.argv[3]}, B = {sys.argv[4]}, {len(a)} rounds alternated")
print(f"| figure | A p50 µs | B p50 µs | B - A median µs | spread µs | B - A % |")
print("| --- | --- | --- | --- | --- | --- |")
for k, n in enumerate(names):
    av, bv = [r[k] for r in a], [r[k] for r in b]
    d = [y - x for x, y in zip(av, bv)]
    ma = statistics.median(av)
    print(f"| {n} | {ma:.2f} | {statistics.median(bv):.2f} | {statistics.median(d):+.2f} | "
          f"{min(d):+.2f}..{max(d):+.2f} | {100 * statistics.median(d) / ma:+.1f} |")
PY
