#!/usr/bin/env python3
"""Merge one run of bench/e2e/run_gpu.sh (unpacked e2e-results.tgz) into bench/results/:
bench_e2e_h200x2.json and bench_e2e_h200x2.md.

    python3 bench/e2e/report.py RUN_DIR [OUT_DIR] [--command=TEXT] [--name=BASENAME]

A run with PERSIST=1 (cases mps-launch and mps-persist) also gets a side-by-side table of the two modes,
with the in-process path both without MPS and under MPS (inproc-mps), so that MPS's own costs are apart.

Per-iteration arrays of the two ranks are merged by taking, per iteration, the slower rank (ranks run
each step together); per-op arrays of the pipelined modes likewise. Figures are medians with p10-p90.
"""
import json
import os
import statistics
import sys


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))]


def stat(v):
    return {"p50_us": round(pct(v, 0.5), 2), "p10_us": round(pct(v, 0.1), 2), "p90_us": round(pct(v, 0.9), 2)}


def load_pair(prefix):
    r = []
    for k in range(2):
        p = "%s.rank%d.json" % (prefix, k)
        if not os.path.exists(p):
            return None
        with open(p) as f:
            r.append(json.load(f))
    return r


def merge(pair):
    out = {}
    for key, v0 in pair[0].items():
        v1 = pair[1].get(key)
        if isinstance(v0, list):
            n = min(len(v0), len(v1))
            out[key] = stat([max(v0[i], v1[i]) for i in range(n)])
        elif key not in ("rank",):
            out[key] = round(max(v0, v1), 3) if isinstance(v0, (int, float)) else v0
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = "bench_e2e_h200x2"
    cmd = "bash bench/e2e/run_gpu.sh build-e2e/bundle (run tool, nvidia-h200-x2)"
    for a in sys.argv[1:]:
        if a.startswith("--command="):
            cmd = a.split("=", 1)[1]
        if a.startswith("--name="):
            name = a.split("=", 1)[1]
    run = args[0]
    outdir = args[1] if len(args) > 1 else "bench/results"
    with open(os.path.join(run, "inproc", "bench_ll.json")) as f:
        inproc = json.load(f)
    env = open(os.path.join(run, "env.txt")).read().splitlines()
    res = {"bench": "bench_e2e", "date": env[0], "device": "2x " + env[1].split(",")[0].strip(),
           "driver": env[1].split(",")[1].strip(), "torch": next((l for l in env if l.startswith("torch")), ""),
           "nccl_version": inproc.get("nccl_version"), "cuda_runtime": inproc.get("cuda_runtime"),
           "cuda_driver_api": inproc.get("cuda_driver"), "command": cmd,
           "setting": {"ranks": 2, "tokens": 128, "hidden": 7168, "topk": 8, "experts": 256,
                       "routing": "random, 8 distinct experts per token"},
           "inproc": {k: inproc[k] for k in inproc if k.startswith(("a_", "c_", "d_")) or "kernel" in k or
                      "inproc" in k or "e2e" in k},
           "configs": {}}
    res["inproc_raw"] = inproc
    pp = os.path.join(run, "inproc-p", "bench_ll.json")
    if os.path.exists(pp):
        with open(pp) as f:
            res["inproc_p_raw"] = json.load(f)
    pm = os.path.join(run, "inproc-mps", "bench_ll.json")
    if os.path.exists(pm):
        with open(pm) as f:
            res["inproc_mps_raw"] = json.load(f)
    for cfg in ("nomps", "nomps-spin", "mps-spin", "mps-launch", "mps-persist", "mps-persist128"):
        c = {}
        pair = load_pair(os.path.join(run, cfg, "e2e"))
        if pair:
            c["c"] = merge(pair)
        pair = load_pair(os.path.join(run, cfg, "py"))
        if pair:
            c["py"] = merge(pair)
        try:
            log = open(os.path.join(run, cfg, "daemon.log")).read()
            c["daemon_mode"] = next(l.split("cuda: ", 1)[1] for l in log.splitlines() if "MPS o" in l and "mode" in l)
        except (OSError, StopIteration):
            pass
        res["configs"][cfg] = c
    os.makedirs(outdir, exist_ok=True)
    res["configs"] = {k: v for k, v in res["configs"].items() if v}
    with open(os.path.join(outdir, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    write_md(res, inproc, os.path.join(outdir, name + ".md"), res.get("inproc_p_raw"), res.get("inproc_mps_raw"))


def find(d, *names):
    for n in names:
        if n in d:
            return d[n]
    return None


def write_md(res, inproc, path, inproc_p=None, inproc_mps=None):
    def kern(dt, op, src=None):
        src = src or inproc
        k = {("fp8", "d"): "a_dispatch_fp8_kernel", ("fp8", "c"): "a_combine_kernel_after_fp8",
             ("bf16", "d"): "a_dispatch_bf16_kernel", ("bf16", "c"): "a_combine_kernel_after_bf16"}[(dt, op)]
        if isinstance(src.get(k), dict):
            return src[k]["p50_us"]
        return None

    def inproc_step(dt, src=None):
        for k, v in (src or inproc).items():
            if k.startswith("c_") and dt in k and isinstance(v, dict):
                return v["p50_us"]
        return None

    L = []
    L.append("# LL end to end through the daemon, %s\n" % res["device"])
    L.append("%s; NCCL %s, CUDA runtime %s, driver %s (API %s), %s; command `%s`.\n" % (
        res["date"], res["nccl_version"], res["cuda_runtime"], res["driver"], res["cuda_driver_api"], res["torch"],
        res["command"]))
    L.append("Setting: 2 ranks (one client process per rank, epd-bench-e2e), 128 tokens per rank, hidden 7168, "
             "top-8, 256 experts, random routing; daemon engine.backend=cuda in launch-per-op mode (a daemon "
             "thread per GPU polls the host-mapped queues and launches the LL kernel). Medians (p10-p90) of 300 "
             "iterations, per iteration the slower rank. `sync`: both ranks released by a shared-memory barrier, "
             "host clock from the first enqueue to the end of the stream sync (bench_ll's in-process (c) is the "
             "same definition). `pipe`: 300 steps enqueued back to back, host clock total / steps (the rows 'with CUDA events' "
             "record an event between ops for per-op times, which perturbs the run without MPS; device-side: "
             "GPU global timer in the client kernel, submit to completion seen). 'daemon-side latency' is "
             "comp.latency_ns: from the daemon seeing the last rank's submission to writing the completion. Device-side without MPS "
             "ran 20 iterations only.\n")
    L.append("Baselines from the same device call (epd-bench, in-process, same 2 GPUs): kernel time (a) "
             "dispatch FP8 %s / combine %s / dispatch BF16 %s / combine %s µs; in-process end to end (c) "
             "FP8 step %s µs, BF16 step %s µs.\n" % (kern("fp8", "d"), kern("fp8", "c"), kern("bf16", "d"),
                                                   kern("bf16", "c"), inproc_step("fp8"), inproc_step("bf16")))
    for cfg, title in (("nomps", "no MPS, default poll loop (spin 256 polls, then 2 µs sleeps)"),
                       ("nomps-spin", "no MPS, engine.idle_spin_ns=20000000 (rank threads do not sleep while busy)"),
                       ("mps-spin", "CUDA MPS on, engine.idle_spin_ns=20000000"),
                       ("mps-launch", "CUDA MPS on, engine.cuda_mode=launch (a kernel launch per op), engine.idle_spin_ns=20000000"),
                       ("mps-persist", "CUDA MPS on, engine.cuda_mode=persistent (persistent kernels serve the queues, "
                                       "64 blocks: the mode's default), engine.idle_spin_ns=20000000"),
                       ("mps-persist128", "CUDA MPS on, engine.cuda_mode=persistent, engine.ll_blocks=128 (the launch "
                                          "mode's and in-process blocks), engine.idle_spin_ns=20000000")):
        c = res["configs"].get(cfg, {}).get("c")
        if not c:
            continue
        L.append("\n## %s\n" % title)
        if res["configs"][cfg].get("daemon_mode"):
            L.append("Daemon: `%s`\n" % res["configs"][cfg]["daemon_mode"])
        ks = c.get("kernel_submit")
        if isinstance(ks, dict):
            ks = ks.get("p50_us")
        if ks:
            L.append("libepd submits through the queue's device twin with its kernels here (EPD_INFO_KERNEL_SUBMIT = 1): "
                     "the 'memop' and 'graph' rows are the stream path (epd_dispatch/epd_combine on a stream), "
                     "served by two one-warp kernels per op instead of stream memory operations.\n")
        L.append("| what | FP8 dispatch µs | BF16 dispatch µs |\n| --- | --- | --- |")

        def row(name, key, fmt=lambda s: "%.2f (%.2f-%.2f)" % (s["p50_us"], s["p10_us"], s["p90_us"])):
            cells = []
            for dt in ("fp8", "bf16"):
                v = c.get(dt + "." + key)
                cells.append("—" if v is None else (fmt(v) if isinstance(v, dict) else "%.2f" % v))
            L.append("| %s | %s | %s |" % (name, cells[0], cells[1]))

        row("memop sync: step (dispatch+combine), host", "memop.sync.step_host_us")
        row("memop sync: daemon-side latency of the combine (comp.latency_ns)", "memop.sync.combine_daemon_latency_us")
        row("memop pipe: step period (host, total / steps)", "memop.pipe.period_host_us")
        row("memop pipe with CUDA events: dispatch on the stream", "memop.events.dispatch_stream_us")
        row("memop pipe with CUDA events: combine on the stream", "memop.events.combine_stream_us")
        row("memop pipe with CUDA events: step period", "memop.events.period_host_us")
        row("memop: host cost of one epd_dispatch/epd_combine call", "memop.enqueue_call_host_us")
        row("graph (4 steps captured) sync: per step, host", "graph.sync.step_host_us")
        row("graph pipe: step period", "graph.pipe.period_host_us")
        row("device-side sync: step, host (one kernel per step)", "device.sync.step_host_us")
        row("device-side pipe: dispatch, GPU timer", "device.pipe.dispatch_gpu_us")
        row("device-side pipe: combine, GPU timer", "device.pipe.combine_gpu_us")
        row("device-side pipe: step period, GPU timer", "device.pipe.step_gpu_us")
        row("device-side pipe: daemon-side latency of the combine", "device.pipe.combine_daemon_latency_us")
        L.append("\nDaemon overhead (e2e − in-process):\n")
        L.append("| path | FP8 step µs | BF16 step µs | target |\n| --- | --- | --- | --- |")
        for name, key, tgt in (("memop sync step − in-process (c)", "memop.sync.step_host_us", "≤ 8"),
                               ("graph sync step − in-process (c)", "graph.sync.step_host_us", "≤ 8"),
                               ("device-side sync step − in-process (c)", "device.sync.step_host_us", "≤ 3")):
            cells = []
            for dt in ("fp8", "bf16"):
                v = c.get(dt + "." + key)
                ip = inproc_step(dt)
                cells.append("—" if v is None or ip is None else "%+.2f" % (v["p50_us"] - ip))
            L.append("| %s | %s | %s | %s |" % (name, cells[0], cells[1], tgt))
        for name, key, tgt in (("memop with events: (dispatch + combine on the stream) − kernel times", "memop.events", "≤ 8"),
                               ("device pipe: (dispatch + combine, GPU timer) − kernel times", "device.pipe", "≤ 3")):
            cells = []
            for dt in ("fp8", "bf16"):
                suf = "stream_us" if key.startswith("memop") else "gpu_us"
                d, cc = c.get("%s.%s.dispatch_%s" % (dt, key, suf)), c.get("%s.%s.combine_%s" % (dt, key, suf))
                kd, kc = kern(dt, "d"), kern(dt, "c")
                cells.append("—" if not d or not cc or kd is None else "%+.2f" % (d["p50_us"] + cc["p50_us"] - kd - kc))
            L.append("| %s | %s | %s | %s |" % (name, cells[0], cells[1], tgt))
        py = res["configs"][cfg].get("py")
        if py:
            L.append("\nPython (epd package, torch stream; bench/e2e/py_overhead.py) against the same daemon:\n")
            L.append("| what | FP8 C µs | FP8 Python µs | Python − C | BF16 C µs | BF16 Python µs | Python − C |")
            L.append("| --- | --- | --- | --- | --- | --- | --- |")
            for name, ck, pk in (("sync step, host", "memop.sync.step_host_us", "memop.sync.step_host_us"),
                                 ("pipe step period", "memop.pipe.period_host_us", "memop.pipe.period_host_us"),
                                 ("one dispatch/combine call, host", "memop.enqueue_call_host_us", "py.enqueue_call_host_us"),
                                 ("graph sync step", "graph.sync.step_host_us", "graph.sync.step_host_us"),
                                 ("graph pipe step period", "graph.pipe.period_host_us", "graph.pipe.period_host_us")):
                cells = []
                for dt in ("fp8", "bf16"):
                    a, b = c.get(dt + "." + ck), py.get(dt + "." + pk)
                    a = a["p50_us"] if isinstance(a, dict) else a
                    b = b["p50_us"] if isinstance(b, dict) else b
                    cells += ["—" if a is None else "%.2f" % a, "—" if b is None else "%.2f" % b,
                              "—" if a is None or b is None else "%+.2f" % (b - a)]
                L.append("| %s | %s |" % (name, " | ".join(cells)))
    ipp = inproc_p or {}
    pb = ipp.get("setting", {}).get("blocks", "?")
    cols = []  # (label, config, in-process source of the same blocks)
    for cfg, lab, src in (("mps-launch", "launch (128)", inproc), ("mps-persist", "persistent (%s)" % pb, ipp or None),
                          ("mps-persist128", "persistent (128)", inproc)):
        c = res["configs"].get(cfg, {}).get("c")
        if c:
            cols.append((lab, c, src))
    if len(cols) >= 2:
        L.append("\n## Side by side: launch vs persistent mode (all under MPS), and in-process\n")
        ips = [("in-process (128)", inproc)] + ([("in-process (%s)" % pb, ipp)] if ipp else []) + \
              ([("in-process under MPS (128)", inproc_mps)] if inproc_mps else [])
        hdr = []
        for dt in ("FP8", "BF16"):
            hdr += ["%s: %s" % (dt, n) for n, _ in ips] + ["%s: %s" % (dt, lab) for lab, _, _ in cols]
        L.append("| what | %s |\n| --- | %s |" % (" | ".join(hdr), " | ".join("---" for _ in hdr)))
        for nm, key, ipk in (("memop sync: step, host", "memop.sync.step_host_us", "c"),
                             ("memop pipe: step period", "memop.pipe.period_host_us", None),
                             ("graph sync: per step, host", "graph.sync.step_host_us", "c"),
                             ("graph pipe: step period", "graph.pipe.period_host_us", None),
                             ("device-side sync: step, host", "device.sync.step_host_us", "c"),
                             ("device-side pipe: step period, GPU timer", "device.pipe.step_gpu_us", None),
                             ("device-side pipe: dispatch, GPU timer", "device.pipe.dispatch_gpu_us", "kd"),
                             ("device-side pipe: combine, GPU timer", "device.pipe.combine_gpu_us", "kc"),
                             ("memop sync: combine comp.latency_ns", "memop.sync.combine_daemon_latency_us", None),
                             ("device-side pipe: combine comp.latency_ns", "device.pipe.combine_daemon_latency_us", None)):
            cells = []
            for dt in ("fp8", "bf16"):
                for _, src in ips:
                    ip = (inproc_step(dt, src) if ipk == "c" else kern(dt, "d", src) if ipk == "kd"
                          else kern(dt, "c", src) if ipk == "kc" else None)
                    cells.append("—" if ip is None else "%.2f" % ip)
                for _, c, _ in cols:
                    v = c.get(dt + "." + key)
                    cells.append("—" if v is None else "%.2f" % (v["p50_us"] if isinstance(v, dict) else v))
            L.append("| %s | %s |" % (nm, " | ".join(cells)))
        L.append("\nIn-process columns: step rows are bench_ll's in-process end to end (c) (host launch of both "
                 "kernels to stream sync); dispatch/combine rows are the kernel times (a). comp.latency_ns: launch "
                 "mode from the daemon seeing the last rank's submission to the completion, persistent mode from "
                 "the kernel seeing this rank's slot to the completion (includes the wait for the other rank).\n")
        L.append("Daemon overhead over in-process at the same blocks (step, p50):\n")
        hdr = ["%s %s" % (dt, lab) for dt in ("FP8", "BF16") for lab, _, _ in cols]
        L.append("| path | %s | target |\n| --- | %s | --- |" % (" | ".join(hdr), " | ".join("---" for _ in hdr)))
        for nm, key, tgt in (("memop sync step − in-process (c)", "memop.sync.step_host_us", "≤ 8"),
                             ("graph sync step − in-process (c)", "graph.sync.step_host_us", "≤ 8"),
                             ("device-side sync step − in-process (c)", "device.sync.step_host_us", "≤ 3")):
            cells = []
            for dt in ("fp8", "bf16"):
                for _, c, src in cols:
                    ip = inproc_step(dt, src) if src else None
                    v = c.get(dt + "." + key)
                    cells.append("—" if v is None or ip is None else "%+.2f" % (v["p50_us"] - ip))
            L.append("| %s | %s | %s |" % (nm, " | ".join(cells), tgt))
        cells = []
        for dt in ("fp8", "bf16"):
            for _, c, src in cols:
                d, cc = c.get(dt + ".device.pipe.dispatch_gpu_us"), c.get(dt + ".device.pipe.combine_gpu_us")
                kd, kc = (kern(dt, "d", src), kern(dt, "c", src)) if src else (None, None)
                cells.append("—" if not d or not cc or kd is None else "%+.2f" % (d["p50_us"] + cc["p50_us"] - kd - kc))
        L.append("| device-side pipe: (dispatch + combine, GPU timer) − kernel times | %s | ≤ 3 |" % " | ".join(cells))
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
