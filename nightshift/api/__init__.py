"""Nightshift HTTP API: OpenAI-compatible /v1/files and /v1/batches.

The API layer is thin: it parses and answers HTTP; the domain work lives in jobs/.
"""
