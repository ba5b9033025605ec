"""continuum-router: a KV-cache-aware HTTP router in front of LLM inference engines."""
