#!/usr/bin/python3
"""50-prometheus-http: the optional Prometheus endpoint. A host-backend daemon with
metrics.prometheus_listen on 127.0.0.1:<free port> runs two epd-worker processes; the scrape is parsed by
prometheus_client's parser and its values are checked against `epdctl status --json` and against
GetMetrics (`epdctl metrics`: the same builder, so the same families and counters). Other paths are 404,
other methods 405; a port in use or a malformed address makes start-up fail with exit 1."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    print("skip: prometheus_client is not installed for", sys.executable)
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B = os.environ.get("EPD_BUILD", "build")
if not os.path.isabs(B):
    B = os.path.join(os.getcwd(), B) if os.path.isdir(os.path.join(os.getcwd(), B)) else os.path.join(ROOT, B)
EPD, EPDCTL, WORKER = (os.path.join(B, "bin", n) for n in ("epd", "epdctl", "epd-worker"))
for p in (EPD, EPDCTL, WORKER):
    if not os.access(p, os.X_OK):
        print("skip: %s is not built" % p)
        sys.exit(77)

T = tempfile.mkdtemp(prefix="epd-http-")
SOCK = os.path.join(T, "control.sock")
procs = []


def fail(msg):
    print("FAIL:", msg)
    for p in procs:
        if p.poll() is None:
            p.kill()
    log = os.path.join(T, "epd.log")
    if os.path.exists(log):
        print("--- daemon log\n" + open(log).read()[-4000:])
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    fail("timed out after %ss waiting for %s" % (timeout, what))


def epdctl(*args):
    r = subprocess.run([EPDCTL, "-s", SOCK] + list(args), capture_output=True, text=True, timeout=20)
    check(r.returncode == 0, "epdctl %s: rc %d: %s" % (" ".join(args), r.returncode, r.stderr))
    return r.stdout


def scrape(port, path="/metrics", method="GET"):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def samples(text):
    """{(name, frozenset(labels)): value} and the set of family names, by the real parser."""
    out, fams = {}, {}
    for fam in text_string_to_metric_families(text):
        fams[fam.name] = fam.type
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out, fams


def start_fails(listen, want):
    r = subprocess.run([EPD, "-f", "-s", os.path.join(T, "bad.sock"), "-o", "engine.backend=host",
                        "-o", "engine.num_ranks=1", "-o", "daemon.attach_socket=" + os.path.join(T, "bad-a.sock"),
                        "-o", "metrics.prometheus_listen=" + listen], capture_output=True, text=True, timeout=20)
    check(r.returncode == 1, "epd with prometheus_listen=%s exited %d, want 1" % (listen, r.returncode))
    check(want in r.stderr, "epd with prometheus_listen=%s: no '%s' in: %s" % (listen, want, r.stderr[-600:]))


try:
    port = free_port()
    log = open(os.path.join(T, "epd.log"), "w")
    d = subprocess.Popen([EPD, "-f", "-s", SOCK, "-o", "engine.backend=host", "-o", "engine.num_ranks=2",
                          "-o", "daemon.attach_socket=" + os.path.join(T, "attach.sock"),
                          "-o", "daemon.drain_timeout_ms=2000",
                          "-o", "metrics.prometheus_listen=127.0.0.1:%d" % port], stderr=log, stdout=log)
    procs.append(d)
    wait_for(lambda: os.path.exists(SOCK) or d.poll() is not None, 15, "the control socket")
    check(d.poll() is None, "epd exited %s at start-up" % d.returncode)

    # Traffic first, so that counters and histograms are non-zero and worth comparing.
    env = dict(os.environ, ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") + ":detect_leaks=0")
    ws = [subprocess.Popen(["timeout", "60", WORKER, "-s", SOCK, "-g", "prom", "-r", str(r), "-n", "2",
                            "--steps", "7", "--seed", "11"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env) for r in range(2)]
    procs.extend(ws)
    for w in ws:
        out, _ = w.communicate(timeout=90)
        check(w.returncode == 0, "worker exited %d: %s" % (w.returncode, out[-800:]))
    wait_for(lambda: json.loads(epdctl("status", "--json"))["clients"] == [], 10, "the workers to detach")

    code, ctype, text = scrape(port)
    check(code == 200, "GET /metrics: HTTP %d" % code)
    check(ctype.startswith("text/plain") and "version=0.0.4" in ctype, "Content-Type %r" % ctype)
    got, fams = samples(text)
    st = json.loads(epdctl("status", "--json"))

    check(got.get(("epd_ranks", frozenset())) == st["num_ranks"] == 2, "epd_ranks vs status num_ranks")
    check(got.get(("epd_clients", frozenset())) == len(st["clients"]) == 0, "epd_clients vs status clients")
    check(got.get(("epd_state", frozenset({("state", st["state"])}))) == 1, "epd_state{state=%s} != 1" % st["state"])
    check(got.get(("epd_info", frozenset({("backend", st["backend"]), ("mode", st["engine_mode"]),
                                          ("version", st["version"])}))) == 1, "epd_info labels vs status")
    for r in st["ranks"]:
        rk = frozenset({("rank", str(r["rank"]))})
        check(r["ops"] > 0, "status: rank %d ran no ops after the workers" % r["rank"])
        check(got.get(("epd_rank_ops_total", rk)) == r["ops"],
              "epd_rank_ops_total{rank=%d} %s != status ops %d" % (r["rank"], got.get(("epd_rank_ops_total", rk)),
                                                                  r["ops"]))
        check(got.get(("epd_rank_buffer_bytes", frozenset({("rank", str(r["rank"])), ("device", str(r["device"]))})))
              == r["buffer_bytes"], "epd_rank_buffer_bytes rank %d vs status" % r["rank"])
    # A group goes when its last client leaves: none is left, and both sides say so.
    check(got.get(("epd_groups", frozenset())) == len(st["groups"]) == 0, "epd_groups vs status groups")
    ll = [v for (n, lb), v in got.items() if n == "epd_ops_total" and ("mode", "ll") in lb]
    check(sum(ll) == sum(r["ops"] for r in st["ranks"]), "sum of epd_ops_total{mode=ll} %s != status ops %s" %
          (sum(ll), [r["ops"] for r in st["ranks"]]))
    check(fams.get("epd_op_latency_seconds") == "histogram", "epd_op_latency_seconds is not a histogram")
    counts = [v for (n, _), v in got.items() if n == "epd_op_latency_seconds_count"]
    check(counts and sum(counts) > 0, "the latency histograms are empty after traffic")

    # The same builder as GetMetrics: same families, same counters (the daemon is idle now).
    rpc, rfams = samples(epdctl("metrics"))
    check(set(rfams) == set(fams), "families differ: http-only %s rpc-only %s" %
          (sorted(set(fams) - set(rfams)), sorted(set(rfams) - set(fams))))
    for key, v in got.items():
        if key[0].startswith(("epd_ops_total", "epd_rank_ops_total", "epd_op_latency_seconds_count",
                              "epd_expert_tokens_total")):
            check(rpc.get(key) == v, "%s: http %s, GetMetrics %s" % (key, v, rpc.get(key)))

    for path in ("/", "/metricsx", "/metrics/", "/healthz"):
        code, _, _ = scrape(port, path)
        check(code == 404, "GET %s: HTTP %d, want 404" % (path, code))
    code, _, _ = scrape(port, "/metrics", "POST")
    check(code == 405, "POST /metrics: HTTP %d, want 405" % code)
    code, _, body = scrape(port, "/metrics", "HEAD")
    check(code == 200 and body == "", "HEAD /metrics: HTTP %d, body %d bytes" % (code, len(body)))
    print("scrape: %d families, %d samples, rank ops %s" % (len(fams), len(got), [r["ops"] for r in st["ranks"]]))

    # Start-up errors: the port now in use (by the daemon above), and a malformed address.
    start_fails("127.0.0.1:%d" % port, "prometheus endpoint")
    start_fails("localhost:80", "numeric")
    start_fails("127.0.0.1:0", "port must be")

    d.terminate()
    try:
        rc = d.wait(timeout=15)
    except subprocess.TimeoutExpired:
        fail("epd did not exit within 15 s of SIGTERM")
    check(rc == 0, "epd exited %d after SIGTERM" % rc)
    s = socket.socket()
    s.settimeout(2)
    check(s.connect_ex(("127.0.0.1", port)) != 0, "port %d still accepts after the daemon exited" % port)
    s.close()
    print("ok")
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
    shutil.rmtree(T, ignore_errors=True)
