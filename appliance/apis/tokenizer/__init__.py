"""The worker's tokenizer routes (tokenize, detokenize, tokenizer_info) and its version."""
