"""The embedding engine: `from nightshift.engine.embeddings import EmbeddingEngine`.

engine.py (the entry point) with config.py (every default) and types.py; model_files.py (where
the model is and what its sentence-transformers files say), tokenization.py, weights.py and
bert.py (the padding-free encoder) with varlen.py (the batch layout and attention), or
decoder.py (decoder embedding models, e.g. Qwen3-Embedding, on engine/models/' decoders);
batching.py (length-sorted steps under a token budget); pooling.py.
"""
from nightshift.engine.embeddings.config import EmbeddingEngineConfig
from nightshift.engine.embeddings.engine import EmbeddingEngine
from nightshift.engine.embeddings.model_files import read_model_files, resolve_embedding_model
from nightshift.engine.embeddings.types import EmbeddingInput, EmbeddingOutput, EmbeddingRequest, EmbeddingStats

__all__ = ["EmbeddingEngine", "EmbeddingEngineConfig", "EmbeddingInput", "EmbeddingOutput", "EmbeddingRequest",
           "EmbeddingStats", "read_model_files", "resolve_embedding_model"]
