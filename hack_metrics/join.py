"""Join the records of all servers into per-request spans and per-request rows.

Join key: a request's `bootstrap_room` when any of its records carries one (the router
gives the prefill and the decode copy of a request the same room), else its request id.
A record without a room inherits the room of another record with the same (server, rid).

Which role speaks for the user: when a request has records from a decode server, its
first token and finish are the decode server's (that is when the client sees them);
otherwise those of the colocated or prefill server.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

_SPAN_COLS = ["key", "role", "server", "phase", "start_ns", "end_ns", "open", "bytes",
              "bytes_bf16", "tokens", "method", "steps"]
REQUEST_COLUMNS = ["key", "room", "roles", "final_role", "rid_prefill", "rid_decode",
                   "rid_colocated", "arrival_ns", "first_token_ns", "finish_ns", "error",
                   "prompt_tokens", "cached_tokens", "restored_tokens", "bytes", "bytes_bf16",
                   "output_tokens", "status", "ttft_s", "jct_s", "tpot_s"]
_FINAL_ROLE_ORDER = ("decode", "colocated", "prefill", "router")


def split_records(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(events, samples) from a frame of mixed records."""
    is_sample = df["kind"] == "sample"
    return df[~is_sample].reset_index(drop=True), df[is_sample].reset_index(drop=True)


def assign_keys(events: pd.DataFrame) -> pd.DataFrame:
    """Copy of `events` with `room` filled per (server, rid) and a `key` column."""
    ev = events.copy()
    room = ev["room"].astype("Int64")
    known = ev[room.notna() & ev["rid"].notna()]
    if len(known):
        room_of = known.groupby(["server", "rid"])["room"].first()
        idx = pd.MultiIndex.from_arrays([ev["server"], ev["rid"]])
        fill = pd.Series(room_of.reindex(idx).to_numpy(), index=ev.index).astype("Int64")
        room = room.fillna(fill)
    ev["room"] = room
    by_room = "room:" + room.astype("string")
    by_rid = "rid:" + ev["rid"].astype("string")
    ev["key"] = by_room.fillna(by_rid)
    return ev[ev["key"].notna()].reset_index(drop=True)


def build_spans(ev: pd.DataFrame, now_ns: int) -> pd.DataFrame:
    """One row per phase interval. Open phases (a start without its end) end at `now_ns`.

    `ev` must come from `assign_keys`. Decode steps of one request on one server become a
    single decode interval from the first step's start to the last step's end.
    """
    parts = []
    spans = ev[ev["kind"] == "span"]
    if len(spans):
        parts.append(pd.DataFrame({
            "key": spans["key"], "role": spans["role"], "server": spans["server"],
            "phase": spans["phase"], "start_ns": spans["t_ns"] - spans["dur_ns"],
            "end_ns": spans["t_ns"], "open": False, "bytes": spans["bytes"],
            "bytes_bf16": spans["bytes_bf16"], "tokens": spans["tokens"],
            "method": spans["method"], "steps": 0}))
    steps = ev[ev["kind"] == "step"]
    if len(steps):
        st = steps.assign(start_ns=steps["t_ns"] - steps["dur_ns"],
                          tokens=steps["tokens"].fillna(1))
        agg = st.groupby(["key", "role", "server", "phase"], as_index=False).agg(
            start_ns=("start_ns", "min"), end_ns=("t_ns", "max"),
            tokens=("tokens", "sum"), steps=("t_ns", "size"))
        agg["open"], agg["bytes"], agg["bytes_bf16"], agg["method"] = False, None, None, \
            "derived"
        parts.append(agg)
    parts.append(_pair_boundaries(ev, now_ns))
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in _SPAN_COLS})
    out = pd.concat([p[_SPAN_COLS] for p in parts], ignore_index=True)
    for col in ("start_ns", "end_ns", "steps"):
        out[col] = out[col].astype("int64")
    for col in ("bytes", "bytes_bf16", "tokens"):
        out[col] = pd.to_numeric(out[col]).astype("Int64")
    out["open"] = out["open"].astype(bool)
    return out.sort_values(["key", "start_ns"], kind="stable").reset_index(drop=True)


def _pair_boundaries(ev: pd.DataFrame, now_ns: int) -> pd.DataFrame:
    """Pair the i-th start with the i-th end per (request, server, phase). A start without
    an end runs until the request's finish or error record, or until `now_ns`."""
    b = ev[ev["kind"].isin(["start", "end"])].sort_values(["t_ns", "seq"], kind="stable")
    if not len(b):
        return pd.DataFrame(columns=_SPAN_COLS)
    closed_at = ev[ev["kind"].isin(["finish", "error"])].groupby("key")["t_ns"].max()
    group = ["key", "server", "phase"]
    b = b.assign(n=b.groupby(group + ["kind"]).cumcount())
    starts = b[b["kind"] == "start"]
    ends = b[b["kind"] == "end"]
    m = starts.merge(ends, on=group + ["n"], how="left", suffixes=("", "_end"))
    # Merge, not map: nanosecond times must stay integers (a float loses ~256 ns).
    m = m.merge(closed_at.astype("Int64").rename("closed_at"), left_on="key",
                right_index=True, how="left")
    is_open = m["t_ns_end"].isna()
    stop = m["closed_at"].astype("Int64").fillna(max(int(now_ns), 0))
    end_ns = m["t_ns_end"].astype("Int64").fillna(stop).astype("int64")
    end_ns = np.maximum(end_ns.to_numpy(), m["t_ns"].to_numpy())
    pick = lambda col: m[f"{col}_end"].where(m[f"{col}_end"].notna(), m[col])  # noqa: E731
    return pd.DataFrame({
        "key": m["key"], "role": m["role"], "server": m["server"], "phase": m["phase"],
        "start_ns": m["t_ns"], "end_ns": end_ns, "open": is_open.to_numpy(),
        "bytes": pick("bytes"), "bytes_bf16": pick("bytes_bf16"), "tokens": pick("tokens"),
        "method": pick("method"), "steps": 0})


