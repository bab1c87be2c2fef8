"""radixcache inside serving engines.

- ``radixcache.integrations.sglang``: SGLang's prefix cache, selected with
  ``--radix-cache-backend radixcache`` (``docs/sglang-backend.md``).

Importing this package imports no engine; each engine's module imports its engine, and only
that module does.
"""
