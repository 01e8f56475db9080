"""`lmfleet check`: find a fleet's failures before deployment.

Layout: pure decisions (``planner``, ``parallelism``, ``memory``, ``timeouts``, ``tokenizer``, and the
``check_*`` functions of ``cluster``), the Ray edge (``cluster.probe_nodes``/``gather_inventory``/
``measure_links``; ``lmfleet cluster status`` reads GPUs through ``probe_nodes`` too), the GPU presets
(``gpus``), the node-local NVML probe (``gpu_probe``, standalone), and ``runner``/``report`` that tie them to the CLI.
"""
