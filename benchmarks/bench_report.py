"""What every benchmark script does last: write its numbers as JSON when asked (--json PATH)."""

import json
from pathlib import Path


def write_json(results: dict, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
