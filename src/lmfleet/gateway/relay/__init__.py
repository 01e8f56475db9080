"""Running a request: attempts against its backends and the relay of their answer."""
