"""``lmfleet profile``: where a request's time goes (request anatomy) and engine traces from every replica.

Where things are::

    anatomy.py  the arithmetic: histogram sums -> per-model split of end-to-end time (pure)
    traces.py   vLLM's profiler on every replica (Ray Serve LLM broadcast) and trace files from every node
    client.py   what the CLI does against a running fleet: snapshots, built-in load, start/stop, downloads

The gateway serves it through /admin/profile/* (:mod:`lmfleet.gateway.admin.profile`); this package imports
nothing of the gateway.
"""

from lmfleet.profile.anatomy import Anatomy, Sums, anatomies, anatomy, diff, engine_sums, gateway_sums, render_table

__all__ = ["Anatomy", "Sums", "anatomies", "anatomy", "diff", "engine_sums", "gateway_sums", "render_table"]
