"""The contract shared by router and listener: prefix key, events, SSE, the event bus."""
