"""Every command fails the same way: ``lmfleet: error: MESSAGE`` on stderr and its documented exit code."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lmfleet.cli.main import app


@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.yaml").write_text("models: []\n")
    (tmp_path / "ok.yaml").write_text("models: [{name: m, source: builtin:tiny-random}]\n")
    return tmp_path


# (argv with {tmp}, exit code, text in the message)
CASES = [
    (["config", "validate", "{tmp}/bad.yaml"], 2, "bad.yaml"),
    (["check", "-c", "{tmp}/bad.yaml", "--offline"], 2, "bad.yaml"),
    (["check", "-c", "{tmp}/ok.yaml", "--offline", "--gpu", "tpu"], 2, "--gpu: unknown GPU"),
    (["usage", "--ledger", "{tmp}/none.sqlite"], 1, "no ledger at"),
    (["usage", "--ledger", "{tmp}/ok.yaml", "--since", "yesterday"], 2, "expected a duration"),
    (["cluster", "status", "-c", "{tmp}/bad.yaml"], 2, "bad.yaml"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "--model", "m", "--users", "2", "--rate", "1"], 2,
     "not both"),
]


@pytest.mark.parametrize("argv, code, needle", CASES, ids=[" ".join(c[0][:2]) + f" {c[1]}" for c in CASES])
def test_cli_errors_share_one_form(files, argv, code, needle):
    r = CliRunner().invoke(app, [a.format(tmp=files) for a in argv])
    assert r.exit_code == code, r.output
    assert "lmfleet: error: " in r.stderr and needle in r.stderr, r.stderr


def test_data_stdout_sends_other_prints_to_stderr(monkeypatch):
    """A Ray driver thread printing a cluster event while ``--json`` is written cannot corrupt the document."""
    import io
    import sys
    import threading

    from lmfleet.cli.common import data_stdout

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with data_stdout() as stdout:
        t = threading.Thread(target=lambda: print("(raylet) The node ... has been marked dead"))
        t.start()
        t.join()
        stdout.write('{"ok": true}\n')
    assert out.getvalue() == '{"ok": true}\n'
    assert "marked dead" in err.getvalue()
    assert sys.stdout is out


@pytest.mark.parametrize("connected", [True, False])
def test_data_stdout_disconnects_a_connected_ray_driver_before_stdout_is_back(monkeypatch, connected):
    """An event Ray's driver thread prints after the document (the driver disconnecting at exit) would follow the JSON
    on stdout: the block disconnects the driver while other prints still go to stderr."""
    import io
    import sys
    import types

    from lmfleet.cli.common import data_stdout

    out, err = io.StringIO(), io.StringIO()
    calls: list[object] = []
    fake = types.SimpleNamespace(is_initialized=lambda: connected,
                                 shutdown=lambda: calls.append(sys.stdout) or print("(raylet) late event"))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with data_stdout() as stdout:
        stdout.write('{"ok": true}\n')
    assert out.getvalue() == '{"ok": true}\n'
    assert calls == ([err] if connected else [])
    assert ("late event" in err.getvalue()) is connected
