"""OpenAI's chat and completions (and SageMaker-style /invocations, the model list)."""
