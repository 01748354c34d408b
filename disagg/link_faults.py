"""Faults on a prefill's shaped link (`hack up --link-mbps`): packet loss and a partition.

Applied with nftables at the ingress of both ends of the link's veth pair (the prefill's end in
its namespace, the root end on the host), so both directions lose packets silently, as on a
real link, and a sender never sees a local error: everything the prefill sends or receives over
its link (KV transfers, the router's requests and health checks, the decode's bootstrap and
heartbeats) crosses the rule, nothing else on the host does. One table per end holds the link's
current fault; replacing or clearing it is one atomic nft transaction per end.

Delay, jitter and reordering are tc netem's, and this project's hosts run a kernel without the
netem qdisc (`tc qdisc add ... netem` answers "Specified qdisc kind is unknown"): those faults
are refused with that sentence instead of being faked. The other ways to hold packets back are
missing too (checked 2026-11-27 on kernel 6.18): the fq and etf qdiscs that would honour
per-packet departure times set by a BPF program are unknown as well, and nftables' `queue`
statement (packets handed to a userspace delayer) is not built ("No such file or directory").
"""
from __future__ import annotations

import re
import subprocess
from enum import Enum

from .netns import LinkError, ShapedLink


class LinkFault(str, Enum):
    LOSS = "loss"            # drop a share of packets at random, both directions
    PARTITION = "partition"  # drop every packet, both directions


def _table(link: dict) -> str:
    return f"hack_link_fault_{link['tag']}"


def _ends(link: dict) -> list[tuple[str | None, str]]:
    """(namespace or None for the root one, interface): each end drops what arrives on it, so a
    sender sees its packets leave (as on a real lossy or cut link), not a local EPERM."""
    shaped = ShapedLink.from_state(link)
    return [(shaped.namespace, shaped.veth_ns), (None, shaped.veth_root)]


def _nft(namespace: str | None, script: str) -> subprocess.CompletedProcess:
    cmd = ["nft", "-f", "-"] if namespace is None else ["ip", "netns", "exec", namespace, "nft", "-f", "-"]
    try:
        proc = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise LinkError(f"`{exc.filename}` is missing (apt-get install nftables iproute2)") from exc
    if proc.returncode != 0:
        raise LinkError(f"nft{' in ' + namespace if namespace else ''}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def rule_script(table: str, dev: str, kind: LinkFault, percent: float | None = None) -> str:
    """The nft transaction that makes `kind` the fault of what arrives on `dev` (replacing any
    earlier one): a netdev table on the interface's ingress."""
    if kind is LinkFault.LOSS:
        if percent is None or not 0.0 < percent < 100.0:
            raise LinkError(f"packet loss must be a percentage in (0, 100), got {percent}")
        # numgen draws per packet; per mille keeps 0.5% expressible. Each end drops its share of
        # what arrives, so a packet crossing once is lost with the given probability.
        match = f"numgen random mod 1000 < {int(round(percent * 10))} "
    else:
        match = ""
    return (f"add table netdev {table}\ndelete table netdev {table}\n"
            f"table netdev {table} {{\n"
            f"  chain in {{ type filter hook ingress device \"{dev}\" priority 0; policy accept; "
            f"{match}counter drop; }}\n"
            f"}}\n")


def apply(link: dict, kind: LinkFault, percent: float | None = None) -> None:
    """Make `kind` (LOSS with `percent`, or PARTITION) the fault of `link`, both directions, now."""
    for namespace, dev in _ends(link):
        _nft(namespace, rule_script(_table(link), dev, kind, percent))


def clear(link: dict) -> None:
    """Remove the link's fault (nothing to do if it has none)."""
    for namespace, _dev in _ends(link):
        _nft(namespace, f"add table netdev {_table(link)}\ndelete table netdev {_table(link)}\n")


def dropped_packets(link: dict) -> int:
    """Packets the link's current fault has dropped, both directions (0 when it has none)."""
    total = 0
    for namespace, _dev in _ends(link):
        cmd = ["nft", "list", "table", "netdev", _table(link)]
        if namespace is not None:
            cmd = ["ip", "netns", "exec", namespace, *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            total += sum(int(n) for n in re.findall(r"counter packets (\d+)", proc.stdout))
    return total


# Link faults that need tc netem (refused with a sentence; see the module's docstring).
NETEM_ONLY = ("delay", "jitter", "reorder")


def unsupported(name: str) -> LinkError:
    """The error for a link fault this host's kernel cannot make."""
    return LinkError(f"link fault {name!r} is not built: it needs tc netem, which the kernel of this project's "
                     f"hosts lacks (\"Specified qdisc kind is unknown\"); the link faults are: "
                     f"{', '.join(k.value for k in LinkFault)}")
