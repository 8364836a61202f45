"""Crash forensics: what an engine death leaves on disk (`bundles`), gathered when it happens
(`recorder`), with a hung engine's stacks (`stacks`); `chat-appliance crashes` reads them
(`command`)."""
