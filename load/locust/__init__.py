"""The locust suite (OpenAI-SDK users) and its headless run with a verdict."""
