"""chat-appliance's supervisor: the process that owns the vLLM worker and hosts the API."""
