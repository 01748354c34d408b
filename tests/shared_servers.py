"""SGLang servers shared by the test modules that only send requests to them.

A server start costs 30-45 s of a 2-core machine (mostly the launcher importing SGLang), more than
most of the tests that use it. Modules whose servers would be started with the same flags take
them from here instead: each server is started the first time a test asks for it (those that
start together, in parallel) and stopped right after the last test of the session that uses it
(tests/conftest.py), so it holds no memory while later modules start servers of their own.

A test whose server needs other flags keeps its own server: sharing is only for equal flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.launcher import SGLangServer

SMOLLM2_BUDGET_MB = "256"
# Both servers: the same fixed KV budget (capacity ratios are read at equal memory), an idle
# server takes no CPU from the busy one, a fixed seed. The HACK server names its prefill mode
# (--hack-prefill auto is dense on a CPU with AMX-BF16) so that the bars of the tests mean the same
# on every host. Both record metrics, each into its own directory, as every `hack up` server does
# (tests/test_engine_server.py reads the HACK server's; tests/test_engine_speed.py compares the
# two servers' decode speed, so both pay the recording alike). tests/test_fuzz_api.py fuzzes both.
COMMON = ["--hack-kv-budget-mb", SMOLLM2_BUDGET_MB, "--sleep-on-idle", "--random-seed", "0"]
SPECS: dict[str, list[str]] = {
    "smollm2_hack": ["--kv-cache-dtype", "hack", "--hack-prefill", "homomorphic", *COMMON],
    "smollm2_bf16": ["--attention-backend", "torch_native", *COMMON],
}
FIXTURES = tuple(SPECS)  # the fixture names of tests/conftest.py, one per server


@dataclass
class SharedServers:
    """Starts the shared servers on first use and stops each after its last user."""

    root: Path
    last_user: dict[str, str] = field(default_factory=dict)  # name -> node id of its last test
    model_path: str | None = None
    running: dict[str, SGLangServer] = field(default_factory=dict)

    def metrics_dir(self, name: str = "smollm2_hack") -> Path:
        return self.root / f"metrics-{name}"

    def get(self, name: str, starting_with: tuple[str, ...] = ()) -> SGLangServer:
        """The server `name`, started (together with `starting_with`, which later tests of the
        same module ask for: two starts overlap) if it is not running."""
        for n in (name, *starting_with):
            if n not in self.last_user:
                raise RuntimeError(f"shared server {n!r}: mark the module with pytest.mark.shared_servers({n!r}, ...) "
                                   "so that it is stopped after its last test")
        if name not in self.running:
            if self.model_path is None:
                from hack_eval.models import prepare

                self.model_path = str(prepare("smollm2", log=lambda *a, **k: None))
            todo = [n for n in (name, *starting_with) if n not in self.running]
            fresh = {n: self._server(n) for n in todo}
            try:
                for s in fresh.values():
                    s.start()
                for s in fresh.values():
                    s.wait_ready()
            except BaseException:
                for s in fresh.values():
                    s.stop()
                raise
            self.running.update(fresh)
        return self.running[name]

    def _server(self, name: str) -> SGLangServer:
        env = {"HACK_METRICS_RUN_DIR": str(self.metrics_dir(name))}
        return SGLangServer(self.model_path, list(SPECS[name]), log_path=self.root / f"{name}.log", env=env)

    def stop(self, name: str) -> None:
        server = self.running.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)
