"""The promise: a body starts at most once per key, and its receipt is replayed."""
