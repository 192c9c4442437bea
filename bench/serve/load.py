#!/usr/bin/env python3
"""Load test of `ditmem serve` on the loopback (a benchmark, not a test: timings are reported,
never asserted by `cargo test`).

Starts the release binary's server on a free port, sends REQUESTS requests from CLIENTS
concurrent clients (one keep-alive-less connection per request), mixing estimates, plans and
malformed or hostile requests, and checks:
  - no request is lost: every one gets an HTTP status (no connection error, no timeout);
  - every malformed one is answered 4xx, every good one 2xx (a plan that cannot fit: 422);
and reports p50/p99 latency per kind and the server's peak RSS (VmHWM of /proc/<pid>/status).

    python3 bench/serve/load.py [--requests 1000] [--clients 32] [--out DIR]

Python's standard library only. Exit 1 when a check fails.
"""

import argparse
import http.client
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Good requests: (kind, path, body, the statuses that are right).
ESTIMATES = [
    {"model": "flux.1-dev", "gpu": "rtx-4090", "lora_rank": 16},
    {"model": "sd3.5-medium", "gpu": "a100-80gb", "batch": 2},
    {"model": "pixart-sigma-1024", "gpu": "a100-40gb", "batch": 4},
    {"model": "wan2.1-1.3b", "gpu": "h100-sxm", "lora_rank": 32, "frames": 33,
     "resolution": "480x832"},
    {"model": "sana-600m", "gpu": "rtx-4090", "recompute": "all"},
    {"model": "dit-xl-2-256", "gpu": "l4", "batch": 8},
    {"model": "sd3-medium", "gpu": "rtx-3090", "lora_rank": 8, "optimizer": "adamw-8bit"},
]
PLANS = [
    {"model": "pixart-sigma-1024", "gpu": "rtx-4090", "allow": ["8bit"]},
    {"model": "sana-600m", "budget": "24GiB", "allow": ["8bit"]},
    {"model": "dit-xl-2-256", "gpu": "a100-80gb", "emit": "accelerate"},
    {"model": "flux.1-dev", "budget": "4GiB"},  # infeasible: 422 with the plan's JSON
]
MALFORMED = [
    ("not json", "POST", "/api/estimate", b"{not json", "application/json"),
    ("array body", "POST", "/api/estimate", b"[1, 2, 3]", "application/json"),
    ("unknown argument", "POST", "/api/estimate", b'{"lora_rnk": 4}', "application/json"),
    ("bad value", "POST", "/api/estimate", b'{"model": "flux.1-dev", "batch": -1}',
     "application/json"),
    ("unknown preset", "POST", "/api/estimate", b'{"model": "flux.9"}', "application/json"),
    ("a file argument", "POST", "/api/estimate", b'{"config": "/etc/passwd"}',
     "application/json"),
    ("a model path", "POST", "/api/params", b'{"model": "/etc/passwd"}', "application/json"),
    ("plan over the time limit", "POST", "/api/plan",
     b'{"model": "dit-s-2", "budget": "8GiB", "time_limit": 3600}', "application/json"),
    ("bad config object", "POST", "/api/estimate",
     b'{"model": {"_class_name": "FluxTransformer2DModel", "num_layers": -3}}',
     "application/json"),
    ("form body", "POST", "/api/estimate", b"model=flux.1-dev", "application/x-www-form-urlencoded"),
    ("too large", "POST", "/api/estimate", b"{" + b" " * (1 << 20) + b"}", "application/json"),
    ("GET on a POST route", "GET", "/api/estimate", None, None),
    ("unknown route", "GET", "/api/launch", None, None),
    ("path traversal", "GET", "/assets/../../etc/passwd", None, None),
    ("long URL", "GET", "/" + "a" * 5000, None, None),
    ("oom without message", "POST", "/api/oom", b"{}", "application/json"),
]


