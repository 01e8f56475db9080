"""The ``lmfleet`` command line: one module per command group, tied together in :mod:`lmfleet.cli.main`.

The commands that run a fleet import the gateway and the serve runner (FastAPI, Ray, vLLM's tokenizers: seconds)
inside the command function, not at module level, so that ``lmfleet --help`` and the light commands (``config``,
``check --offline``, ``cluster up``) do not pay for them. Those imports carry a comment that points here.
"""
