"""Serving: the command-line interface (``cli``) and the OpenAI-compatible HTTP server: the app
and its routes (``api_server``) behind its ``gate``, with ``request_mapping`` and ``responses``
on either side of the ``async_engine``, ``protocol``'s shapes and ``metrics``. ``launch`` loads
the model (``loader``, or ``data_parallel``'s replicas), builds the engine the app serves and
runs uvicorn (``server_thread``'s socket); ``messages`` are what threads and processes send.

The modules import each other as a DAG (tests/serving/test_import_graph.py checks it)::

    cli            -> launch (when serving), args, default_model
    launch         -> api_server, data_parallel, async_engine, loader, server_thread, metrics
    api_server     -> gate, request_mapping, responses, tokenization, async_engine, args,
                      loader, server_thread
    data_parallel  -> async_engine, loader, messages, metrics
    async_engine   -> messages, metrics
    gate, responses, tokenization, request_mapping -> protocol (responses -> async_engine,
                      gate -> responses, tokenization -> request_mapping)
    loader         -> default_model
"""
