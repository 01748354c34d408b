"""A shaped link on one machine: a prefill server in its own network namespace behind a veth pair.

    root namespace  hkv<tag>a  10.211.<n>.1/24  <--veth-->  hkv<tag>b  10.211.<n>.2/24  netns hackpd-<tag>
Both ends get a tc token-bucket filter (tbf) at the given rate, so every byte between prefill
and decode (KV pages, bootstrap, metadata) crosses a link of that speed in both directions.
A cluster with several prefill servers gets one link each; the namespace's default route goes
through its own link, so a prefill reaches decode servers bound to another link's root address
over its own shaped veth.
Needs root (CAP_NET_ADMIN). Only addresses inside 10.211.0.0/16 on links this module creates
are used. `netem` is not assumed to exist (delay/loss emulation is not offered).
Name lookups inside the namespace fail at once instead of waiting on a DNS server the link
cannot reach (`/etc/netns/<namespace>/resolv.conf`, which `ip netns exec` mounts over
/etc/resolv.conf): torch's process-group store looks up its peer's name, and that lookup timed
out after 10 s in every prefill server's startup.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

NS_PREFIX = "hackpd-"
VETH_PREFIX = "hkv"
SUBNET = "10.211"
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts the files of NETNS_ETC/NS over /etc
# No DNS server is reachable through the link; a resolver on the namespace's own loopback, where
# nothing listens, answers "refused" at once (/etc/hosts still applies).
RESOLV_CONF = "# written by disagg.netns: name lookups inside a shaped link's namespace fail at once\n" \
              "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


class LinkError(RuntimeError):
    """The link could not be created (not root, missing `ip`/`tc`, ...)."""


@dataclass(frozen=True)
class ShapedLink:
    tag: str
    subnet_index: int
    mbps: float

    @property
    def namespace(self) -> str:
        return f"{NS_PREFIX}{self.tag}"

    @property
    def veth_root(self) -> str:
        return f"{VETH_PREFIX}{self.tag}a"

    @property
    def veth_ns(self) -> str:
        return f"{VETH_PREFIX}{self.tag}b"

    @property
    def root_ip(self) -> str:
        return f"{SUBNET}.{self.subnet_index}.1"

    @property
    def ns_ip(self) -> str:
        return f"{SUBNET}.{self.subnet_index}.2"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_state(record: dict) -> "ShapedLink":
        """The link a cluster state records (to_dict's fields, plus derived names it ignores)."""
        return ShapedLink(tag=record["tag"], subnet_index=int(record["subnet_index"]), mbps=float(record["mbps"]))


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise LinkError(f"{cmd[0]} is not installed (apt-get install iproute2)") from exc
    if check and proc.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def can_shape() -> tuple[bool, str]:
    """(True, "") when this process may create namespaces and qdiscs, else (False, why)."""
    if os.geteuid() != 0:
        return False, "shaping the link needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return False, f"`{tool}` is missing (apt-get install iproute2)"
    return True, ""


def list_namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NS_PREFIX)]


def age_s(namespace: str) -> float | None:
    """Seconds since `namespace` was created (its bind mount under /run/netns), None if unknown."""
    try:
        return max(0.0, time.time() - os.stat(f"/run/netns/{namespace}").st_mtime)
    except OSError:
        return None


def in_use(namespace: str) -> bool:
    """True when some process runs inside the namespace (another cluster's servers)."""
    out = _run("ip", "netns", "pids", namespace, check=False).stdout
    return bool(out.strip())


def list_veths() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = re.findall(r"^\d+:\s+([^:@\s]+)", out, flags=re.M)
    return [n for n in names if re.fullmatch(rf"{VETH_PREFIX}[0-9a-z]+a", n)]


