"""Any transformers causal LM, by its `model_type`: pipeline stages for the Llama-style ones (`pipeline`)."""
