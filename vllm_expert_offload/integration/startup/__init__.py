"""Engine startup: worst-case profiling, crash line, readiness smoke, worker RPCs."""
