"""OpenAI's Responses API: create, retrieve, cancel; which worker stored which response."""
