"""The operator notebook runs headless (nbclient, a real ipykernel) over a recorded run
and draws the dashboard's figures. Starting a cluster from the notebook is not covered
yet: it arrives with the cluster launcher."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient

from dashboard import figures as F
from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.slow
NOTEBOOK = Path(__file__).resolve().parent.parent / "dashboard" / "operator.ipynb"


def _plotly_titles(nb) -> list[str]:
    titles = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            fig = out.get("data", {}).get("application/vnd.plotly.v1+json")
            if fig:
                fig = json.loads(fig) if isinstance(fig, str) else fig
                titles.append(fig["layout"]["title"]["text"])
    return titles


def test_notebook_plots_the_dashboard_figures(tmp_path, monkeypatch):
    run = write_synthetic_run(SyntheticSpec(requests=80, seed=6), root=tmp_path)
    monkeypatch.setenv("HACK_NOTEBOOK_RUN_DIR", str(run))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook without outputs"
    # The kernel's channels are Unix sockets, not TCP: over TCP the client picks five free ports
    # and the kernel binds them a moment later, a race that another test's server on the same
    # host can lose it ("Address already in use"). The socket path is absolute (the kernel runs
    # in tmp_path, the client here) and short (a Unix socket path holds 107 bytes).
    with tempfile.TemporaryDirectory(prefix="nbk") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=f"{sockets}/kernel")
        NotebookClient(nb, km=km, timeout=180,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    titles = _plotly_titles(nb)
    for key in ("timeline", "breakdown", "average", "memory", "compression", "throughput",
                "latency", "servers"):
        assert any(t.startswith(F.TITLES[key]) for t in titles), (key, titles)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert f"run: {run}" in text and "synthetic=True" in text
    # The percentile table printed by the notebook has the three metrics.
    html = "".join(o.get("data", {}).get("text/plain", "") for c in nb.cells
                   for o in c.get("outputs", []))
    assert "TTFT" in html and "TPOT" in html and "JCT" in html
