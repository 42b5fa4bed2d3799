"""Training loops of the project's own models (target now, drafters later)."""