def orphan_ends(ev: pd.DataFrame) -> int:
    """How many `end` records have no matching `start` (lost or never written)."""
    b = ev[ev["kind"].isin(["start", "end"])]
    if not len(b):
        return 0
    counts = b.groupby(["key", "server", "phase", "kind"]).size().unstack(fill_value=0)
    if "end" not in counts:
        return 0
    starts = counts["start"] if "start" in counts else 0
    return int((counts["end"] - starts).clip(lower=0).sum())


def _final_role(roles: pd.Series) -> str:
    present = set(roles)
    for role in _FINAL_ROLE_ORDER:
        if role in present:
            return role
    return next(iter(present))


def build_requests(ev: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """One row per joined request: times (ns), latencies (s), tokens, bytes, status."""
    if not len(ev):
        return pd.DataFrame(columns=REQUEST_COLUMNS)
    g = ev.groupby("key")
    req = pd.DataFrame({"room": g["room"].first(),
                        "roles": g["role"].agg(lambda s: ",".join(sorted(set(s)))),
                        "final_role": g["role"].agg(_final_role)})
    ev = ev.merge(req[["final_role"]], left_on="key", right_index=True)
    final = ev[ev["role"] == ev["final_role"]]

    def first_t(frame: pd.DataFrame, kind: str, how: str) -> pd.Series:
        return frame[frame["kind"] == kind].groupby("key")["t_ns"].agg(how)

    for role in ("prefill", "decode", "colocated"):
        rids = ev[(ev["role"] == role) & ev["rid"].notna()].groupby("key")["rid"].first()
        req[f"rid_{role}"] = rids
    req["arrival_ns"] = first_t(ev, "arrival", "min")
    if len(spans):
        req["arrival_ns"] = req["arrival_ns"].fillna(spans.groupby("key")["start_ns"].min())
    req["first_token_ns"] = first_t(final, "first_token", "min").reindex(req.index) \
        .fillna(first_t(ev, "first_token", "max"))
    req["finish_ns"] = first_t(final, "finish", "max")
    errors = ev[ev["kind"] == "error"]
    req["error"] = errors.groupby("key")["note"].agg(
        lambda s: "; ".join(str(x) for x in s.dropna().unique()) or "error")
    arrivals = ev[ev["kind"] == "arrival"]
    req["prompt_tokens"] = arrivals.groupby("key")["tokens"].max()
    # the prompt's sources (schema version 3): taken from the cache, of those restored from the tier
    pf_end = ev[(ev["kind"] == "end") & (ev["phase"] == "prefill")]
    for col in ("cached_tokens", "restored_tokens"):
        req[col] = pf_end.groupby("key")[col].max() if col in pf_end else np.nan
    out_tokens = final[final["kind"] == "finish"].groupby("key")["tokens"].max()
    if len(spans):
        dec = spans[spans["phase"] == "decode"].groupby("key")["tokens"].max()
        out_tokens = out_tokens.reindex(req.index).fillna(dec)
        xfer = spans[spans["phase"] == "transfer"]
        per_role = xfer.groupby(["key", "role"])[["bytes", "bytes_bf16"]].sum()
        # Sender and receiver may both report the same bytes: count one side only.
        req["bytes"] = per_role["bytes"].groupby("key").max()
        req["bytes_bf16"] = per_role["bytes_bf16"].groupby("key").max()
    else:
        req["bytes"], req["bytes_bf16"] = np.nan, np.nan
    req["output_tokens"] = out_tokens
    req["status"] = np.where(req["error"].notna(), "error",
                             np.where(req["finish_ns"].notna(), "finished", "in_flight"))
    req["ttft_s"] = (req["first_token_ns"] - req["arrival_ns"]) / 1e9
    req["jct_s"] = (req["finish_ns"] - req["arrival_ns"]) / 1e9
    n = pd.to_numeric(req["output_tokens"], errors="coerce")
    decode_s = (req["finish_ns"] - req["first_token_ns"]) / 1e9
    req["tpot_s"] = (decode_s / (n - 1)).where(n > 1)
    req.index.name = "key"
    req = req.reset_index().sort_values("arrival_ns", kind="stable").reset_index(drop=True)
    return req[REQUEST_COLUMNS]
