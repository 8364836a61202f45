"""Where borrowed internals live: each module here alone knows one dependency's internals.

A module in this folder is the only place the project leans on what another project does not
promise (a server's protocol class, a framework's private method, an engine's module paths and
flags). It offers the rest of the tree a small interface of the project's own, has a contract
test under tests/unit/fences/ that names it when a version bump breaks an assumption, and the
dependency has an upper version bound in pyproject.toml at the last version those tests passed.
"""
