"""`lmfleet check`: find a fleet's failures before deployment.

Layout: pure decisions (``planner``, ``parallelism``, ``memory``, ``timeouts``, ``tokenizer``, and the
``check_*`` functions of ``cluster``), the Ray edge (``cluster.gather_inventory``/``measure_links``, over the
node probes of :mod:`lmfleet.cluster.nodes`), and ``runner``/``report`` that tie them to the CLI. The GPU
presets are :mod:`lmfleet.config.gpus`.
"""
