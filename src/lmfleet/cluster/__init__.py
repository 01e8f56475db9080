"""Multi-node: Ray connection, cluster launcher files, joining workers, replica placement, node probes, status.

Where things are:
  connect.py    joins a Ray cluster or starts a local head                                (I/O)
  launcher.py   ``ray up`` file and the manual ``ray start`` commands from ``cluster:``   (pure)
  join.py       ``ray start --address`` for a hand-started worker, with the head's token  (pure)
  placement.py  placement groups for ray.serve.llm and the node plan for TP/PP/replicas (pure)
  gpu_probe.py  this machine's GPUs from NVML (standalone: no Ray, no lmfleet imports)
  nic_probe.py  this machine's RDMA ports from sysfs (standalone)
  nodes.py      runs those probes on every node of the connected cluster               (I/O)
  status.py     status data, parsers and rendering                                        (pure)
  probe.py      asks Ray, Ray Serve and the gateway for that status                       (I/O)

Nothing is imported here, so that ``gpu_probe`` and ``nic_probe`` can run on a node without lmfleet's
dependencies (``python -m lmfleet.cluster.gpu_probe``).
"""
