"""``python -m pagedllm.serving [flags]``: the OpenAI-compatible server, as ``pagedllm serve``."""

import sys

from pagedllm.serving.cli import main

raise SystemExit(main(["serve", *sys.argv[1:]]))
