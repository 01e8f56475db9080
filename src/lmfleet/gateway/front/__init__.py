"""The front door: a request from its first byte until it is routed (see pipeline.py)."""
