"""A bounded soak of a running PD cluster: mixed load, malformed requests, faults on schedule.

`run()` sends `requests` generation requests through the router at `concurrency` (short chat
prompts from ShareGPT and long essay documents, seeded), interleaves one malformed request
(disagg.malformed's catalogue) every `bad_every` requests, and fires each fault of the
schedule when the request at its position is dispatched:

  kill-prefill      SIGKILL the last prefill server's process group (needs >= 2 prefills)
  corrupt-transfer  damage the next KV transfer that lands on the first live decode server
                    (disagg.faults: the digest check must fail that request, nothing else)
  kill-decode       SIGKILL the last decode server (needs >= 2 decodes)
  partition:SECONDS every prefill's shaped link drops every packet, both ways, for SECONDS
                    (disagg.link_faults; needs --link-mbps)
  loss:PERCENT      every prefill's shaped link drops PERCENT of its packets at random, from
                    there to the end of the load (needs --link-mbps)

Every failure is classified: `in-flight-at-kill` (sent before a kill and still running at
it: the request may have been on the killed server; expected), `corrupted-transfer` (the one
request whose KV was damaged; expected), `during-partition` (in flight at some moment of a
partition and failed with an error within PARTITION_DEADLINE_S of the link's return; expected),
or `defect` (anything else, including every failure of a request sent after a server died: the
router must route around the dead; every failure under packet loss alone, which TCP absorbs;
and every request that hung until the client's timeout). A malformed
request must be answered 4xx (or what the router documentedly answers itself:
disagg.malformed.ROUTER_ANSWERS); a 5xx or a dropped connection is a defect too.

Around the load: per-server RSS (its whole process group) sampled once a second, HACK pool
usage of every live server before and after (back to idle: no request row held, used tokens
== what the radix cache keeps), KV-full retractions counted from the decode logs, and for each
kill how long until the router stopped routing to the dead server (the first request sent
after the kill that was served, and the router's own view when it lists its workers).
"""
from __future__ import annotations

import os
import random
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import requests

from engine import allocator
from engine.usage import is_idle

from . import procs
from . import link_faults
from .malformed import bad_requests, router_answer, send
from .replay import Result, generate


class FaultKind(str, Enum):
    KILL_PREFILL = "kill-prefill"
    CORRUPT_TRANSFER = "corrupt-transfer"
    KILL_DECODE = "kill-decode"
    PARTITION = "partition"
    LOSS = "loss"


LINK_FAULTS = (FaultKind.PARTITION, FaultKind.LOSS)
# A request in flight during a partition must end (served, or failed with an error) within this
# many seconds after the link is back: the decode's heartbeat declares a silent prefill dead in
# interval x failures (2 s x 3 in `hack up`), and the router's retries span ~23 s.
PARTITION_DEADLINE_S = 60.0


class FailureClass(str, Enum):
    IN_FLIGHT_AT_KILL = "in-flight-at-kill"
    CORRUPTED_TRANSFER = "corrupted-transfer"
    DURING_PARTITION = "during-partition"
    DEFECT = "defect"


@dataclass(frozen=True)
class FaultEvent:
    kind: FaultKind
    at: float  # a fraction of the requests (0 < at < 1): fired when that request is dispatched
    arg: float | None = None  # partition: seconds; loss: percent of packets

    @staticmethod
    def parse(text: str) -> "FaultEvent":
        """'kill-prefill@0.3' -> FaultEvent(KILL_PREFILL, 0.3); 'partition:5@0.3' -> a 5 s
        partition at 30% of the requests; 'loss:5@0.2' -> 5% packet loss from 20% on."""
        head, sep, at = text.strip().partition("@")
        if not sep:
            raise ValueError(f"fault {text!r}: expected KIND@FRACTION, e.g. kill-prefill@0.3 or partition:5@0.3")
        kind, colon, arg_text = head.partition(":")
        if kind in link_faults.NETEM_ONLY:
            raise ValueError(f"fault {text!r}: {link_faults.unsupported(kind)}")
        try:
            k = FaultKind(kind)
        except ValueError:
            raise ValueError(f"fault {text!r}: kind must be one of "
                             f"{', '.join(f.value for f in FaultKind)}") from None
        arg = None
        if k in LINK_FAULTS:
            what = "seconds" if k is FaultKind.PARTITION else "a percentage of packets"
            try:
                arg = float(arg_text) if colon else None
            except ValueError:
                arg = None
            ok = arg is not None and (arg > 0 if k is FaultKind.PARTITION else 0 < arg < 100)
            if not ok:
                raise ValueError(f"fault {text!r}: {k.value} takes {what} after a colon, e.g. "
                                 f"{k.value}:{5}@0.3")
        elif colon:
            raise ValueError(f"fault {text!r}: {k.value} takes no argument")
        try:
            frac = float(at)
        except ValueError:
            raise ValueError(f"fault {text!r}: {at!r} is not a number") from None
        if not 0.0 < frac < 1.0:
            raise ValueError(f"fault {text!r}: the position must be a fraction in (0, 1)")
        return FaultEvent(k, frac, arg)

    def label(self) -> str:
        arg = f":{self.arg:g}" if self.arg is not None else ""
        return f"{self.kind.value}{arg}@{self.at:g}"


