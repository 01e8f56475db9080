"""What the gateway records: metrics, the cost ledger, traces, the event loop's health."""
