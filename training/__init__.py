"""Offline pipelines over the tiers: corpora (`data/`), target and drafter training, evaluation (`eval/`)."""
