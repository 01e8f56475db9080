"""`lmfleet check` warns about unauthenticated replica ports on public-looking node addresses."""

from __future__ import annotations

import pytest

from lmfleet.check.exposure import check_replica_exposure, is_public_address
from lmfleet.check.result import Status
from lmfleet.config import parse_config


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True),
    ("34.120.1.7", True),
    ("2606:4700::1111", True),
    ("::ffff:8.8.8.8", True),  # IPv4-mapped public
    ("127.0.0.1", False),
    ("::1", False),
    ("10.0.0.1", False),
    ("172.16.5.4", False),
    ("192.168.1.10", False),
    ("100.64.0.1", False),  # carrier-grade NAT
    ("169.254.10.1", False),  # link-local
    ("fe80::1", False),
    ("fd00::1", False),  # unique local
    ("192.0.2.2", False),  # documentation range
    ("0.0.0.0", False),
    ("224.0.0.1", False),  # multicast
    ("::ffff:10.0.0.1", False),
    ("head.example.com", False),  # names are not judged
    ("", False),
])
def test_is_public_address(address, public):
    assert is_public_address(address) is public


def fleet(proxy="haproxy"):
    return parse_config({"gateway": {"serve_proxy": proxy}, "models": [{"name": "m", "source": "builtin:tiny-random"}]})


@pytest.mark.parametrize("proxy, addresses, joined, statuses", [
    ("haproxy", ["10.0.0.1", "8.8.8.8", "8.8.8.8", "1.1.1.1"], True, [("1.1.1.1", Status.WARN), ("8.8.8.8", Status.WARN)]),
    ("haproxy", ["10.0.0.1", "192.168.0.2"], True, [("cluster", Status.PASS)]),
    ("haproxy", ["8.8.8.8"], False, [("cluster", Status.PASS)]),  # a local head binds loopback
    ("serve", ["8.8.8.8"], True, [("cluster", Status.SKIP)]),
])
def test_check_replica_exposure(proxy, addresses, joined, statuses):
    results = check_replica_exposure(fleet(proxy), addresses, joined=joined)
    assert [(r.subject, r.status) for r in results] == statuses
    for r in results:
        if r.status is Status.WARN:
            assert "without authentication" in r.message and "serve_proxy: serve" in r.fix
