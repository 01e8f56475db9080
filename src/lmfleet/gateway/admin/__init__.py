"""The operator's side: the admin API, health and metrics routes, the dashboard, profiling."""
