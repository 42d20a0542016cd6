"""Several hosts on one machine: Linux network namespaces joined by a bridge.

A cluster is hosts that share nothing but a network. Here each simulated host is a
network namespace with one card, `eth0` (one end of a veth pair; the other end is on
a bridge, the cluster's switch), an address in 198.18.0.0/24 (set aside for network
tests, RFC 2544) and no other route; `tests/harness/netns_ssh` enters it with its own hostname
and IPC namespace. One more namespace, the head node, runs `mpiexec`, which starts
one proxy on each host through `tests/harness/netns_ssh` instead of ssh:

    head 198.18.0.1 --+
    a    198.18.0.2 --+-- bridge      (nothing reaches this machine's own network)
    b    198.18.0.3 --+

Everything is named after the creating process (`mpx<pid>...`), so runs side by side
do not meet, and removed by `SimulatedHosts.__exit__` even when a test fails or the run
is stopped with SIGTERM; what a killed run left behind is removed by the next one.
Needs root and iproute2 (`ip`) and util-linux (`unshare`). By hand, as root:

    python -m tests.harness.netns            # build a, b; print the mpiexec line; Enter removes
    them
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tests" / "harness" / "netns_ssh"
SUBNET = "198.18.0"          # .1 the head node, .2, .3, ... the hosts
PREFIX = "mpx"               # + pid: interface names must stay under 16 characters


def run_ip(*args: str) -> str:
    """`ip ARGS`, its output; raise with ip's own message if it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def why_not() -> str | None:
    """The one reason this machine cannot build simulated hosts, or None if it can."""
    if sys.platform != "linux":
        return "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth pairs, a bridge)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"simulated hosts need `{tool}` (apt-get install {package})"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        run_ip("netns", "add", probe)
    except RuntimeError as err:
        return f"this machine refuses network namespaces: {err}"
    run_ip("netns", "del", probe)
    return None


@dataclass
class SimulatedHosts:
    """`count` hosts and a head node on one bridge, for as long as the `with` lasts.

    `hosts[i]` is host i's address (what `mpiexec -hosts` takes), `names[i]` its
    hostname (a, b, ...), `veths[i]` the bridge end of its card: the bytes counted
    there are exactly what the host sent and received over the network.
    """

    count: int = 2
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: list[str] = field(init=False, default_factory=list)
    names: list[str] = field(init=False, default_factory=list)
    veths: list[str] = field(init=False, default_factory=list)

    def netns(self, i: int) -> str:
        """Host i's network namespace; -1 is the head node's."""
        return f"{self.tag}-{'head' if i < 0 else self.names[i]}"

    def __enter__(self) -> SimulatedHosts:
        remove_leftovers()
        self._previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM,
                                                                     signal.SIGHUP)}
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build(self) -> None:
        self.names = [chr(ord("a") + i) for i in range(self.count)]
        self.hosts = [f"{SUBNET}.{i + 2}" for i in range(self.count)]
        self.veths = [f"{self.tag}{name}" for name in self.names]
        bridge = f"{self.tag}br"
        run_ip("link", "add", bridge, "type", "bridge")
        run_ip("link", "set", bridge, "up")
        for i, (name, address) in enumerate([("head", f"{SUBNET}.1"),
                                              *zip(self.names, self.hosts)]):
            netns, veth = self.netns(i - 1), f"{self.tag}{name}"
            run_ip("netns", "add", netns)
            run_ip("link", "add", veth, "type", "veth", "peer", "name", "eth0",
                   "netns", netns)
            run_ip("link", "set", veth, "master", bridge, "up")
            run_ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            run_ip("-n", netns, "link", "set", "eth0", "up")
            run_ip("-n", netns, "link", "set", "lo", "up")

    def __exit__(self, *exc: object) -> None:
        """Stop whatever still runs on the hosts, then remove namespaces and links."""
        try:
            kill_everything_in(self.tag)
            remove(self.tag)
        finally:
            for sig, handler in getattr(self, "_previous", {}).items():
                signal.signal(sig, handler)

    def environment(self) -> dict[str, str]:
        """What `tests/harness/netns_ssh` needs to find each host (see its header)."""
        return {"MINIPAR_NETNS_HOSTS": " ".join(
            f"{address}={self.netns(i)}={self.names[i]}"
            for i, address in enumerate(self.hosts))}

    def mpiexec(self, launcher: str, slots: list[int] | None = None) -> list[str]:
        """The command that starts `mpiexec` on the head node, hosts taken in order:
        `slots=None` is `-hosts a,b` (one rank per host in turn: round-robin),
        `slots=[4, 4]` is `-hosts a:4,b:4` (ranks 0-3 on a, 4-7 on b)."""
        hosts = ",".join(address if slots is None else f"{address}:{n}"
                         for address, n in zip(self.hosts, slots or self.hosts))
        return ["ip", "netns", "exec", self.netns(-1), "unshare", "--uts", "sh", "-c",
                'hostname head && exec "$@"', "sh", launcher,
                "-iface", "eth0",                      # proxies call back on head's eth0
                "-launcher", "ssh", "-launcher-exec", str(LAUNCHER), "-hosts", hosts]

    def processes(self) -> list[int]:
        """The pids still running in any of the namespaces."""
        return pids_in(self.tag)

    def bytes_on_the_wire(self) -> list[int]:
        """Per host: bytes its card has sent plus received since it was made."""
        stats = Path("/sys/class/net")
        return [sum(int((stats / veth / "statistics" / f"{way}_bytes").read_text())
                    for way in ("rx", "tx")) for veth in self.veths]


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}: removing the simulated hosts")


