#!/usr/bin/env python3
"""Soak: two `fairshare serve` replicas on one Redis, under mixed load for N minutes.

Tenants with floors, a tenant with many instances, a churn of template tenants, a fail-open
tool, unknown keys; clients that disconnect at random (some after sending the whole request,
while the decision is in flight); SIGHUP reloads every minute; one Redis restart (SIGKILL,
no persistence) half-way; four connection-reset floods (2,000 connections from four tenants
that send a call and reset it, SO_LINGER 0, at once or 1-2 ms later, 50 at a time). Then it
checks, and prints:

  - after each flood, within 1 s: the permits of `search` held in Redis are those of calls
    in flight (at most 10), and an innocent tenant's calls are not refused
    `concurrency_exceeded`;
  - logs proportional to events: at most 16 WARN/ERROR lines in any second per replica;
  - RSS of each replica bounded: sampled every 10 s, every sample after warm-up within
    0.8-1.2x their median; and, once the load has stopped, eight more floods of 2,000 reset
    connections on each replica, back to back: across the last six (12,000 resets) a replica's
    RSS grows by at most 128 bytes a reset connection (1.5 MB), less than anything a connection
    holds (its task, its buffers) would leave if it were kept. The allocator's high-water mark
    rises in steps of a few hundred KiB now and then and stays put between them (seen: +4,
    +412, +296, +4, +0, +136 KiB, 73 bytes a reset; 2-40 on other runs and replicas);
  - /metrics bounded: at most 64 KiB, and every `tenant` label value a listed tenant,
    `other`, `unknown`, or a template tenant that was busy (one of the floods'): the metrics name
    unlisted callers only among a tool's busiest;
  - 0 panics;
  - 0 5xx answers outside the Redis outage;
  - 0 overshoot in any window outside the restart: per window aligned to Redis's clock, the
    calls both replicas admitted (from their decision logs, timed by Redis) are at most the
    tool's capacity, and each listed tenant's at most its ceiling + burst.

Usage: scripts/soak [--minutes 10] [--rps 220] [--keep DIR]. Exit 1 if a check fails.
Starts its own redis-server on a free loopback port; builds `fairshare` (release) first.
"""

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERIOD_S = 5

POLICY = """
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 200, per = "5s" }
max_concurrency = 40

[tool.tenants.A]
weight = 3
floor = 40
max_concurrency = 12

[tool.tenants.B]
weight = 1
floor = 20
ceiling = 120

[tool.tenants.B.default_instance]
max_instances = 20

[tool.default_tenant]
weight = 1
max_tenants = 200

[[tool]]
name = "report"
unit = "calls"
rate = { limit = 50, per = "10s" }
on_store_error = "allow"

[tool.default_tenant]
max_tenants = 500
"""

TEMPLATE_TENANTS = 1000
METRICS_KEY = "soak-metrics-key"


def keys_file():
    lines = ['[keys."sk-a"]\ntenant = "A"\n']
    for i in range(20):
        lines.append(f'[keys."sk-b{i}"]\ntenant = "B"\ninstance = "agent-{i}"\n')
    for i in range(TEMPLATE_TENANTS):
        lines.append(f'[keys."sk-t{i}"]\ntenant = "guest-{i}"\n')
    return "\n".join(lines)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Redis:
    def __init__(self, port, dir_):
        self.port, self.dir, self.proc = port, dir_, None

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.dir,
             "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 5
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("redis-server did not start")

    def kill(self):
        if self.proc:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None


class Replica:
    def __init__(self, binary, policy, keys, redis_url, log_path):
        self.log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [binary, "serve", "--policy", policy, "--keys", keys, "--listen", "127.0.0.1:0",
             "--redis", redis_url, "--metrics-key", METRICS_KEY, "--log-decisions"],
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        first = self.proc.stdout.readline()
        m = re.search(r"http://([\d.]+):(\d+)", first)
        if not m:
            raise SystemExit(f"serve did not start: {first!r}")
        self.host, self.port = m.group(1), int(m.group(2))
        self.proc.stdout.readline()


class Stats:
    def __init__(self):
        self.answers = []  # (time, status)
        self.disconnects = 0
        self.errors = 0