def workload(n, seed):
    """n requests: 65 % estimates, 7 % plans, 28 % malformed, shuffled with a fixed seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.65:
            body = ESTIMATES[i % len(ESTIMATES)]
            out.append(("estimate", "POST", "/api/estimate", json.dumps(body).encode(),
                        "application/json", {200}))
        elif r < 0.72:
            body = PLANS[i % len(PLANS)]
            want = {422} if body.get("budget") == "4GiB" else {200}
            out.append(("plan", "POST", "/api/plan", json.dumps(body).encode(),
                        "application/json", want))
        else:
            name, method, path, body, ctype = MALFORMED[i % len(MALFORMED)]
            out.append(("malformed:" + name, method, path, body, ctype, "4xx"))
    return out


def one(port, req, timeout):
    kind, method, path, body, ctype, want = req
    headers = {"Connection": "close"}
    if ctype:
        headers["Content-Type"] = ctype
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        status = resp.status
        conn.close()
    except Exception as e:  # a lost request
        return {"kind": kind, "status": None, "error": repr(e), "ms": None}
    ms = (time.perf_counter() - t0) * 1e3
    ok = (400 <= status < 500) if want == "4xx" else (status in want)
    rec = {"kind": kind, "status": status, "ms": ms, "ok": ok}
    if not ok:
        rec["body"] = data[:300].decode("utf-8", "replace")
    return rec


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def vm(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/ditmem"))
    ap.add_argument("--workers", type=int, default=None, help="ditmem serve --workers")
    ap.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, s")
    ap.add_argument("--seed", type=int, default=48)
    ap.add_argument("--out", default=None, help="folder for results.json")
    a = ap.parse_args()

    cmd = [a.binary, "serve", "--port", "0", "--json"]
    if a.workers:
        cmd += ["--workers", str(a.workers)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = json.loads(server.stdout.readline())
    port = int(started["url"].rstrip("/").rsplit(":", 1)[1])
    rss_idle = vm(server.pid, "VmRSS")

    reqs = workload(a.requests, a.seed)
    results = [None] * len(reqs)
    nxt = [0]
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(reqs):
                return
            results[i] = one(port, reqs[i], a.timeout)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    hwm = vm(server.pid, "VmHWM")
    alive = server.poll() is None
    # Still answering after it all.
    health = one(port, ("health", "GET", "/healthz", None, None, {200}), 10)
    server.send_signal(2)  # Ctrl-C: a clean stop
    try:
        code = server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        code = None

    lost = [r for r in results if r["status"] is None]
    wrong = [r for r in results if r["status"] is not None and not r["ok"]]
    kinds = {}
    for r in results:
        k = r["kind"].split(":")[0]
        kinds.setdefault(k, []).append(r)
    summary = {
        "requests": len(results),
        "clients": a.clients,
        "workers": started.get("workers"),
        "wall_s": round(wall, 2),
        "throughput_rps": round(len(results) / wall, 1),
        "lost": len(lost),
        "wrong_status": len(wrong),
        "status_counts": {},
        "per_kind": {},
        "server_peak_rss_bytes": hwm,
        "server_idle_rss_bytes": rss_idle,
        "server_alive_after": alive,
        "healthz_after": health["status"],
        "exit_code_after_ctrl_c": code,
    }
    for r in results:
        s = str(r["status"])
        summary["status_counts"][s] = summary["status_counts"].get(s, 0) + 1
    for k, rs in sorted(kinds.items()):
        ms = [r["ms"] for r in rs if r["ms"] is not None]
        summary["per_kind"][k] = {
            "n": len(rs),
            "p50_ms": round(pct(ms, 50), 1) if ms else None,
            "p99_ms": round(pct(ms, 99), 1) if ms else None,
            "max_ms": round(max(ms), 1) if ms else None,
        }
    all_ms = [r["ms"] for r in results if r["ms"] is not None]
    summary["all"] = {"p50_ms": round(pct(all_ms, 50), 1), "p99_ms": round(pct(all_ms, 99), 1)}
    summary["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(json.dumps(summary, indent=2))
    for r in (lost + wrong)[:10]:
        print("FAILED:", json.dumps(r), file=sys.stderr)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"summary": summary, "failures": (lost + wrong)[:50]}, f, indent=2)
    ok = not lost and not wrong and alive and health["status"] == 200 and code == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
