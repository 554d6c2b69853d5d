"""Paged KV caches: page formats, cache groups, allocation and writers."""
