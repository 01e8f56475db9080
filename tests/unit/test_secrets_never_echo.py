"""Secrets never echo (issue 49): every place that shows config or environment values, with a planted secret.

Each case plants ``supersecret123`` where a user would put a secret (a URL's password, a key pasted where its
variable's name belongs, an engine's ``HF_TOKEN``, a setup command, the environment variables the fleet names)
and runs the real thing that shows it: the CLI (``config validate|show|schema|default``, ``cluster up --print``,
``usage``), the loader's errors, the gateway's answers (``/admin/*``, ``/ready``, ``/metrics``) and its log lines.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from lmfleet.cli.main import app
from lmfleet.config import ConfigError, parse_config
from lmfleet.config.redact import MASK, env_secrets, is_secret_name, redact, redact_text, redact_url, secret_values
from lmfleet.testing.gateway_fakes import chat_json, make_gateway, started_client

SECRET = "supersecret123"
MODEL = {"name": "m", "source": "builtin:tiny-random"}


def fleet(**sections) -> dict:
    return {"models": [MODEL], **sections}


PROVIDER = {"name": "p", "base_url": "https://api.example.com/v1", "model_map": {"m": "pm"}}
CLUSTER = {"head": {"address": "10.0.0.1"}, "workers": [{"address": "10.0.0.2"}]}

# (id, fleet file, argv with {file}, exit code, text that must be in the output)
CLI_CASES = [
    ("validate: ledger.url with a password",
     fleet(ledger={"url": f"postgresql://lmfleet:{SECRET}@db.internal:5432/fleet"}),
     ["config", "validate", "{file}"], 2, "postgresql://lmfleet:***@db.internal:5432/fleet"),
    ("validate: ledger.url with a password that has '/' in it",
     fleet(ledger={"url": f"postgresql://lmfleet:{SECRET}/x@db.internal:5432/fleet"}),
     ["config", "validate", "{file}"], 2, "ledger.url"),
    ("validate: the provider key pasted into api_key_env",
     fleet(providers=[{**PROVIDER, "api_key_env": f"sk-{SECRET}"}]),
     ["config", "validate", "{file}"], 2, "providers[0].api_key_env"),
    ("validate: the admin key pasted into admin_key_env",
     fleet(gateway={"admin_key_env": f"{SECRET}!"}), ["config", "validate", "{file}"], 2, "not shown"),
    ("validate: client keys pasted into a tenant's api_keys_env",
     fleet(tenants=[{"name": "acme", "api_keys_env": f"sk-{SECRET},sk-other-key"}]),
     ["config", "validate", "{file}"], 2, "tenants[0].api_keys_env"),
    ("validate: a provider base_url with a password and a bad scheme",
     fleet(providers=[{**PROVIDER, "base_url": f"ftp://user:{SECRET}@api.example.com/v1"}]),
     ["config", "validate", "{file}"], 2, "ftp://user:***@api.example.com/v1"),
    ("validate: an OTLP endpoint with a token in its query",
     fleet(observability={"otlp_endpoint": f"http://otel:4318/v1 ?token={SECRET}"}),
     ["config", "validate", "{file}"], 2, "token=***"),
    ("validate: engine.env and extra_args with tokens beside an error",
     {"models": [{**MODEL, "engine": {"env": {"HF_TOKEN": SECRET, "bad-name": "1"},
                                      "extra_args": {"hf_token": SECRET, "max_num_seqs": 2}}}]},
     ["config", "validate", "{file}"], 2, "bad-name"),
    ("validate: a good file with secrets in it",
     fleet(providers=[{**PROVIDER, "base_url": f"https://user:{SECRET}@api.example.com/v1"}]),
     ["config", "validate", "{file}"], 0, ": ok"),
    ("show: URLs, engine env, extra_args, setup commands",
     {"models": [{**MODEL, "engine": {"env": {"HF_TOKEN": SECRET}, "extra_args": {"hf_token": SECRET}}}],
      "providers": [{**PROVIDER, "base_url": f"https://user:{SECRET}@api.example.com/v1?api_key={SECRET}",
                     "api_key_env": "PROVIDER_KEY"}],
      "observability": {"otlp_endpoint": f"https://otel:{SECRET}@collector:4318"},
      "cluster": {"setup_commands": [f"export HF_TOKEN={SECRET}", f"huggingface-cli login --token {SECRET}",
                                     f"curl -H 'Authorization: Bearer {SECRET}' https://x"]}},
     ["config", "show", "-c", "{file}"], 0, "api_key_env: PROVIDER_KEY"),
    ("show --json", fleet(providers=[{**PROVIDER, "base_url": f"https://user:{SECRET}@api.example.com/v1"}]),
     ["config", "show", "--json", "-c", "{file}"], 0, '"base_url": "https://user:***@api.example.com/v1"'),
    ("schema", fleet(), ["config", "schema"], 0, "FleetConfig"),
    ("default", fleet(), ["config", "default"], 0, "models:"),
    ("cluster up --print: setup commands",
     fleet(cluster={**CLUSTER, "setup_commands": [f"export HF_TOKEN={SECRET}",
                                                  f"huggingface-cli login --token {SECRET}"]}),
     ["cluster", "up", "--print", "-c", "{file}"], 0, "HF_TOKEN=***"),
]


@pytest.mark.parametrize("data, argv, code, needle", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_never_prints_a_secret(tmp_path, data, argv, code, needle):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(app, [a.format(file=path) for a in argv])
    out = r.stdout + r.stderr
    assert r.exit_code == code, out
    assert SECRET not in out, out
    assert needle in out, out


def test_show_masks_values_and_keeps_names(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(CLI_CASES[9][1]))
    shown = yaml.safe_load(CliRunner().invoke(app, ["config", "show", "-c", str(path)]).stdout)
    engine = shown["models"][0]["engine"]
    assert engine["env"] == {"HF_TOKEN": MASK} and engine["extra_args"] == {"hf_token": MASK}
    assert shown["providers"][0]["api_key_env"] == "PROVIDER_KEY"
    assert shown["gateway"]["admin_key_env"] == "LMFLEET_ADMIN_KEY"
    assert shown["cluster"]["auth_token_path"] == "~/.ray/auth_token"
    assert shown["models"][0]["engine"]["max_num_batched_tokens"] is None  # a 'tokens' field is not a secret


def test_usage_never_prints_the_database_password(tmp_path, monkeypatch):
    """The password comes from the variable ledger.password_env names; an unreachable database says where it
    is (user, host, database) and why, never the password."""
    pytest.importorskip("psycopg")
    monkeypatch.setenv("LMFLEET_TEST_PG_PASSWORD", SECRET)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet(ledger={"url": "postgresql://lmfleet@127.0.0.1:9/fleet",
                                                 "password_env": "LMFLEET_TEST_PG_PASSWORD",
                                                 "connect_timeout_s": 2})))
    r = CliRunner().invoke(app, ["usage", "-c", str(path)])
    out = r.stdout + r.stderr
    assert r.exit_code == 1 and "postgresql://lmfleet@127.0.0.1:9/fleet" in out, out
    assert SECRET not in out, out


def test_loader_error_object_holds_no_secret():
    """``ConfigError``'s problems (what `lmfleet apply` and the admin API would report) are masked too."""
    with pytest.raises(ConfigError) as e:
        parse_config(fleet(ledger={"url": f"postgresql://lmfleet:{SECRET}@db/fleet"},
                           providers=[{**PROVIDER, "api_key_env": f"sk-{SECRET}"}]))
    assert SECRET not in str(e.value) and SECRET not in repr(e.value.problems)
    assert len(e.value.problems) == 2


