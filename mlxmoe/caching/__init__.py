"""The expert cache and what feeds it: slot pools and residency (cache), the eviction policies,
prefetch, the streaming expert layer (experts), counters, and the opt-in lossy modes."""
