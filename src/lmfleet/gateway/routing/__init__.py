"""Where a request may go: the routing decision and the backends it chooses from."""
