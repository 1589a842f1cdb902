"""Emulated slow links between ranks: one network namespace per rank, joined by a bridge in a
hub namespace, each rank's link shaped with tc in both directions (rate with tbf; delay with netem
where the kernel has it). Ranks start inside their namespace under torch.distributed (env://) or
Horovod (Gloo controller, with a rendezvous server inside rank 0's namespace, as horovodrun would
start one). Addresses live only in the namespaces created here (10.77.0.0/24); every run is bounded
in time; everything is removed on exit, on failure and on Ctrl-C.

    with NetEm(nranks=2, rate="1gbit") as net:
        codes = net.run("torch", ["python", "-m", "osp.train", ...], timeout=600)

A link whose rate changes while training runs: ``NetEm(2, rate="2gbit", switch=(["2gbit", "250mbit"], 1.0))``
changes every shaped link's tbf rate to the next in the list every second, for as long as it is open.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

IFACE = "osp0"  # the same name inside every rank namespace
SUBNET = "10.77.0"


def _sh(args: Sequence[str], check=True):
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"netem: `{' '.join(args)}` failed: {p.stderr.strip()}")
    return p


def parse_rate(rate: str) -> int:
    """'100mbit' -> 100_000_000 (bits/s)."""
    r = rate.strip().lower()
    for suffix, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if r.endswith(suffix):
            return int(float(r[: -len(suffix)]) * mult)
    raise ValueError(f"netem: rate must look like '100mbit' or '1gbit', got {rate!r}")


def wait_all(procs: Sequence[subprocess.Popen], timeout: float):
    """Wait for every process (each the leader of its own session: ``start_new_session=True``), at most
    ``timeout`` s in all; at the limit, kill the process group of every one still running. Returns the exit
    codes (-9 for those killed) and whether the limit was reached (a rank that SIGKILLs itself also exits -9)."""
    deadline = time.monotonic() + timeout
    codes: List[int] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            return codes + [q.wait() for q in procs[len(codes):]], True
    return codes, False


class NetEm:
    def __init__(self, nranks: int, rate: Optional[str] = None, delay_ms: float = 0.0, tag: Optional[str] = None,
                 switch: Optional[tuple] = None):
        if nranks < 1:
            raise ValueError(f"netem: nranks must be >= 1, got {nranks}")
        if switch is not None:
            rates, period = switch
            if not rates or not rate or delay_ms or not period > 0:
                raise ValueError(f"netem: switch needs a rate, no delay, a list of rates and a period > 0, "
                                 f"got rate={rate!r} delay_ms={delay_ms} switch={switch!r}")
            for r in rates:
                parse_rate(r)
        self.switch = switch
        self.switched: List[tuple] = []  # with switch: (time.time(), rate) of each change, the first rate first
        self._links: List[tuple] = []
        self._stop = threading.Event()
        self._switcher: Optional[threading.Thread] = None
        self.n, self.rate, self.delay_ms = nranks, rate, float(delay_ms)
        self.tag = tag or f"{os.getpid() % 10000}"
        self.hub = f"osph{self.tag}"
        self.ns = [f"ospr{self.tag}x{i}" for i in range(nranks)]
        self._old_handlers = {}
        self._procs: List[subprocess.Popen] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self):
        if os.geteuid() != 0:
            raise PermissionError("netem: needs root (network namespaces, veth, tc); run as root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"netem: `{tool}` not found; install iproute2 (apt-get install iproute2)")
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _on_signal(self, signum, frame):
        self.close()
        raise KeyboardInterrupt(f"netem: signal {signum}")

    def _switch_loop(self):
        rates, period = self.switch
        i = 0
        self.switched.append((time.time(), rates[0]))
        while not self._stop.wait(period):
            i += 1
            rate = rates[i % len(rates)]
            burst = max(256 * 1024, parse_rate(rate) // 8 // 100)
            for where, dev in self._links:
                _sh(["tc", "-n", where, "qdisc", "change", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "100ms"], check=False)
            self.switched.append((time.time(), rate))  # (wall time, rate): when each rate took over

    def close(self):
        self._stop.set()
        if self._switcher is not None:
            self._switcher.join(timeout=60)
            self._switcher = None
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self._procs = []
        for ns in self.ns + [self.hub]:
            _sh(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        self._old_handlers = {}

    def _setup(self):
        _sh(["ip", "netns", "add", self.hub])
        _sh(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.ns):
            a, b = f"o{self.tag}a{i}", f"o{self.tag}b{i}"
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            _sh(["ip", "link", "set", a, "netns", ns])
            _sh(["ip", "link", "set", b, "netns", self.hub])
            _sh(["ip", "-n", ns, "link", "set", a, "name", IFACE])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFACE])
            _sh(["ip", "-n", ns, "link", "set", IFACE, "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: the machine's name then
            # resolves to the rank's address (Horovod's process-set Gloo contexts bind to it)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as fh:
                fh.write(f"127.0.0.1 localhost\n{self.addr(i)} {socket.gethostname()}\n")
            _sh(["ip", "-n", self.hub, "link", "set", b, "master", "br0"])
            _sh(["ip", "-n", self.hub, "link", "set", b, "up"])
            for where, dev in ((ns, IFACE), (self.hub, b)):
                # both directions of the rank's link: its egress, and the hub's egress to it
                self._shape(where, dev)
        # connectivity check, bounded
        for i in range(1, self.n):
            _sh(["ip", "netns", "exec", self.ns[i], "ping", "-c", "1", "-W", "2", self.addr(0)], check=False)
        if self.switch is not None:
            self._switcher = threading.Thread(target=self._switch_loop, name="netem-switch", daemon=True)
            self._switcher.start()

    def _shape(self, where: str, dev: str) -> None:
        if self.delay_ms:
            q = ["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "netem", "limit", "100000", "delay",
                 f"{self.delay_ms / 2:g}ms"] + (["rate", self.rate] if self.rate else [])
            p = _sh(q, check=False)
            if p.returncode != 0:
                raise RuntimeError(f"netem: delay needs the sch_netem qdisc, which this kernel lacks "
                                   f"({p.stderr.strip()}); shape the rate alone (delay_ms=0)")
        elif self.rate:
            # token bucket: a burst of at least 10 ms of traffic and one 64 KiB GSO segment
            burst = max(256 * 1024, parse_rate(self.rate) // 8 // 100)
            _sh(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                 "burst", str(burst), "latency", "100ms"])
            self._links.append((where, dev))

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # -- running ranks --------------------------------------------------------------------------
    def _env(self, backend: str, i: int, port: int, extra: Dict[str, str]) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(extra)
        env.setdefault("OMP_NUM_THREADS", "1")
        if backend == "torch":
            env.update(RANK=str(i), WORLD_SIZE=str(self.n), LOCAL_RANK="0", MASTER_ADDR=self.addr(0),
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=IFACE)
        else:
            env.update(HOROVOD_GLOO_RENDEZVOUS_ADDR=self.addr(0), HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                       HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE=IFACE,
                       HOROVOD_HOSTNAME=self.addr(i), HOROVOD_RANK=str(i), HOROVOD_SIZE=str(self.n),
                       HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1", HOROVOD_CROSS_RANK=str(i),
                       HOROVOD_CROSS_SIZE=str(self.n), GLOO_SOCKET_IFNAME=IFACE)
        return env

    def _start(self, i: int, argv: Sequence[str], env, stdout, stderr) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[i], *argv], env=env, stdout=stdout,
                             stderr=stderr, start_new_session=True)
        self._procs.append(p)
        return p

    def run(self, backend: str, argv: Sequence[str], timeout: float = 600, env: Optional[dict] = None,
            log_prefix: Optional[str] = None) -> List[int]:
        """Start ``argv`` on every rank (``backend``: "torch" or "horovod"); wait at most
        ``timeout`` s. Returns the exit codes (-9 for ranks killed at the time limit)."""
        if backend not in ("torch", "horovod"):
            raise ValueError(f"netem: backend must be 'torch' or 'horovod', got {backend!r}")
        port, rdzv = 29400 + (os.getpid() % 500), None
        if backend == "horovod":
            rdzv = self._start(0, [sys.executable, "-m", "bench.netem.rendezvous", str(port),
                                   ",".join(f"{self.addr(i)}:1" for i in range(self.n))],
                               dict(os.environ), subprocess.DEVNULL, subprocess.PIPE)
            time.sleep(1.0)
            if rdzv.poll() is not None:
                raise RuntimeError(f"netem: Horovod rendezvous failed: {rdzv.stderr.read()}")
        procs, files = [], []
        try:
            for i in range(self.n):
                out = open(f"{log_prefix}.rank{i}.log", "w") if log_prefix else subprocess.DEVNULL
                files.append(out)
                procs.append(self._start(i, argv, self._env(backend, i, port, env or {}), out,
                                         subprocess.STDOUT if log_prefix else subprocess.DEVNULL))
            return wait_all(procs, timeout)[0]
        finally:
            for p in procs + ([rdzv] if rdzv else []):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for f in files:
                if f is not subprocess.DEVNULL:
                    f.close()
