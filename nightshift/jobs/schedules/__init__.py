"""Schedules: cron jobs that turn documents into batches, fire once per due time, and index
only what changed since the last successful run."""