DEFAULT_FAULTS = "kill-prefill@0.3,corrupt-transfer@0.5,kill-decode@0.7"


@dataclass
class SoakSpec:
    requests: int = 500
    concurrency: int = 16
    seed: int = 0
    long_fraction: float = 0.1  # share of long documents among the generation requests
    long_tokens: int = 2048
    chat_max_tokens: int = 16
    bad_every: int = 10  # one malformed request after every N generation requests (0: none)
    faults: list[FaultEvent] = field(default_factory=list)
    timeout_s: float = 600.0
    idle_timeout_s: float = 90.0

    def validate(self, prefills: int, decodes: int, shaped_link: bool = True) -> None:
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("--requests and --concurrency must be >= 1")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        kinds = [f.kind for f in self.faults]
        if kinds.count(FaultKind.KILL_PREFILL) > prefills - 1:
            raise ValueError(f"{kinds.count(FaultKind.KILL_PREFILL)} prefill kill(s) with {prefills} "
                             "prefill server(s): at least one must survive (start more with --prefill)")
        if kinds.count(FaultKind.KILL_DECODE) > decodes - 1:
            raise ValueError(f"{kinds.count(FaultKind.KILL_DECODE)} decode kill(s) with {decodes} "
                             "decode server(s): at least one must survive (start more with --decode)")
        if any(k in LINK_FAULTS for k in kinds) and not shaped_link:
            raise ValueError("link faults (partition, loss) act on each prefill's shaped link: start the "
                             "cluster with --link-mbps (as root)")
        if kinds.count(FaultKind.LOSS) > 1:
            raise ValueError("one loss fault per soak: it lasts from its position to the end of the load")


@dataclass
class Job:
    index: int
    kind: str  # "chat" | "doc" | "bad"
    input_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    bad: Any = None  # a malformed.BadRequest


