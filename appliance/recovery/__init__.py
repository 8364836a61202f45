"""What an engine fault costs a request: a pause, not an error, and never a crash loop.

The relay (appliance/proxy/relay.py) stays the one owner of a request through its replays; this
package holds what it consults: whether a failure was the engine's death and when a new worker
serves (replay.py), the generic record a stream keeps to continue on the new worker, from its
token ids (stream.py) or, where its protocol gives none, from its text (text.py), and the
requests not to send again (quarantine.py). How each protocol continues
its own stream lives with that protocol (appliance/apis/<family>/resume.py).
"""
