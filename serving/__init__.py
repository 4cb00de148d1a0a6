"""Serving: the command-line interface (``cli``) and the OpenAI-compatible HTTP server: the app
and its routes (``api_server``) behind its ``gate``, with ``request_mapping`` and ``responses``
on either side of the ``async_engine``, ``protocol``'s shapes and ``metrics``; ``launch`` loads
the model and runs it."""