def build_jobs(model_path: str, spec: SoakSpec) -> list[Job]:
    """The seeded request sequence: generation requests (chat or long document) with a
    malformed request after every `bad_every` of them."""
    from hack_eval.workloads import build, tokenizer

    tok = tokenizer(model_path)
    rng = random.Random(spec.seed)
    n_long = round(spec.requests * spec.long_fraction)
    chats = build("sharegpt", tok, max(1, spec.requests - n_long), None, seed=spec.seed) if n_long < spec.requests else []
    docs = build("longdoc-2k", tok, max(1, min(n_long, 8)), None, seed=spec.seed,
                 prompt_tokens=spec.long_tokens) if n_long else []
    kinds = ["doc"] * n_long + ["chat"] * (spec.requests - n_long)
    rng.shuffle(kinds)
    catalogue = bad_requests()
    jobs: list[Job] = []
    ci = di = bi = 0
    for kind in kinds:
        if kind == "doc":
            item = docs[di % len(docs)]
            di += 1
            jobs.append(Job(len(jobs), "doc", item.input_ids, min(item.max_new_tokens, spec.chat_max_tokens)))
        else:
            item = chats[ci]
            ci += 1
            jobs.append(Job(len(jobs), "chat", item.input_ids, min(item.max_new_tokens, spec.chat_max_tokens)))
        if spec.bad_every and (ci + di) % spec.bad_every == 0:
            jobs.append(Job(len(jobs), "bad", bad=catalogue[bi % len(catalogue)]))
            bi += 1
    return jobs


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in the process group `pgid` (a server and its
    scheduler/detokenizer children)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            with open(f"/proc/{entry.name}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def kv_usage(url: str) -> dict | None:
    try:
        info = requests.get(f"{url}/server_info", timeout=30).json()
        return info["internal_states"][0]["hack_kv"]
    except Exception:  # noqa: BLE001 - a dead or busy server: reported as unknown
        return None


RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")


def retractions(log: Path) -> int:
    try:
        return sum(int(m) for m in RETRACT_RE.findall(log.read_text(errors="replace")))
    except OSError:
        return 0


# SGLang's periodic decode log line: requests running, KV usage, and requests in the prealloc
# queue (#prealloc-req: waiting for KV room or a request row before their transfer may start),
# which is where a small pool shows in PD mode: a decode server admits a transfer only when its
# KV fits, so it queues before it retracts.
DECODE_BATCH_RE = re.compile(r"Decode batch, #running-req: (\d+), #token: \d+, token usage: ([\d.]+), "
                             r"pre-allocated usage: [\d.]+, #prealloc-req: (\d+)")


def decode_pressure(log: Path) -> dict | None:
    """Mean and max of running and prealloc-queued requests and the peak KV usage over a
    decode server's logged batches; None when it logged none."""
    try:
        rows = [tuple(float(x) for x in m) for m in DECODE_BATCH_RE.findall(log.read_text(errors="replace"))]
    except OSError:
        return None
    if not rows:
        return None
    n = len(rows)
    return {"batches_logged": n,
            "running_mean": round(sum(r[0] for r in rows) / n, 2), "running_max": int(max(r[0] for r in rows)),
            "prealloc_queue_mean": round(sum(r[2] for r in rows) / n, 2),
            "prealloc_queue_max": int(max(r[2] for r in rows)), "kv_usage_max": max(r[1] for r in rows)}


def _stats(vals: list[float]) -> dict:
    if not vals:
        return {"n": 0, "p50": None, "p99": None}
    s = sorted(vals)
    return {"n": len(s), "p50": statistics.median(s), "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]}


def router_workers(router_url: str) -> dict | None:
    """The router's own list of workers and their health, where it offers one."""
    for path in ("/workers", "/list_workers"):
        try:
            r = requests.get(router_url + path, timeout=5)
            if r.status_code == 200:
                return r.json()
        except Exception:  # noqa: BLE001
            continue
    return None


def _listed(workers: Any, url: str) -> bool | None:
    """Whether the router lists `url` as a healthy worker (None: it does not say)."""
    if workers is None:
        return None
    text = str(workers)
    if url not in text:
        return False
    if isinstance(workers, dict):
        for w in workers.get("workers", []) if isinstance(workers.get("workers"), list) else []:
            if isinstance(w, dict) and w.get("url") == url:
                return bool(w.get("is_healthy", True))
    return True


class Soak:
    """One soak run against the cluster `state` (disagg.cluster.up's)."""

    def __init__(self, state: dict, spec: SoakSpec, model_path: str, log: Callable[[str], None] = print):
        prefills = [s for s in state["servers"] if s["role"] == "prefill"]
        decodes = [s for s in state["servers"] if s["role"] == "decode"]
        from .cluster import state_links

        self.links = state_links(state)
        spec.validate(len(prefills), len(decodes), shaped_link=bool(self.links))
        self.state, self.spec, self.log = state, spec, log
        self.router = state["router_url"]
        self.servers = prefills + decodes
        self.jobs = build_jobs(model_path, spec)
        n_gen = sum(j.kind != "bad" for j in self.jobs)
        gen_positions = [j.index for j in self.jobs if j.kind != "bad"]
        self.fault_at = {gen_positions[min(n_gen - 1, int(f.at * n_gen))]: f for f in spec.faults}
        self.dead: dict[str, float] = {}  # server name -> kill time
        self.events: list[dict] = []
        self.results: dict[int, dict] = {}
        self.rss: dict[str, list[tuple[float, int]]] = {self._name(s): [] for s in self.servers}
        self.done_count = 0
        self.rss_at_100: dict[str, int] = {}
        # RSS at each tenth of the load: growth to a plateau and steady growth (a leak) look the
        # same in start/end numbers and different here.
        self.rss_tenths: dict[str, list[int]] = {name: [] for name in self.rss}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @staticmethod
    def _name(s: dict) -> str:
        return f"{s['role']}-{s['index']}"

    def _live(self, role: str) -> list[dict]:
        return [s for s in self.servers if s["role"] == role and self._name(s) not in self.dead]

    # -- faults ---------------------------------------------------------------------------
    def _fire(self, fault: FaultEvent, index: int) -> None:
        t = time.time()
        if fault.kind in LINK_FAULTS:
            self._link_fault(fault, index, t)
            return
        if fault.kind is FaultKind.CORRUPT_TRANSFER:
            target = self._live("decode")[0]
            trigger = Path(self.state["run_dir"]) / f"fault-trigger-decode-{target['index']}"
            trigger.write_text("corrupt")
            ev = {"fault": fault.kind.value, "server": self._name(target), "t": t, "at_job": index,
                  "trigger": str(trigger)}
        else:
            role = "prefill" if fault.kind is FaultKind.KILL_PREFILL else "decode"
            target = self._live(role)[-1]
            procs.kill_hard(int(target["pid"]))
            self.dead[self._name(target)] = t
            ev = {"fault": fault.kind.value, "server": self._name(target), "url": target["url"], "t": t,
                  "at_job": index}
            threading.Thread(target=self._watch_router, args=(ev,), daemon=True).start()
        self.log(f"fault at job {index}: {ev['fault']} {ev['server']}")
        self.events.append(ev)

    def _active_link_faults(self, kind: FaultKind) -> list[dict]:
        return [e for e in self.events if e["fault"] == kind.value and e.get("t_end", 0) is None]

    def _link_fault(self, fault: FaultEvent, index: int, t: float) -> None:
        kind = link_faults.LinkFault(fault.kind.value)
        ev = {"fault": fault.kind.value, "server": "prefill links", "arg": fault.arg, "t": t, "at_job": index,
              "t_end": None}
        with self._lock:
            # A link holds one fault at a time: a loss that starts during a partition takes effect
            # when the partition ends (_end_link_fault puts it in place), not by cutting it short.
            if not (kind is link_faults.LinkFault.LOSS and self._active_link_faults(FaultKind.PARTITION)):
                for link in self.links:
                    link_faults.apply(link, kind, fault.arg if kind is link_faults.LinkFault.LOSS else None)
            self.events.append(ev)
        self.log(f"fault at job {index}: {fault.label()} on {len(self.links)} prefill link(s)")
        if kind is link_faults.LinkFault.PARTITION:
            timer = threading.Timer(fault.arg, self._end_link_fault, args=(ev,))
            timer.daemon = True
            timer.start()

    def _end_link_fault(self, ev: dict) -> None:
        with self._lock:
            if ev["t_end"] is not None:
                return
            ev["dropped_packets"] = sum(link_faults.dropped_packets(link) for link in self.links)
            for link in self.links:
                link_faults.clear(link)
            ev["t_end"] = time.time()
            # A loss still running (begun before or during this partition) goes on after it.
            for loss in self._active_link_faults(FaultKind.LOSS):
                for link in self.links:
                    link_faults.apply(link, link_faults.LinkFault.LOSS, loss["arg"])
        self.log(f"fault {ev['fault']} over after {ev['t_end'] - ev['t']:.1f} s "
                 f"({ev['dropped_packets']} packets dropped)")

    def _end_link_faults(self) -> None:
        """A loss lasts to the end of the load; anything still active ends here (also on error)."""
        for ev in self.events:
            if ev["fault"] in (FaultKind.PARTITION.value, FaultKind.LOSS.value) and ev["t_end"] is None:
                self._end_link_fault(ev)

    def _watch_router(self, ev: dict) -> None:
        """When the router's worker list stops showing the dead server healthy."""
        deadline = ev["t"] + 120
        while time.time() < deadline and not self._stop.is_set():
            listed = _listed(router_workers(self.router), ev["url"])
            if listed is None:
                ev["router_view"] = "the router lists no workers"
                return
            if not listed:
                ev["router_dropped_after_s"] = round(time.time() - ev["t"], 2)
                return
            time.sleep(0.5)

    # -- load -----------------------------------------------------------------------------
    def _run_job(self, job: Job) -> None:
        t_send = time.time()
        if job.kind == "bad":
            status = send(self.router, job.bad, timeout=60.0)
            # A 4xx, or what the router documentedly answers itself (disagg.malformed.ROUTER_ANSWERS).
            ok = 400 <= status < 500 or status == router_answer(self.state.get("router"), job.bad.name)
            rec = {"kind": "bad", "name": job.bad.name, "status": status, "t_send": t_send,
                   "t_end": time.time(), "ok": ok}
        else:
            r: Result = generate(self.router, job.input_ids, job.max_new_tokens, self.spec.timeout_s)
            rec = {"kind": job.kind, "prompt_tokens": len(job.input_ids), "ok": r.ok, "status": r.status,
                   "error": r.error, "ttft_s": r.ttft_s, "jct_s": r.jct_s, "t_send": r.t_send,
                   "t_end": r.t_send + (r.jct_s or 0.0), "output_tokens": len(r.output_ids)}
        with self._lock:
            self.results[job.index] = rec
            if job.kind != "bad":
                self.done_count += 1
                if self.done_count == min(100, self.spec.requests):
                    self.rss_at_100 = {k: v[-1][1] for k, v in self.rss.items() if v}
                tenth = max(1, self.spec.requests // 10)
                if self.done_count % tenth == 0:
                    for name, samples in self.rss.items():
                        if samples and name not in self.dead:
                            self.rss_tenths[name].append(samples[-1][1])

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for s in self.servers:
                if self._name(s) not in self.dead:
                    self.rss[self._name(s)].append((now, group_rss_bytes(int(s["pid"]))))
            self._stop.wait(1.0)

    def _usage_all(self) -> dict:
        return {self._name(s): kv_usage(s["url"]) for s in self.servers if self._name(s) not in self.dead}

    def run(self) -> dict:
        before = self._usage_all()
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        t0 = time.time()
        sem = threading.Semaphore(self.spec.concurrency)
        try:
            with ThreadPoolExecutor(self.spec.concurrency + 4) as pool:
                for job in self.jobs:
                    sem.acquire()
                    if job.index in self.fault_at:
                        self._fire(self.fault_at[job.index], job.index)
                    fut = pool.submit(self._run_job, job)
                    fut.add_done_callback(lambda _f: sem.release())
        finally:
            self._end_link_faults()
        wall = time.time() - t0
        after, deadline = self._usage_all(), time.time() + self.spec.idle_timeout_s
        while not all(is_idle(u) for u in after.values()) and time.time() < deadline:
            time.sleep(2.0)  # the radix cache and aborted transfers settle within seconds
            after = self._usage_all()
        self._stop.set()
        sampler.join(5)
        return self.report(before, after, wall)

    # -- report ---------------------------------------------------------------------------
    @staticmethod
    def _link_report(ev: dict, gen: list[dict]) -> None:
        """What a link fault did to the requests in flight during it and to those after it."""
        lo, hi = ev["t"], ev["t_end"] if ev["t_end"] is not None else float("inf")
        during = [r for r in gen if r["t_send"] <= hi and r["t_end"] >= lo]
        ev["in_flight"] = len(during)
        ev["in_flight_served"] = sum(r["ok"] for r in during)
        ev["in_flight_failed"] = sum(not r["ok"] for r in during)
        ev["in_flight_errors"] = sorted({(r.get("error") or str(r.get("status")))[:120] for r in during if not r["ok"]})
        if ev["t_end"] is not None and during:
            ev["last_in_flight_ended_after_s"] = round(max(r["t_end"] for r in during) - ev["t_end"], 2)
        if ev["fault"] == FaultKind.PARTITION.value and ev["t_end"] is not None:
            later = sorted((r for r in gen if r["t_send"] > hi), key=lambda r: r["t_send"])
            ev["sent_after"] = len(later)
            ev["failed_after"] = sum(r.get("failure") == FailureClass.DEFECT.value for r in later)
            first_ok = next((r for r in later if r["ok"]), None)
            ev["first_served_after_s"] = round(first_ok["t_end"] - hi, 2) if first_ok else None

    def classify(self, rec: dict) -> FailureClass | None:
        if rec["ok"]:
            return None
        if rec["kind"] == "bad":
            return FailureClass.DEFECT
        if rec["t_end"] - rec["t_send"] >= 0.99 * self.spec.timeout_s:
            return FailureClass.DEFECT  # hung until the client gave up: no fault excuses that
        for ev in self.events:
            if ev["fault"] in (FaultKind.KILL_PREFILL.value, FaultKind.KILL_DECODE.value) \
                    and rec["t_send"] <= ev["t"] <= rec["t_end"]:
                return FailureClass.IN_FLIGHT_AT_KILL
            if ev["fault"] == FaultKind.PARTITION.value and ev["t_end"] is not None \
                    and rec["t_send"] <= ev["t_end"] and rec["t_end"] >= ev["t"] \
                    and rec["t_end"] <= ev["t_end"] + PARTITION_DEADLINE_S and (rec.get("error") or rec.get("status")):
                return FailureClass.DURING_PARTITION
        err = (rec.get("error") or "").lower()
        corrupt = [ev for ev in self.events if ev["fault"] == FaultKind.CORRUPT_TRANSFER.value]
        if corrupt and rec["t_end"] >= corrupt[0]["t"] and any(w in err for w in ("checksum", "digest", "corrupt")):
            return FailureClass.CORRUPTED_TRANSFER
        return FailureClass.DEFECT

    def report(self, before: dict, after: dict, wall: float) -> dict:
        recs = [self.results[j.index] for j in self.jobs if j.index in self.results]
        gen = [r for r in recs if r["kind"] != "bad"]
        bad = [r for r in recs if r["kind"] == "bad"]
        classes: dict[str, int] = {c.value: 0 for c in FailureClass}
        defects = []
        for r in recs:
            c = self.classify(r)
            if c is not None:
                classes[c.value] += 1
                r["failure"] = c.value
                if c is FailureClass.DEFECT:
                    defects.append({k: r.get(k) for k in ("kind", "name", "status", "error", "t_send")})
        corrupted = classes[FailureClass.CORRUPTED_TRANSFER.value]
        if corrupted > 1:  # only one transfer was damaged: the others are not explained
            classes[FailureClass.CORRUPTED_TRANSFER.value] = 1
            classes[FailureClass.DEFECT.value] += corrupted - 1
        # Latency before / after each fault, over requests sent in each interval.
        cuts = [("start", 0.0)] + [(e["fault"], e["t"]) for e in self.events] + [("end", float("inf"))]
        phases = []
        for (name, lo), (_, hi) in zip(cuts, cuts[1:]):
            ok = [r for r in gen if r["ok"] and lo <= r["t_send"] < hi]
            phases.append({"after": name, "sent": sum(lo <= r["t_send"] < hi for r in gen),
                           "ok": len(ok), "jct_s": _stats([r["jct_s"] for r in ok]),
                           "ttft_s": _stats([r["ttft_s"] for r in ok if r["ttft_s"] is not None])})
        for ev in self.events:
            if ev["fault"] == FaultKind.CORRUPT_TRANSFER.value:
                ev["consumed"] = not Path(ev["trigger"]).exists()
                continue
            if ev["fault"] in (FaultKind.PARTITION.value, FaultKind.LOSS.value):
                self._link_report(ev, gen)
                continue
            later = sorted((r for r in gen if r["t_send"] > ev["t"]), key=lambda r: r["t_send"])
            ev["sent_after"] = len(later)
            # Failures a later fault explains (in flight at a later kill, the damaged transfer)
            # are that fault's; what is left is this death's, routed to a dead server.
            ev["failed_after"] = sum(r.get("failure") == FailureClass.DEFECT.value for r in later)
            ev["failed_after_any"] = sum(not r["ok"] for r in later)
            failed = [r for r in later if r.get("failure") == FailureClass.DEFECT.value]
            ev["failed_after_within_s"] = round(max(r["t_send"] for r in failed) - ev["t"], 2) if failed else None
            first_ok = next((r for r in later if r["ok"]), None)
            ev["first_served_after_s"] = round(first_ok["t_end"] - ev["t"], 2) if first_ok else None
        rss = {}
        for name, samples in self.rss.items():
            if not samples:
                continue
            start, end = samples[0][1], samples[-1][1]
            at100 = self.rss_at_100.get(name)
            rss[name] = {"start_mb": round(start / 2**20, 1), "at_100_mb": round(at100 / 2**20, 1) if at100 else None,
                         "end_mb": round(end / 2**20, 1), "dead": name in self.dead,
                         "growth_from_100": round(end / at100 - 1.0, 4) if at100 else None,
                         "peak_mb": round(max(v for _, v in samples) / 2**20, 1),
                         "by_tenth_mb": [round(v / 2**20, 1) for v in self.rss_tenths[name]]}
        logs = {self._name(s): Path(s["log"]) for s in self.servers}
        expected_fail = (classes[FailureClass.IN_FLIGHT_AT_KILL.value] + classes[FailureClass.CORRUPTED_TRANSFER.value]
                         + classes[FailureClass.DURING_PARTITION.value])
        return {
            "spec": {**asdict(self.spec), "faults": [f.label() for f in self.spec.faults]},
            "cluster": {"kv": self.state.get("kv"), "router": self.state.get("router"),
                        "prefill": sum(s["role"] == "prefill" for s in self.servers),
                        "decode": sum(s["role"] == "decode" for s in self.servers)},
            "wall_s": round(wall, 1),
            "server_allocator": allocator.describe(dict(os.environ)),
            "requests": {"sent": len(gen), "ok": sum(r["ok"] for r in gen),
                         "failed": sum(not r["ok"] for r in gen), "expected_failures": expected_fail},
            "malformed": {"sent": len(bad), "answered_4xx": sum(r["ok"] for r in bad),
                          "statuses": sorted({r["status"] for r in bad})},
            "failures": classes, "defects": defects[:50],
            "faults": self.events, "phases": phases,
            "pools": {"before": before, "after": after,
                      "idle_after": {k: is_idle(v) for k, v in after.items()}},
            "rss": rss,
            "retractions": {name: retractions(p) for name, p in logs.items() if name.startswith("decode")},
            "decode_pressure": {name: decode_pressure(p) for name, p in logs.items() if name.startswith("decode")},
        }


def passed(report: dict, rss_growth_max: float = 0.05) -> list[str]:
    """The issue's properties a report must hold; the broken ones as sentences (empty: all hold)."""
    bad = []
    if report["failures"][FailureClass.DEFECT.value]:
        bad.append(f"{report['failures'][FailureClass.DEFECT.value]} failure(s) not explained by a fault")
    m = report["malformed"]
    if m["answered_4xx"] != m["sent"]:
        bad.append(f"{m['sent'] - m['answered_4xx']} malformed request(s) not answered 4xx ({m['statuses']})")
    for ev in report["faults"]:
        if ev.get("failed_after"):
            bad.append(f"{ev['failed_after']} request(s) sent after {ev['fault']} of {ev['server']} failed")
        if ev["fault"] == FaultKind.PARTITION.value and (ev.get("last_in_flight_ended_after_s") or 0) > PARTITION_DEADLINE_S:
            bad.append(f"a request in flight during the {ev['arg']:g} s partition ended "
                       f"{ev['last_in_flight_ended_after_s']} s after the link came back (deadline {PARTITION_DEADLINE_S:g} s)")
    idle = report["pools"]["idle_after"]
    if not all(idle.values()):
        bad.append("pools not idle after the load: " + ", ".join(k for k, v in idle.items() if not v))
    for name, r in report["rss"].items():
        if not r["dead"] and r["growth_from_100"] is not None and r["growth_from_100"] > rss_growth_max:
            bad.append(f"{name} RSS grew {100 * r['growth_from_100']:.1f}% from the 100th request to the end")
    return bad


def fault_schedule(text: str | None) -> list[FaultEvent]:
    if not text:
        return []
    return [FaultEvent.parse(t) for t in text.split(",") if t.strip()]

