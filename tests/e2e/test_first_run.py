"""The first run as a new user has it: the README's first request (issue 16) and a quiet terminal (issue 34).

README_QUESTION has no temperature and no max_tokens. The embedded SmolLM2 answers it through its generation_config.json defaults (greedy). Measured on a bare vLLM
server with the converted folder and no sampling parameters: "Paris" in 30/30 answers; the bound below (9/10)
is the issue's, and leaves room for a batch-dependent flip of the first token ("The" p=0.155 vs "L" p=0.14).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from lmfleet.config import default_config_text
from lmfleet.serve.proxy import free_port
from tests.e2e.conftest import descendants, end_processes

pytestmark = pytest.mark.e2e

README_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TRIES, NEED = 10, 9


def test_readme_question_is_answered_right_at_default_sampling(fleet):
    client = fleet.client(timeout=300)

    def ask(_):
        return client.chat.completions.create(model="smollm2", messages=README_QUESTION).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(TRIES)))
    right = sum("Paris" in a for a in answers)
    assert right >= NEED, f"Paris in {right}/{TRIES} answers: {answers}"


# Lines `lmfleet serve` may print that do not start with "lmfleet:": none today. A line a library prints straight
# to the terminal (Ray's "(raylet) …" messages, vLLM's log, nanobind's "leaked …" at exit, a traceback) fails.
TERMINAL_ALLOW: tuple[str, ...] = ()


@pytest.mark.e2e_order(-1)  # before the shared fleet starts: its engines would slow this start for nothing
def test_serve_terminal_is_quiet_from_start_to_ctrl_c(tmp_path):
    """`lmfleet serve` as a user runs it (the default fleet, no --verbose), one request, Ctrl-C: every line on the
    terminal is lmfleet's own, it says how long start-up took, and it ends with "shutting down…" and "stopped"."""
    cfg = yaml.safe_load(default_config_text())
    port, serve_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    cfg["gateway"].update(port=port, serve_port=serve_port)
    cfg["models"][0]["engine"]["cpu_kvcache_space_gib"] = 1
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = tmp_path / "terminal.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "lmfleet"), "serve", "-c", "fleet.yaml"], cwd=tmp_path,
                            env=env, stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 900
        while "lmfleet: Ctrl-C stops everything" not in out.read_text():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            seen.update(descendants(proc.pid))
            time.sleep(1)
        seen.update(descendants(proc.pid))
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300,
                       json={"model": cfg["models"][0]["name"], "max_tokens": 8, "messages": README_QUESTION})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) in (0, 130)
    finally:
        end_processes(proc, seen, signal.SIGINT)
    text = out.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    strays = [ln for ln in lines if not ln.startswith("lmfleet:") and not ln.startswith(TERMINAL_ALLOW)]
    assert not strays, f"lines that are not lmfleet's own:\n{text}"
    for word in ("Traceback", "nanobind", "(raylet)", "leaked"):
        assert word not in text, text
    assert any(ln.startswith("lmfleet: ready in ") for ln in lines), text
    assert "lmfleet: shutting down..." in lines and lines[-1] == "lmfleet: stopped", text
