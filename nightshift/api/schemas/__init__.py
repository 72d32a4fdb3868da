"""Pydantic request/response schemas, field for field as the official openai client models them."""
