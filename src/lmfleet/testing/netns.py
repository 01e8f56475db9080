"""A private multi-host network on one machine: network namespaces joined by a bridge.

Layout (prefix ``P`` is unique per test run)::

    P-sw  (namespace holding only the bridge)  br0 ──┬── veth ── P-head  eth0 10.77.0.1/24
                                                     ├── veth ── P-w1    eth0 10.77.0.2/24
                                                     └── veth ── P-w2    eth0 10.77.0.3/24

The bridge lives in its own namespace, so nothing is added to the machine's own network: traffic stays
between namespaces this lab created. Processes run through ``ip netns exec``; a host is "killed" by
SIGKILL to every process in its namespace (``ip netns pids``), which is how a machine dies from its
peers' point of view (sockets reset). :meth:`NetnsLab.close` kills every process and deletes every
namespace; it runs from the fixture finalizer and, as a last resort, from ``atexit``.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SUBNET = "10.77.0"
PREFIX_ROOT = "lmfe2e"


def can_run() -> str | None:
    """None when the lab can be built here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs the `ip` tool (iproute2)"
    probe = f"{PREFIX_ROOT}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def ns_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def sweep_stale() -> None:
    """Delete namespaces left by earlier runs of this lab whose test process is gone."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX_ROOT) or "-" not in name:
            continue
        owner = name[len(PREFIX_ROOT):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            for pid in ns_pids(name):
                _kill(pid)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


_CLONE_NEWNET = 0x40000000


def enter_netns(ns: str) -> None:
    """Move the *calling thread* into namespace ``ns`` (sockets it opens live there)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
    finally:
        os.close(fd)


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Host:
    name: str
    ns: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class NetnsLab:
    """Namespaces, a bridge, and the processes started in them; all removed by :meth:`close`."""

    def __init__(self, workdir: Path) -> None:
        self.prefix = f"{PREFIX_ROOT}{os.getpid()}"
        self.workdir = workdir
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self._closed = False
        self._n = 0
        atexit.register(self.close)
        sweep_stale()
        subprocess.run(["ip", "netns", "add", self.switch], check=True)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        _ip("link", "set", "lo", "up", ns=self.switch)

    def add_host(self, name: str) -> Host:
        """A new namespace with its own address on the bridge (10.77.0.N)."""
        self._n += 1
        ns = f"{self.prefix}-{name}"
        address = f"{SUBNET}.{self._n}"
        outer, inner = f"lv{os.getpid() % 100000}{self._n}", "eth0"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns, ns=self.switch)
        _ip("link", "set", outer, "master", "br0", ns=self.switch)
        _ip("link", "set", outer, "up", ns=self.switch)
        _ip("addr", "add", f"{address}/24", "dev", inner, ns=ns)
        _ip("link", "set", inner, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        host = Host(name, ns, address)
        self.hosts[name] = host
        return host

    def popen(self, host: Host, argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; output goes to ``workdir/log_name``."""
        log = open(self.workdir / log_name, "ab")
        p = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, *argv],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        host.procs.append(p)
        return p

    def run(self, host: Host, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.ns, *argv], env=env, capture_output=True, text=True,
                              timeout=timeout)

    def executor(self, host: Host, workers: int) -> ThreadPoolExecutor:
        """Threads that live in ``host``'s network (the test process itself stays where it is)."""
        return ThreadPoolExecutor(workers, thread_name_prefix=f"ns-{host.name}", initializer=enter_netns,
                                  initargs=(host.ns,))

    def cpu_snapshot(self, host: Host, match: str | None = None) -> dict[tuple[int, float], float]:
        """CPU seconds (user + system) per process now in ``host``'s namespace, keyed by (pid, start time);
        ``match``: only the processes whose command line contains it (e.g. ``EngineCore``, vLLM's engines)."""
        out = {}
        for pid in ns_pids(host.ns):
            try:
                p = psutil.Process(pid)
                if match is not None and match not in " ".join(p.cmdline()):
                    continue
                t = p.cpu_times()
                out[(pid, p.create_time())] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def cpu_since(self, host: Host, before: dict[tuple[int, float], float], match: str | None = None) -> float:
        """CPU seconds ``host``'s processes (those ``match`` selects) used since ``before`` (processes that exited
        meanwhile not counted)."""
        return sum(v - before.get(k, 0.0) for k, v in self.cpu_snapshot(host, match).items())

    def kill_host(self, host: Host) -> None:
        """SIGKILL everything in the host's namespace (the machine 'dies'); its namespace stays."""
        for _ in range(20):
            pids = ns_pids(host.ns)
            if not pids:
                break
            for pid in pids:
                _kill(pid)
            time.sleep(0.2)
        for p in host.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill(p.pid)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            for p in host.procs:  # gentle first: lets Ray flush logs
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
        time.sleep(1.0)
        for host in self.hosts.values():
            self.kill_host(host)
            subprocess.run(["ip", "netns", "delete", host.ns], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.switch], capture_output=True)
