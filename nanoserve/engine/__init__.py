"""Request path: sequence -> block_manager -> scheduler -> model_runner -> llm_engine."""
