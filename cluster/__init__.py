"""What crosses processes: cache-event transport, the cluster cache index, Ray bootstrap."""
