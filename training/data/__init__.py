"""Corpora of the project's own target model: domains and splits."""

DOMAINS = ("code", "chat", "math")
SPLITS = ("train", "val", "test")
