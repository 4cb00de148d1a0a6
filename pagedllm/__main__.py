"""``python -m pagedllm ...`` runs the command-line interface."""

from pagedllm.serving.cli import main

raise SystemExit(main())
