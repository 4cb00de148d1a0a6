"""The benchmark scripts: the paper's tables, the throughput race, the GPU check.

They import each other as ``pagedllm.benchmarks.<script>``: in a source checkout every top-level
folder is searched for pagedllm's sub-packages (``pagedllm/__init__.py``), so the same import
works when a script is run by path, loaded by path or imported, with an editable install or
with the checkout on PYTHONPATH. They are not part of the installed distribution.

Their long loops draw progress bars on stderr when it is a terminal, and none in CI logs
(``progress.py`` says the rule; PAGEDLLM_PROGRESS=1 or 0 forces them on or off).
"""
