import os

# no model hub and no telemetry: everything the tests use is built locally
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
