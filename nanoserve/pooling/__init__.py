"""Embeddings (runner="pooling"): the runner choice, the checkpoint's pooling, pooling requests, and
the bodies of LLM.embed / encode / embed_stream. The pooler itself is nanoserve/layers/pooler.py."""
