"""Everything derived from one run's records, computed once per data change."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pandas as pd

from hack_metrics import analysis, join
from hack_metrics.runload import RunData


@dataclass
class RunView:
    data: RunData
    events: pd.DataFrame
    samples: pd.DataFrame
    spans: pd.DataFrame
    requests: pd.DataFrame
    breakdown: pd.DataFrame
    t0_ns: int
    now_ns: int
    notes: list[str] = field(default_factory=list)   # partial-data remarks for the user

    @property
    def finished(self) -> pd.DataFrame:
        return self.requests[self.requests["status"] == "finished"]


def build_view(data: RunData, now_ns: int | None = None) -> RunView:
    """Join, span, breakdown. Open phases of a live run end at `now_ns` (default: now);
    those of a finished run end at its last record."""
    records = data.records
    events, samples = join.split_records(records)
    events = join.assign_keys(events)
    last = int(records["t_ns"].max()) if len(records) else 0
    if now_ns is None:
        now_ns = time.time_ns() if data.live else last
    t0 = int(records["t_ns"].min()) if len(records) else now_ns
    if len(events):
        # A span that ends at t started dur before it: the run may begin before t0.
        starts = events["t_ns"] - events["dur_ns"].fillna(0)
        t0 = min(t0, int(starts.min()))
    spans = join.build_spans(events, now_ns)
    requests = join.build_requests(events, spans)
    breakdown = analysis.exclusive_breakdown(spans, requests)
    view = RunView(data, events, samples, spans, requests, breakdown, t0, now_ns)
    view.notes.extend(_partial_notes(view))
    return view


def _partial_notes(view: RunView) -> list[str]:
    notes = []
    req = view.requests
    if not len(req):
        return notes
    orphans = join.orphan_ends(view.events)
    if orphans:
        notes.append(f"{orphans} phase end records have no start record (lost or not "
                     "written): those phases are missing from the timeline")
    roles = req["roles"].astype(str)
    pd_run = roles.str.contains("prefill").any() and roles.str.contains("decode").any()
    if pd_run:
        one_side = req[~(roles.str.contains("prefill") & roles.str.contains("decode"))]
        if len(one_side):
            notes.append(f"{len(one_side)} of {len(req)} requests have records from only "
                         "one role (prefill or decode): their join is incomplete")
    no_arrival = int(view.events[view.events["kind"] == "arrival"]["key"].nunique())
    if no_arrival < len(req):
        notes.append(f"{len(req) - no_arrival} requests have no arrival record: their "
                     "start is taken from their first phase")
    return notes
