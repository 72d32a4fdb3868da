"""Celery app, tasks and the per-process engine host."""