def test_a_refused_value_under_a_secret_name_is_masked_whatever_its_type():
    with pytest.raises(ConfigError) as e:
        parse_config({"models": [{**MODEL, "engine": {"env": {"HF_TOKEN": 98765432}}}]})
    assert "98765432" not in str(e.value) and f"(got {MASK!r})" in str(e.value), str(e.value)


# ---- the gateway: env values the fleet names (admin key, client keys, provider key) ---------------------------

ADMIN_KEY = f"{SECRET}-admin"
CLIENT_KEY = f"{SECRET}-client"
PROVIDER_KEY = "sk-secret-provider-key"  # what lmfleet.testing.gateway_fakes puts in the provider's variable
GATEWAY_GETS = ["/admin/state", "/admin/tenants", "/admin/usage", "/admin/dashboard.json", "/ready", "/metrics",
                "/health", "/v1/models", "/admin/profile/snapshot"]


@pytest.mark.usefixtures("close_started_gateways")
async def test_gateway_answers_and_logs_never_show_a_key(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    provider_saw: list[str] = []

    def provider(req: httpx.Request) -> httpx.Response:
        provider_saw.append(req.headers.get("authorization", ""))
        return httpx.Response(200, json=chat_json(json.loads(req.content)["model"], "Remote."))

    gw = make_gateway(tmp_path, lambda req: httpx.Response(200, json=chat_json("m")), {"p": provider},
                      api_keys={CLIENT_KEY}, admin_key=ADMIN_KEY)
    client = await started_client(gw)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    seen = []
    for path in GATEWAY_GETS:
        r = await client.get(path, headers=admin)
        seen.append(f"{path} {r.status_code} {r.headers} {r.text}")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"})
    seen.append(f"chat {r.status_code} {r.headers} {r.text}")
    r = await client.post("/admin/overflow", json={"mode": "force_on"}, headers=admin)
    seen.append(f"overflow {r.status_code} {r.text}")
    r = await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"})
    seen.append(f"chat via provider {r.status_code} {r.headers} {r.text}")
    r = await client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer wrong"})
    seen.append(f"refused {r.status_code} {r.text}")
    assert provider_saw == [f"Bearer {PROVIDER_KEY}"]  # the provider path really ran, with its key
    text = "\n".join(seen) + "\n" + "\n".join(rec.getMessage() for rec in caplog.records)
    for secret in (SECRET, PROVIDER_KEY):
        assert secret not in text, text


# ---- the rules themselves ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("hf_token", True), ("apiKey", True), ("x-api-key", True), ("PGPASSWORD", True),
    ("client_secret", True), ("accessToken", True), ("sig", True), ("Authorization", True), ("api_keys", True),
    ("api_key_env", False), ("password_env", False), ("api_keys_file", False), ("auth_token_path", False),
    ("key_path", False), ("max_num_batched_tokens", False), ("first_token_s", False), ("tokens_per_minute", False),
    ("AWS_ACCESS_KEY_ID", False), ("monkey", False), ("tokenizer", False), ("base_url", False),
])
def test_is_secret_name(name, secret):
    assert is_secret_name(name) is secret


