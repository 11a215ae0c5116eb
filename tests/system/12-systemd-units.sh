#!/bin/bash
# 12-systemd-units: deploy/epd.service and deploy/epd-mps.service pass `systemd-analyze verify`
# (warnings exit 0, so the output is checked: only "not executable" for binaries this machine lacks and
# man-page lookups are tolerated), and keep the settings the design relies on.
set -u
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
U=deploy
fail() { echo "FAIL: $*"; exit 1; }
for f in epd.service epd-mps.service epd.tmpfiles epd.sysusers; do [ -f "$U/$f" ] || fail "missing $U/$f"; done

# Settings checked by reading the unit (these hold whether or not systemd-analyze exists).
need() { grep -qE "^$2\$" "$U/$1" || fail "$1 lacks '$2'"; }
need epd.service 'Type=notify'
need epd.service 'NotifyAccess=main'
need epd.service 'WatchdogSec=10'
need epd.service 'ExecStart=/usr/bin/epd -c /etc/epd/epd.conf'
need epd.service 'ExecReload=/bin/kill -HUP \$MAINPID'
need epd.service 'RuntimeDirectory=epd'
need epd.service 'RuntimeDirectoryMode=0750'
need epd.service 'Group=epd'
need epd.service 'DeviceAllow=char-nvidia\* rw'
need epd.service 'DeviceAllow=/dev/nvidiactl rw'
need epd.service 'Requires=epd-mps.service'
need epd.service 'After=epd-mps.service.*'
need epd.service 'MemoryDenyWriteExecute=no'
need epd.service 'RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK'
need epd-mps.service 'ExecStart=/usr/bin/nvidia-cuda-mps-control -d'
need epd-mps.service 'Environment=CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps'
grep -q '^PrivateDevices' "$U/epd.service" && fail "PrivateDevices= hides /dev/nvidia*"
grep -qE '^u +epd ' "$U/epd.sysusers" || fail "sysusers: no epd user"
grep -qE '^d +/run/epd +0750 +epd +epd' "$U/epd.tmpfiles" || fail "tmpfiles: no /run/epd"

command -v systemd-analyze >/dev/null || { echo "skip: no systemd-analyze (unit settings checked)"; exit 77; }

# Lines systemd-analyze prints on a machine without the binaries or man pages: not unit errors.
problems() {
  grep -E 'epd(-mps)?\.service' | grep -vE 'is not executable: No such file|Command .man .* failed|Failed to (run|start) man' || true
}
out=$(systemd-analyze verify "$U/epd.service" "$U/epd-mps.service" 2>&1)
echo "$out" | grep -q 'epd' || [ -z "$out" ] || fail "output does not name our units: $out"
bad=$(echo "$out" | problems)
[ -z "$bad" ] || fail "systemd-analyze verify: $bad"

# The check itself must catch a broken unit: a misspelt key has to show up as a problem.
mkdir -p "$T/units"
sed 's/^WatchdogSec=10/WatchdogSecs=10/' "$U/epd.service" > "$T/units/epd.service"
cp "$U/epd-mps.service" "$T/units/"
bad=$(systemd-analyze verify "$T/units/epd.service" "$T/units/epd-mps.service" 2>&1 | problems)
echo "$bad" | grep -q 'WatchdogSecs' || fail "a misspelt key was not reported: '$bad'"
echo "ok: units verified"