def _used_subnets() -> set[int]:
    out = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    return {int(m) for m in re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", out)}


def tbf_args(mbps: float) -> list[str]:
    # burst must cover one timer tick at the rate (>= rate/HZ); 32 KB minimum as observed to work.
    burst_bytes = max(32 * 1024, int(mbps * 1e6 / 8 / 250))
    return ["tbf", "rate", f"{mbps:g}mbit", "burst", str(burst_bytes), "latency", "100ms"]


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    # Two clusters starting at once must not pick the same 10.211.x.0/24.
    with open("/run/lock/sglang-hack-netns.lock" if os.path.isdir("/run/lock")
              else "/tmp/sglang-hack-netns.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def create(tag: str, mbps: float) -> ShapedLink:
    """Create the namespace, veth pair, addresses and tbf on both ends."""
    ok, why = can_shape()
    if not ok:
        raise LinkError(why)
    if not mbps > 0:
        raise LinkError(f"link rate must be positive, got {mbps}")
    with _subnet_lock():
        return _create_locked(tag, mbps)


def _create_locked(tag: str, mbps: float) -> ShapedLink:
    used = _used_subnets()
    index = next((i for i in range(10, 250) if i not in used), None)
    if index is None:
        raise LinkError(f"no free {SUBNET}.x.0/24 subnet")
    link = ShapedLink(tag=tag, subnet_index=index, mbps=float(mbps))
    try:
        _run("ip", "netns", "add", link.namespace)
        (NETNS_ETC / link.namespace).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / link.namespace / "resolv.conf").write_text(RESOLV_CONF)
        _run("ip", "link", "add", link.veth_root, "type", "veth", "peer", "name", link.veth_ns)
        _run("ip", "link", "set", link.veth_ns, "netns", link.namespace)
        _run("ip", "addr", "add", f"{link.root_ip}/24", "dev", link.veth_root)
        _run("ip", "link", "set", link.veth_root, "up")
        nsx = ("ip", "netns", "exec", link.namespace)
        _run(*nsx, "ip", "addr", "add", f"{link.ns_ip}/24", "dev", link.veth_ns)
        _run(*nsx, "ip", "link", "set", link.veth_ns, "up")
        _run(*nsx, "ip", "link", "set", "lo", "up")
        # Everything else (the decode servers, which listen on another link's root address when
        # there are several prefills) is reached through this link's root end.
        _run(*nsx, "ip", "route", "add", "default", "via", link.root_ip)
        _run("tc", "qdisc", "add", "dev", link.veth_root, "root", *tbf_args(mbps))
        _run(*nsx, "tc", "qdisc", "add", "dev", link.veth_ns, "root", *tbf_args(mbps))
    except LinkError:
        remove(link.namespace, link.veth_root)
        raise
    return link


def remove(namespace: str | None, veth_root: str | None) -> list[str]:
    """Delete a namespace and the root end of its veth (the peer goes with it). Idempotent;
    returns what was removed."""
    removed = []
    if veth_root and veth_root in list_veths():
        _run("ip", "link", "del", veth_root, check=False)
        removed.append(veth_root)
    if namespace and namespace in list_namespaces():
        _run("ip", "netns", "del", namespace, check=False)
        removed.append(namespace)
    if namespace and namespace.startswith(NS_PREFIX):
        shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
    return removed


def veth_bytes(link: ShapedLink) -> dict:
    """tx/rx byte counters of the root end (rx = bytes sent by prefill)."""
    base = f"/sys/class/net/{link.veth_root}/statistics"
    with open(f"{base}/rx_bytes") as f:
        rx = int(f.read())
    with open(f"{base}/tx_bytes") as f:
        tx = int(f.read())
    return {"rx": rx, "tx": tx}


def default_route_device() -> str:
    """The interface of this network namespace's default route (a container's eth0)."""
    out = _run("ip", "-o", "route", "show", "default", check=False).stdout
    m = re.search(r"\bdev\s+(\S+)", out)
    if not m:
        raise LinkError("no default route here: name the interface to shape")
    return m.group(1)


def shape_egress(mbps: float, dev: str | None = None) -> str:
    """Limit what leaves this namespace through `dev` (default: the default route's) to `mbps`,
    with the same tbf as a `hack up` link: in a compose stack the prefill container shapes its
    own interface, so the KV it sends crosses a link of that rate. Needs CAP_NET_ADMIN.
    Returns the interface shaped."""
    if not mbps > 0:
        raise LinkError(f"link rate must be positive, got {mbps}")
    dev = dev or default_route_device()
    proc = _run("tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(mbps), check=False)
    if proc.returncode != 0:
        raise LinkError(f"could not shape {dev} to {mbps:g} Mbit/s (needs CAP_NET_ADMIN): "
                        f"{(proc.stderr or proc.stdout).strip()}")
    return dev


def main(argv: list[str] | None = None) -> int:
    """`python -m disagg.netns shape-egress MBPS [--dev IF]` (the CPU image's entry point)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m disagg.netns")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shape-egress", help="limit this namespace's outgoing traffic to MBPS")
    s.add_argument("mbps", type=float)
    s.add_argument("--dev", default=None, help="interface (default: the default route's)")
    args = p.parse_args(argv)
    try:
        dev = shape_egress(args.mbps, args.dev)
    except LinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{dev}: egress limited to {args.mbps:g} Mbit/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
