"""The worker replica: the Serve deployment around the engine, its cache-event pump, and the
client the ingress reaches replicas with."""
