"""Serving: the command-line interface (``cli``) and the OpenAI-compatible HTTP server
(``api_server`` over ``async_engine``, with ``protocol`` and ``metrics``)."""
