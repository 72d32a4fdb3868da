"""Batches: the state machine and its API, ingest (validation, tokenization, shard planning),
shard leases, the OpenAI request/response mapping, finalize and the reconciler's rules."""
