"""Celery app, tasks and the per-process engine host. The tasks own the transactions: the
flows that need several (ingest, shard_stream, finalize, batch_upkeep, schedule_runs) open
one session per step here, around the domain functions of jobs/."""
