"""Streamlit entry point of `hack dashboard`.

Configuration comes from the environment (set by `hack dashboard`): HACK_RUNS_DIR,
HACK_DASHBOARD_RUN_DIR, HACK_DASHBOARD_URL, HACK_DASHBOARD_SERVERS (the servers behind that
URL, comma-separated), HACK_DASHBOARD_REFRESH_S. The query
parameter `?run=<run directory name>` opens a run of the runs root directly.
"""
from __future__ import annotations

import traceback
from pathlib import Path

import streamlit as st

from dashboard import views
from dashboard.sources import HOW_TO_START, config_from_env, run_choices, run_title

st.set_page_config(page_title="HACK dashboard", page_icon="📈", layout="wide")
config = config_from_env()

st.sidebar.title("HACK dashboard")
max_requests = st.sidebar.slider("Requests shown in the timeline and breakdown",
                                 min_value=20, max_value=2000, value=200, step=20)
auto = st.sidebar.toggle("Auto-refresh while live", value=True,
                         help=f"every {config.refresh_s:g} s while a run is being written")


def _guarded(fn, *args) -> bool:
    """Run a page; an unexpected failure becomes a message, never a dead page."""
    try:
        return bool(fn(*args))
    except Exception as exc:  # noqa: BLE001 - the page must survive any data
        st.error(f"The dashboard failed on this data: {exc}")
        with st.expander("details"):
            st.code(traceback.format_exc())
        return False


def _live_fragment(name: str, body, *args) -> None:
    """Render `body` in a fragment that re-runs itself every refresh_s while live."""
    state_key = f"live:{name}"
    every = config.refresh_s if auto and st.session_state.get(state_key) else None

    @st.fragment(run_every=every)
    def fragment() -> None:
        live = _guarded(body, *args)
        if live != st.session_state.get(state_key, False):
            st.session_state[state_key] = live
            st.rerun()       # switch the refresh timer on or off

    fragment()


def _one_run(target: str, kind: str) -> bool:
    view = views.get_source(target, kind, config.servers if kind == "url" else ()).view()
    views.run_page(view, max_requests)
    return view.data.live


def _two_runs(a: str, b: str) -> bool:
    va, vb = views.get_source(a, "dir").view(), views.get_source(b, "dir").view()
    na, nb = (va.data.meta.get("label") or Path(a).name), (vb.data.meta.get("label")
                                                           or Path(b).name)
    if na == nb:
        na, nb = Path(a).name, Path(b).name
    views.compare_page({na: va, nb: vb})
    return va.data.live or vb.data.live


if config.url:
    st.sidebar.markdown(f"Following **{config.url}** over HTTP" + (
        f" ({len(config.servers)} servers of its cluster)" if config.servers else ""))
    _live_fragment(config.url, _one_run, config.url, "url")
else:
    runs = [str(r) for r in run_choices(config)]
    if not runs:
        st.title("HACK dashboard")
        st.info(HOW_TO_START)
        st.stop()
    wanted = st.query_params.get("run")
    default = next((i for i, r in enumerate(runs) if Path(r).name == wanted), 0)
    mode = st.sidebar.radio("View", ["Run", "Compare two runs"],
                            index=1 if st.query_params.get("compare") else 0)
    label = lambda r: run_title(Path(r))  # noqa: E731
    if mode == "Run":
        run = st.sidebar.selectbox("Run", runs, index=default, format_func=label)
        _live_fragment(run, _one_run, run, "dir")
    elif len(runs) < 2:
        st.info("Comparing needs two run directories; only one was found under "
                f"{config.runs_root}.")
    else:
        other = st.query_params.get("compare")
        second = next((i for i, r in enumerate(runs) if Path(r).name == other),
                      1 if default == 0 else 0)
        a = st.sidebar.selectbox("Run A", runs, index=default, format_func=label)
        b = st.sidebar.selectbox("Run B", runs, index=second, format_func=label)
        _live_fragment(f"{a}|{b}", _two_runs, a, b)
