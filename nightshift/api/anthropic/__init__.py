"""Anthropic's Message Batches API (/v1/messages/batches) over the same batches as /v1/batches:
its routes (routes.py) and its error envelope (errors.py)."""
