"""Serving: the command-line interface now; the OpenAI-compatible HTTP server in a later issue."""
