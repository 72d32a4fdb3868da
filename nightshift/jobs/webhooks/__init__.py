"""Webhooks: per-project endpoints told when a batch ends or a schedule run fails, with signed
deliveries retried until they succeed (at least once; the event id is the idempotency key)."""
