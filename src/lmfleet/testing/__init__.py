"""Test and benchmark tooling, not product code: what lmfleet's tests and benchmarks both import.

- ``fast_openai_server``: a fake OpenAI server (raw asyncio) that streams at a chosen pace.
- ``fault_proxy``: a reverse proxy that injects faults between the gateway and an upstream.
- ``gateway_fakes``: the real gateway in front of fake backends served in-process.
- ``fleet``: start and stop the processes of a benchmark or e2e fleet (``lmfleet serve``, bare vLLM).
- ``flood``: a flooding client that runs as its own low-priority process.
- ``netns``: network-namespace hosts for multi-node tests on one machine.
- ``pg_server`` / ``pg_shared``: a throwaway embedded PostgreSQL server, and one shared per process.
- ``stats``: small helpers of load measurements (percentiles, CPU time).
"""
