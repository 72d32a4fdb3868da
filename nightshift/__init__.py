"""Nightshift: self-hosted, OpenAI-compatible batch inference (api, jobs, workers, engine, storage)."""