async def request(reader, writer, path, key, disconnect):
    """One call on a keep-alive connection: its status and body (None when the client
    disconnects right after sending it)."""
    head = f"POST {path} HTTP/1.1\r\nhost: soak\r\ncontent-length: 0\r\n"
    if key:
        head += f"x-api-key: {key}\r\n"
    writer.write((head + "\r\n").encode())
    await writer.drain()
    if disconnect:
        return None
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("closed")
    status = int(status_line.split()[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return status, body


async def client(replicas, profile, rate, until, stats, rng):
    """One caller profile at `rate` calls/s, over both replicas, on keep-alive connections;
    now and then a disconnect right after sending a request (the decision is in flight)."""
    conns = {}
    interval = 1.0 / rate
    next_at = time.monotonic()
    while time.monotonic() < until:
        next_at += interval * rng.expovariate(1.0)
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        path, key = profile(rng)
        r = rng.randrange(len(replicas))
        disconnect = rng.random() < 0.04
        try:
            if r not in conns:
                conns[r] = await asyncio.wait_for(
                    asyncio.open_connection(replicas[r].host, replicas[r].port), 5)
            reader, writer = conns[r]
            answer = await asyncio.wait_for(request(reader, writer, path, key, disconnect), 10)
            if answer is None:
                stats.disconnects += 1
                writer.close()
                del conns[r]
            else:
                stats.answers.append((time.time(), answer[0]))
        except (OSError, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                ValueError, IndexError):
            stats.errors += 1
            if r in conns:
                conns[r][1].close()
                del conns[r]
    for _, w in conns.values():
        w.close()


def redis_command(port, *args):
    """One command to the soak's Redis, its integer or bulk answer (RESP, no client library)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        req = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
        s.sendall(req.encode())
        answer = s.recv(65536).decode(errors="replace")
    if answer.startswith(":"):
        return int(answer[1:].split("\r\n")[0])
    return answer


async def reset_one(replica, key, rng):
    """A call sent and the connection reset (RST) at once or 1-2 ms later."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (replica.host, replica.port)), 5)
        await loop.sock_sendall(sock, (f"POST /tools/search HTTP/1.1\r\nhost: soak\r\n"
                                       f"x-api-key: {key}\r\ncontent-length: 0\r\n\r\n").encode())
        if rng.random() < 0.5:
            await asyncio.sleep(rng.uniform(0.001, 0.002))
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


async def reset_flood(replicas, rng, per_tenant=500):
    """Four tenants (two instances of B, two template tenants) each reset `per_tenant` calls,
    50 at a time, over both replicas: how many, and the template tenants' names."""
    keys = ["sk-b0", "sk-b1", f"sk-t{rng.randrange(TEMPLATE_TENANTS)}",
            f"sk-t{rng.randrange(TEMPLATE_TENANTS)}"]
    jobs = [(replicas[i % len(replicas)], k) for k in keys for i in range(per_tenant)]
    rng.shuffle(jobs)
    for i in range(0, len(jobs), 50):
        await asyncio.gather(*(reset_one(rep, k, rng) for rep, k in jobs[i:i + 50]))
    return len(jobs), {f"guest-{k[len('sk-t'):]}" for k in keys if k.startswith("sk-t")}


LEAK_FLOODS = 8
LEAK_BOUND = 128  # bytes of RSS a reset connection may leave, over the last six floods


async def leak_probe(replicas, rng):
    """The load stopped, `LEAK_FLOODS` floods of reset connections on each replica in turn:
    each replica's RSS (KiB) after each flood, and how many resets a flood sent it."""
    rss = [[] for _ in replicas]
    resets = 0
    for _ in range(LEAK_FLOODS):
        for rep in replicas:
            resets, _ = await reset_flood([rep], rng)
        await asyncio.sleep(1)
        for i, rep in enumerate(replicas):
            rss[i].append(rss_kb(rep.proc.pid))
    return rss, resets


async def probe(replica, key, n=10):
    """`n` calls by `key` on a connection of its own: the error of each refused one."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(replica.host, replica.port), 5)
    errors = []
    try:
        for _ in range(n):
            status, body = await asyncio.wait_for(
                request(reader, writer, "/tools/search", key, False), 10)
            if status != 200:
                errors.append(body.decode())
    finally:
        writer.close()
    return errors


async def scrape(replica):
    reader, writer = await asyncio.open_connection(replica.host, replica.port)
    writer.write(f"GET /metrics HTTP/1.1\r\nhost: soak\r\nauthorization: Bearer {METRICS_KEY}\r\n"
                 "connection: close\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    body = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""
    return body.decode(errors="replace")


def rss_step(rss_samples, at, column):
    """What RSS (column of the samples) gained across a flood at `at`: from the last sample
    before it to the first 20 s or more after it; None when either is missing."""
    before = [s[column] for s in rss_samples if s[0] < at and s[column]]
    after = [s[column] for s in rss_samples if s[0] >= at + 20 and s[column]]
    if not before or not after:
        return None
    return after[0] - before[-1]


def metric(text, name, *labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(l in line for l in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


def allocation(binary, policy):
    """Ceiling and burst of each listed tenant of `search`, from `fairshare check`."""
    out = subprocess.run([binary, "check", policy], capture_output=True, text=True,
                         check=True).stdout
    bounds, tool = {}, None
    for line in out.splitlines():
        if line.startswith("tool "):
            tool = line.split()[1].rstrip(":")
        elif tool == "search" and line.startswith("  ") and not line.startswith("    "):
            parts = line.split()
            if parts[0] in ("A", "B"):
                floor, weight, share, ceiling, burst = map(float, parts[1:6])
                bounds[parts[0]] = ceiling + burst
    return bounds


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--rps", type=float, default=220)
    ap.add_argument("--keep", help="keep the logs in this directory")
    args = ap.parse_args()
    duration = args.minutes * 60
    warmup = min(120.0, duration / 5)

    subprocess.run(["cargo", "build", "-q", "--release", "-p", "fairshare"],
                   cwd=ROOT, check=True)
    binary = os.path.join(ROOT, "target", "release", "fairshare")
    work = args.keep or tempfile.mkdtemp(prefix="fairshare-soak-")
    os.makedirs(work, exist_ok=True)
    policy = os.path.join(work, "policy.toml")
    keys = os.path.join(work, "keys.toml")
    with open(policy, "w") as f:
        f.write(POLICY)
    with open(keys, "w") as f:
        f.write(keys_file())
    bounds = allocation(binary, policy)

    redis = Redis(free_port(), work)
    redis.start()
    url = f"redis://127.0.0.1:{redis.port}/"
    replicas = [Replica(binary, policy, keys, url, os.path.join(work, f"replica-{i}.log"))
                for i in range(2)]
    print(f"soak: {args.minutes:g} min, ~{args.rps:g} calls/s over 2 replicas "
          f"(:{replicas[0].port}, :{replicas[1].port}) on redis :{redis.port}; logs in {work}")
    sys.stdout.flush()

    rng = random.Random(7)
    share = args.rps / 220.0
    profiles = [
        (lambda r: ("/tools/search", "sk-a"), 60 * share),
        (lambda r: ("/tools/search", f"sk-b{r.randrange(20)}"), 50 * share),
        (lambda r: ("/tools/search", f"sk-t{r.randrange(TEMPLATE_TENANTS)}"), 70 * share),
        (lambda r: ("/tools/report", f"sk-t{r.randrange(TEMPLATE_TENANTS)}"), 30 * share),
        (lambda r: ("/tools/search", f"sk-unknown-{r.randrange(10**9)}"), 5 * share),
        (lambda r: (f"/tools/made-up-{r.randrange(10**9)}", "sk-a"), 5 * share),
    ]
    start = time.time()
    until = time.monotonic() + duration
    stats = Stats()
    tasks = []
    for profile, rate in profiles:
        for k in range(4):
            tasks.append(asyncio.create_task(
                client(replicas, profile, rate / 4, until, stats, random.Random(rng.random()))))

    samples = []  # (elapsed, rss0, rss1, metrics0, metrics1)
    tenant_labels = [set(), set()]  # every `tenant` label value each replica's /metrics showed
    rss_samples = []  # (elapsed, rss0, rss1), every 10 s
    outage = None  # (killed_at, restarted_at)
    restart_at = duration / 2
    floods_at = [duration * k / 8 for k in (1, 3, 5, 7)]
    flooders = set()  # the template tenants of the floods: busy, so they may be named
    floods = []  # (elapsed, resets, permits held 1 s later, innocent refused concurrency_exceeded)
    next_hup, next_sample, next_rss = 60.0, 0.0, 0.0
    while time.monotonic() < until:
        await asyncio.sleep(1)
        elapsed = time.time() - start
        if outage is None and elapsed >= restart_at:
            killed = time.time()
            redis.kill()
            await asyncio.sleep(3)
            redis.start()
            outage = (killed, time.time())
            print(f"  {elapsed:6.0f}s  redis killed (SIGKILL, no persistence) and restarted 3 s later")
        if floods_at and elapsed >= floods_at[0]:
            floods_at.pop(0)
            resets, busy = await reset_flood(replicas, rng)
            flooders |= busy
            await asyncio.sleep(1)
            held = redis_command(redis.port, "ZCARD", "fs5{search}T!")
            innocent = []
            for rep in replicas:
                innocent += [e for e in await probe(rep, "sk-b19") if "concurrency" in e]
            floods.append((elapsed, resets, held, len(innocent)))
            print(f"  {elapsed:6.0f}s  {resets} connections reset; 1 s later {held} permits of "
                  f"`search` held in Redis, {len(innocent)} innocent calls refused for concurrency")
        if elapsed >= next_hup:
            next_hup += 60
            for rep in replicas:
                rep.proc.send_signal(signal.SIGHUP)
        if elapsed >= next_rss:
            next_rss += 10
            rss_samples.append((elapsed, *[rss_kb(rep.proc.pid) for rep in replicas]))
        if elapsed >= next_sample:
            next_sample += 30
            sizes = []
            for i, rep in enumerate(replicas):
                try:
                    text = await asyncio.wait_for(scrape(rep), 5)
                except (OSError, asyncio.TimeoutError):
                    sizes.append(None)
                    continue
                sizes.append(len(text))
                tenant_labels[i] |= set(re.findall(r'tenant="([^"]*)"', text))
                if args.keep:
                    with open(os.path.join(work, f"metrics-{i}-{elapsed:04.0f}s.txt"), "w") as f:
                        f.write(text)
            rss = [rss_kb(rep.proc.pid) for rep in replicas]
            samples.append((elapsed, rss[0], rss[1], sizes[0], sizes[1]))
            print(f"  {elapsed:6.0f}s  rss {rss[0]} / {rss[1]} KiB, /metrics {sizes[0]} / {sizes[1]} B, "
                  f"{len(stats.answers)} answers, {stats.disconnects} disconnects")
            sys.stdout.flush()
    await asyncio.gather(*tasks)
    final_metrics = [await scrape(rep) for rep in replicas]
    probe_rss, probe_resets = await leak_probe(replicas, rng)
    for rep in replicas:
        rep.proc.send_signal(signal.SIGTERM)
    for rep in replicas:
        try:
            rep.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            rep.proc.kill()
        rep.log.close()
    redis.kill()

    # ---- checks ------------------------------------------------------------------------
    failures = []
    print("\nresults")

    # Outage: from the kill until both replicas answered from Redis again (+2 s).
    recovered = outage[1]
    after = sorted(t for t, s in stats.answers if t > outage[1] and s == 200)
    if after:
        recovered = after[0]
    outage_span = (outage[0], recovered + 2)
    print(f"  redis outage: {outage_span[1] - outage_span[0]:.1f} s (kill to first 200 + 2 s)")

    statuses = {}
    for t, s in stats.answers:
        statuses[s] = statuses.get(s, 0) + 1
    fivexx = [(t, s) for t, s in stats.answers
              if s >= 500 and not (outage_span[0] <= t <= outage_span[1])]
    print(f"  answers by status: {dict(sorted(statuses.items()))}; {stats.disconnects} client "
          f"disconnects in flight; {stats.errors} transport errors")
    print(f"  5xx outside the outage: {len(fivexx)}")
    if fivexx:
        failures.append(f"{len(fivexx)} 5xx outside the outage")

    for at, resets, held, innocent in floods:
        if held > 10 or innocent:
            failures.append(f"the flood at {at:.0f} s left {held} permits held and "
                            f"{innocent} innocent calls refused for concurrency")
    print(f"  reset floods: {len(floods)}, {sum(f[1] for f in floods)} connections; permits held "
          f"1 s after each: {[f[2] for f in floods]}; innocent calls refused for concurrency: "
          f"{sum(f[3] for f in floods)}")
    if len(floods) < 4:
        failures.append(f"only {len(floods)} reset floods ran")

    panics = 0
    loud = []  # per replica: WARN/ERROR lines, and the most in one second
    admitted = []  # (at_us, tool, tenant)
    lost = 0
    pat = re.compile(r'tool="([^"]*)" tenant="([^"]*)".*outcome="admitted".*at_us=(\d+)')
    for rep in replicas:
        per_second = {}
        with open(rep.log_path) as f:
            for line in f:
                if " WARN " in line or " ERROR " in line:
                    second = line[:19]
                    per_second[second] = per_second.get(second, 0) + 1
                if "panicked" in line:
                    panics += 1
                if "lost this tool's state" in line:
                    lost += 1
                if 'outcome="admitted"' in line:
                    m = pat.search(line)
                    if m:
                        admitted.append((int(m.group(3)), m.group(1), m.group(2)))
        loud.append((sum(per_second.values()), max(per_second.values(), default=0)))
    print(f"  panics: {panics}")
    print(f"  WARN/ERROR lines per replica (total, most in one second): {loud}")
    for i, (_, most) in enumerate(loud):
        if most > 16:
            failures.append(f"replica {i} wrote {most} WARN/ERROR lines in one second")
    if panics:
        failures.append(f"{panics} panics")
    print(f"  state loss noticed by the replicas: {lost} log lines (expected after the restart)")

    windows = {}
    for at, tool, tenant in admitted:
        if tool != "search":
            continue
        w = at // (PERIOD_S * 1_000_000)
        tot = windows.setdefault(w, {})
        tot["*"] = tot.get("*", 0) + 1
        tot[tenant] = tot.get(tenant, 0) + 1
    lo = (outage_span[0] - PERIOD_S) * 1_000_000 // (PERIOD_S * 1_000_000)
    hi = (outage_span[1] + PERIOD_S) * 1_000_000 // (PERIOD_S * 1_000_000)
    over = []
    checked = 0
    worst = {"*": 0, "A": 0, "B": 0}
    for w, tot in sorted(windows.items()):
        if lo <= w <= hi:
            continue
        checked += 1
        limits = {"*": 200, **bounds}
        for who, limit in limits.items():
            n = tot.get(who, 0)
            worst[who] = max(worst[who], n)
            if n > limit + 1e-9:
                over.append((w, who, n, limit))
    print(f"  admitted calls of `search` in the logs: {sum(t['*'] for t in windows.values())}, "
          f"{checked} windows of {PERIOD_S} s checked ({len(windows) - checked} around the restart "
          f"skipped)")
    print(f"  most in one window: tool {worst['*']} of 200; A {worst['A']} of {bounds['A']:g}; "
          f"B {worst['B']} of {bounds['B']:g} (ceiling + burst)")
    print(f"  overshoot: {len(over)} windows")
    if over:
        failures.append(f"overshoot in {len(over)} windows: {over[:5]}")

    post = [s for s in samples if s[0] >= warmup]
    post_rss = [s for s in rss_samples if s[0] >= warmup]
    if post_rss:
        for i in (0, 1):
            values = [s[1 + i] for s in post_rss if s[1 + i]]
            median = sorted(values)[len(values) // 2]
            lo_r, hi_r = min(values) / median, max(values) / median
            third = max(1, len(values) // 3)
            first, last = values[:third], values[-third:]
            growth = (sum(last) / len(last)) / (sum(first) / len(first))
            anchored = (min(values) / values[0], max(values) / values[0])
            print(f"  replica {i} rss after warm-up ({len(values)} samples): median {median} KiB, "
                  f"{min(values)}-{max(values)} KiB ({lo_r:.2f}-{hi_r:.2f}x the median); last third "
                  f"{growth:.2f}x the first; {anchored[0]:.2f}-{anchored[1]:.2f}x the first sample")
            if not (0.8 <= lo_r and hi_r <= 1.2):
                failures.append(f"replica {i} RSS left the 0.8-1.2x band: {lo_r:.2f}-{hi_r:.2f}x")
            steps = [rss_step(rss_samples, at, 1 + i) for at, *_ in floods]
            steps = [x for x in steps if x is not None]
            print(f"  replica {i} rss gained across each flood under load: {steps} KiB")
    for i, values in enumerate(probe_rss):
        gains = [b - a for a, b in zip(values[1:], values[2:])]
        per_reset = sum(gains) * 1024 / (len(gains) * probe_resets)
        print(f"  replica {i} rss after each of {len(values)} floods of {probe_resets} resets, "
              f"load stopped: {values} KiB; the last {len(gains)} added {gains} KiB "
              f"({per_reset:.1f} B a reset connection)")
        if per_reset > LEAK_BOUND:
            failures.append(f"replica {i} kept {per_reset:.0f} B of RSS a reset connection "
                            f"(more than {LEAK_BOUND}): {gains} KiB")
    if post:
        for i in (0, 1):
            sizes = [s[3 + i] for s in samples if s[3 + i]]
            half = [s[3 + i] for s in post[len(post) // 2:] if s[3 + i]]
            print(f"  replica {i} /metrics: {min(sizes)}-{max(sizes)} B over the run, "
                  f"{min(half)}-{max(half)} B in the last half after warm-up")
            if max(sizes) > 64 * 1024:
                failures.append(f"replica {i} /metrics grew past 64 KiB: {sizes}")
            named = sorted(tenant_labels[i] - {"A", "B", "other", "unknown"})
            print(f"  replica {i} /metrics tenant labels besides A, B, other and unknown: {named} "
                  f"(the floods' template tenants: {sorted(flooders)})")
            if not set(named) <= flooders:
                failures.append(f"replica {i} /metrics named quiet tenants: "
                                f"{sorted(set(named) - flooders)}")
    abandoned = sum(metric(t, "fairshare_abandoned_decisions_total") for t in final_metrics)
    print(f"  decisions given back after their client left (abandoned, both replicas): "
          f"{abandoned:.0f}")

    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nevery check held")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
