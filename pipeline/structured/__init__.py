"""Structured outputs: a request's constraint (JSON Schema, regex, choice, grammar), the
grammar engine's masks per row, and the JSON checks a grammar cannot make."""