def our_namespaces(tag: str) -> list[str]:
    """Network namespaces whose name starts with `tag-`."""
    return [line.split()[0] for line in run_ip("netns", "list").splitlines()
            if line.startswith(f"{tag}-")]


def pids_in(tag: str) -> list[int]:
    """The processes living in the namespaces of `tag`."""
    return [int(pid) for netns in our_namespaces(tag)
            for pid in run_ip("netns", "pids", netns).split()]


def kill_everything_in(tag: str) -> None:
    """SIGKILL every process in the namespaces of `tag` and wait (5 s at most) until
    they are gone."""
    deadline = time.monotonic() + 5
    while (pids := pids_in(tag)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def remove(tag: str) -> None:
    """Delete the namespaces of `tag` (their eth0 ends go with them, and so the veth
    pairs) and its bridge; wait (5 s at most) until the kernel has let them all go."""
    for netns in our_namespaces(tag):
        run_ip("netns", "del", netns)
    deadline = time.monotonic() + 5
    while (links := our_links(tag)) and time.monotonic() < deadline:
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)  # may be gone
        time.sleep(0.1)


def our_links(tag: str) -> list[str]:
    """Network interfaces of this machine named `tag` + a letter (veth ends, the bridge)."""
    names = [line.split(":")[1].strip().split("@")[0]
             for line in run_ip("-o", "link", "show").splitlines()]
    return [name for name in names if re.fullmatch(rf"{tag}[a-z].*", name)]


def remove_leftovers() -> None:
    """Remove what a run killed outright (SIGKILL: no cleanup) left behind: namespaces,
    links and processes named after a process that no longer exists. Live runs are left
    alone."""
    names = [line.split()[0] for line in run_ip("netns", "list").splitlines()]
    names += our_links(PREFIX + r"\d+")
    for pid in {int(m.group(1)) for name in names if (m := re.match(rf"{PREFIX}(\d+)\D",
                                                                    name))}:
        if not Path(f"/proc/{pid}").exists():
            kill_everything_in(f"{PREFIX}{pid}")
            remove(f"{PREFIX}{pid}")


if __name__ == "__main__":
    reason = why_not()
    if reason:
        sys.exit(f"tests.harness.netns: {reason}")
    with SimulatedHosts() as cluster:
        hosts = cluster.environment()["MINIPAR_NETNS_HOSTS"]
        line = cluster.mpiexec(str(Path(sys.executable).parent / "mpiexec"), [4, 4])
        print(f"export UCX_NET_DEVICES=eth0 MINIPAR_NETNS_HOSTS={shlex.quote(hosts)}")
        print(shlex.join([*line, "-n", "8", sys.executable, "-m", "minipar", "train",
                          "--dp", "2", "--tp", "2", "--pp", "2", "--check"]))
        input("Enter removes the hosts ")
