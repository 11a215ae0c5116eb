#!/bin/bash
# 34-two-nodes-tls: the rendezvous over mutual TLS (cluster.tls_ca / tls_cert / tls_key / tls_server_name).
# Certificates are made here with the openssl command line: a CA, a certificate per node signed by it (the
# coordinator's for 127.0.0.1 and localhost), and a second CA with a node certificate of its own.
# - two nodes with certificates of the same CA form the world, status says "rendezvous mutual-tls" (the
#   plaintext world of 32-two-nodes says "plaintext"), and LL steps across the nodes equal the reference;
# - refused, within cluster.timeout_ms, each daemon saying why: a plaintext node at a TLS coordinator, a
#   TLS node at a plaintext coordinator, a node whose certificate another CA signed, a node expecting
#   another server name; at start-up: tls_* not all set, a file that is not PEM, a missing file.
set -u
STEP_TIMEOUT_MS=3000 WORKER_TIMEOUT=40
. "$(dirname "$0")/cluster-lib.sh"
command -v openssl > /dev/null || { echo "skip: no openssl command"; exit 77; }
C=$T/pki
mkdir -p "$C"
# ca NAME: a self-signed CA; cert NAME CA SAN: a key and a certificate for NAME signed by CA.
ca() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj "/CN=$1" \
    -keyout "$C/$1.key" -out "$C/$1.pem" 2> "$C/$1.err" || fail "openssl: CA $1: $(cat "$C/$1.err")"
}
cert() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$1" -keyout "$C/$1.key" \
    -out "$C/$1.csr" 2> "$C/$1.err" || fail "openssl: key $1: $(cat "$C/$1.err")"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$C/$1.ext"
  openssl x509 -req -in "$C/$1.csr" -CA "$C/$2.pem" -CAkey "$C/$2.key" -CAcreateserial -days 2 \
    -extfile "$C/$1.ext" -out "$C/$1.pem" 2>> "$C/$1.err" || fail "openssl: cert $1: $(cat "$C/$1.err")"
  chmod 600 "$C/$1.key"
}
ca ca
ca otherca
cert node0 ca "IP:127.0.0.1,DNS:localhost"
cert node1 ca "DNS:node1.epd.test"
cert rogue otherca "DNS:rogue.epd.test"
tls() { echo "-o cluster.tls_ca=$C/$2.pem -o cluster.tls_cert=$C/$1.pem -o cluster.tls_key=$C/$1.key"; }

echo "== two nodes over mutual TLS"
PORT=$(free_ports 1)
node a 0 2 "$PORT" $(tls node0 ca)
node b 1 2 "$PORT" $(tls node1 ca)
wait_for 15 test -S "$T/a/attach.sock" || fail "node 0 did not come up"
wait_for 15 test -S "$T/b/attach.sock" || fail "node 1 did not come up"
grep -q "rendezvous over mutual TLS" "$T/a.log" || fail "node 0's log does not say the rendezvous used TLS"
"$EPDCTL" -s "$T/b/control.sock" status > "$T/status.out" || fail "epdctl status"
grep -q "cluster:  node 1 of 2, 4 world ranks, inter-node transport host-tcp, rendezvous mutual-tls" \
  "$T/status.out" || fail "status: $(cat "$T/status.out")"
"$EPDCTL" -s "$T/a/control.sock" --json status | grep -q '"rendezvous":"mutual-tls"' || fail "status --json: no rendezvous"
for r in 0 1; do worker t$r a -g t -r $r -n 4 --steps 6 --seed 3 --skew; done
for r in 2 3; do worker t$r b -g t -r $r -n 4 --steps 6 --seed 3 --skew; done
expect_ok t0 t1 t2 t3
kill -TERM "$P_a" "$P_b"; wait "$P_a"; RA=$?; wait "$P_b"; RB=$?
[ $RA -eq 0 ] && [ $RB -eq 0 ] || fail "the TLS nodes exited $RA $RB on SIGTERM"

echo "== refusals"
read -r P1 P2 P3 P4 < <(free_ports 4)
TO="-o cluster.timeout_ms=2000"
node plain0 0 2 "$P1" $TO $(tls node0 ca)     # TLS coordinator, plaintext node
node plain1 1 2 "$P1" $TO
node tlsc0 0 2 "$P2" $TO                       # plaintext coordinator, TLS node
node tlsc1 1 2 "$P2" $TO $(tls node1 ca)
node rogue0 0 2 "$P3" $TO $(tls node0 ca)     # a node whose certificate another CA signed (it trusts ours:
node rogue1 1 2 "$P3" $TO $(tls rogue ca)     # the coordinator must refuse its client certificate)
node name0 0 2 "$P4" $TO $(tls node0 ca)      # the coordinator's certificate is not for that name
node name1 1 2 "$P4" $TO $(tls node1 ca) -o cluster.tls_server_name=elsewhere.epd.test
echo "not a certificate" > "$C/junk.pem"
read -r P5 P6 P7 < <(free_ports 3)
node half 0 2 "$P5" -o cluster.tls_ca="$C/ca.pem" -o cluster.tls_key="$C/node0.key"
node junk 0 2 "$P6" -o cluster.tls_ca="$C/junk.pem" -o cluster.tls_cert="$C/node0.pem" -o cluster.tls_key="$C/node0.key"
node nofile 1 2 "$P7" -o cluster.tls_ca="$C/ca.pem" -o cluster.tls_cert="$C/none.pem" -o cluster.tls_key="$C/node1.key"
refused 10000 plain0 plain1 tlsc0 tlsc1 rogue0 rogue1 name0 name1 half junk nofile
for n in plain0 rogue0 name0; do
  expect_log $n "node(s) 1 did not join (coordinator listening on 127.0.0.1:[0-9]* over mutual TLS"
done
expect_log plain1 "not reachable: .*(plaintext; a coordinator with cluster.tls_\* set refuses it)"
expect_log tlsc0 "node(s) 1 did not join (coordinator listening on 127.0.0.1:$P2)"
for n in tlsc1 rogue1 name1; do expect_log $n "not reachable: .*(mutual TLS: is the coordinator on TLS"; done
expect_log half "cluster.tls_ca, cluster.tls_cert and cluster.tls_key: set all three or none (tls_cert empty)"
expect_log junk "cluster.tls_ca $C/junk.pem: not a PEM file"
expect_log nofile "cluster.tls_cert $C/none.pem: No such file or directory"
echo "== --check-config reads the TLS files"
"$EPD" --check-config -o cluster.nodes=2 $(tls node1 ca) > /dev/null || fail "--check-config refused a valid TLS set"
"$EPD" --check-config -o cluster.nodes=2 -o cluster.tls_ca="$C/junk.pem" -o cluster.tls_cert="$C/node1.pem" \
  -o cluster.tls_key="$C/node1.key" > /dev/null 2> "$T/check.err" && fail "--check-config accepted a junk CA file"
grep -q "cluster.tls_ca $C/junk.pem: not a PEM file" "$T/check.err" || fail "--check-config: $(cat "$T/check.err")"
echo "34-two-nodes-tls: all checks passed"
