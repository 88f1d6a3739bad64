"""The error every config check raises: one line naming where, which key and what is allowed. A leaf, so the
schema, its rules and the loader all import it without importing each other."""


class ConfigError(ValueError):
    """One-line message: where, which key, what is allowed."""
