"""Ways in other than the Python API: `nanoserve run-batch` over OpenAI Batch files."""
