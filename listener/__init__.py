"""continuum-kv-listener: turns engine KV cache events into the router's prefix events."""
