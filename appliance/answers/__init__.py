"""The one writer of every error answer, and each API family's error shape."""
