"""The worker replica: the Serve deployment around `AsyncEngine`, its cache-event pump, and the
client the ingress reaches replicas with."""
