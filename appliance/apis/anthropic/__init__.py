"""Anthropic's Messages API and its count_tokens."""
