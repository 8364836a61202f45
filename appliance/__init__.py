"""chat-appliance's API: the Litestar app that speaks OpenAI to the LAN and applies policy."""
