"""Two emulated hosts on a shaped link, for tests and benchmarks: a thin driver of ``scripts/two_hosts.sh``.

Network namespaces h1 and h2 joined by a veth pair (``eth1``), shaped with ``tc tbf``; MPI jobs are launched
across them with hydra's rsh launcher and forced onto TCP, so inter-node traffic really crosses the wire and
shows in the veth byte counters. Needs root and iproute2::

    hosts = TwoHosts()
    ok, reason = hosts.available()
    with hosts.running("100mbit"):
        before = hosts.counters()
        subprocess.run(hosts.mpiexec(4, ppn=2) + [sys.executable, "-m", "hpctrain.cli", "info"], timeout=120)
        sent = hosts.counters()["h1"]["tx_bytes"] - before["h1"]["tx_bytes"]
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from hpctrain.runtime import env

SCRIPT = Path(__file__).resolve().parent / "two_hosts.sh"  # package data (scripts/two_hosts.sh links here)
HOSTS = ("h1", "h2")


class TwoHostsError(RuntimeError):
    pass


class TwoHosts:
    """Handle on the two emulated hosts; ``with TwoHosts(rate):`` brings them up and always tears them down."""

    def __init__(self, rate: str = "1gbit", directory: str | os.PathLike | None = None, timeout: float = 60):
        self.rate = rate
        self.dir = Path(directory or env.ns_dir())
        self.timeout = timeout

    # -- probing -------------------------------------------------------------------------------------------
    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether the hosts can be built here: root, ``ip`` and ``tc`` present, a netns can be created."""
        if not SCRIPT.is_file():
            return False, f"{SCRIPT} not found (a broken hpctrain install: reinstall it)"
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            return False, "two emulated hosts need root (network namespaces, veth, tc)"
        for tool in ("ip", "tc", "unshare"):
            if shutil.which(tool) is None:
                return False, f"`{tool}` not found (install iproute2 and util-linux)"
        probe = f"hpctrain-probe-{os.getpid()}"
        try:
            made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"cannot run `ip netns add`: {exc}"
        if made.returncode != 0:
            return False, f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
        return True, ""

    # -- lifecycle -----------------------------------------------------------------------------------------
    def _run(self, *args: str) -> str:
        child = env.child_environ({"HPCTRAIN_NS_DIR": str(self.dir)})
        try:
            proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=child,
                                  timeout=self.timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise TwoHostsError(f"two_hosts.sh {' '.join(args)} timed out after {self.timeout} s") from exc
        if proc.returncode != 0:
            raise TwoHostsError(f"two_hosts.sh {' '.join(args)} failed ({proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()}")
        return proc.stdout

    def up(self, rate: str | None = None) -> "TwoHosts":
        """Build (or keep, if healthy) h1 and h2 and shape the wire to ``rate`` ("none" = unshaped)."""
        if rate is not None:
            self.rate = rate
        self._run("up", self.rate)
        return self

    def down(self) -> None:
        """Kill what still runs in h1/h2 and delete them (no error if they are not there)."""
        self._run("down")

    def set_rate(self, rate: str) -> None:
        """Reshape the running wire, e.g. "10gbit", "100mbit", or "none"."""
        self._run("rate", rate)
        self.rate = rate

    def counters(self) -> dict[str, dict[str, int]]:
        """``{"h1": {"tx_bytes": .., "rx_bytes": ..}, "h2": {...}}`` of each host's eth1."""
        return json.loads(self._run("counters"))

    @staticmethod
    def delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
        """Byte counts between two ``counters()`` readings."""
        return {h: {k: after[h][k] - before[h][k] for k in before[h]} for h in before}

    def mpiexec(self, n: int, ppn: int | None = None) -> list[str]:
        """Command prefix for ``n`` ranks, ``ppn`` per host in blocks (default: half each, h1 first)."""
        cmd = [str(self.dir / "mpiexec-2hosts"), "-n", str(n)]
        return cmd + (["-ppn", str(ppn)] if ppn else [])

    @contextlib.contextmanager
    def running(self, rate: str | None = None):
        """Hosts up for the ``with`` block, torn down after it even if it raised."""
        try:
            yield self.up(rate)
        finally:
            self.down()

    def __enter__(self) -> "TwoHosts":
        try:
            return self.up()
        except BaseException:
            with contextlib.suppress(TwoHostsError):
                self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