@pytest.mark.parametrize("url, shown", [
    ("postgresql://lmfleet:pw1234@db:5432/x", "postgresql://lmfleet:***@db:5432/x"),
    ("postgresql://lmfleet@db/x", "postgresql://lmfleet@db/x"),
    ("postgresql://u:pa/ss@word@db/x", "postgresql://u:***@db/x"),
    ("https://h:4318/v1?api_key=k123&x=1", "https://h:4318/v1?api_key=***&x=1"),
    ("https://host:8080/v1", "https://host:8080/v1"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("text, shown", [
    ("export HF_TOKEN=abc123 && pip install x", "export HF_TOKEN=*** && pip install x"),
    ("huggingface-cli login --token abc123 --add", "huggingface-cli login --token *** --add"),
    ("curl -H 'Authorization: Bearer abc123' https://x", "curl -H 'Authorization: Bearer ***' https://x"),
    ("ray start --token-file /a/b --num-cpus=4 RAY_AUTH_MODE=token", "ray start --token-file /a/b --num-cpus=4 "
     "RAY_AUTH_MODE=token"),
    ("see https://a:pw1234@c and PATH=/usr/bin", "see https://a:***@c and PATH=/usr/bin"),
])
def test_redact_text(text, shown):
    assert redact_text(text) == shown


def test_redact_keeps_empty_values_and_names():
    data = {"env": {"HF_TOKEN": "t0ken", "NCCL_DEBUG": "INFO", "EMPTY_TOKEN": ""}, "api_key_env": "OPENAI_KEY",
            "hf_token": None, "urls": ["https://u:p4ss@h"]}
    assert redact(data) == {"env": {"HF_TOKEN": MASK, "NCCL_DEBUG": "INFO", "EMPTY_TOKEN": ""},
                            "api_key_env": "OPENAI_KEY", "hf_token": None, "urls": ["https://u:***@h"]}


def test_secret_values_and_env_secrets():
    raw = {"ledger": {"url": "postgresql://a:pw/12345@h/d"}, "providers": [{"api_key_env": "sk-pasted-key"}],
           "env": {"HF_TOKEN": "hf_abcd"}, "gateway": {"admin_key_env": "ADMIN"}}
    assert {"pw/12345", "12345", "sk-pasted-key", "hf_abcd"} <= secret_values(raw)
    assert "ADMIN" not in secret_values(raw)
    dump = {"gateway": {"admin_key_env": "ADMIN", "api_keys_env": "KEYS"}, "providers": [{"api_key_env": "UNSET"}]}
    assert env_secrets(dump, {"ADMIN": "adm-1", "KEYS": "k-1, k-2", "OTHER": "x"}) == {"adm-1", "k-1, k-2", "k-1",
                                                                                       "k-2"}
