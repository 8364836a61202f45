"""vLLM's chat batch: many conversations under one set of parameters."""
