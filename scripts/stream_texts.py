"""Write a text stream's items, in stream order, as JSON lines {"text": ...}: a file of "your own" inputs for
`rampserve prepare MODEL --data FILE` and `rampserve bench sim|live --data FILE` that holds real traffic.

    python scripts/stream_texts.py rt-drift rt-drift-texts.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rampserve.workloads.streams import get_stream


def main(name: str, out: Path) -> None:
    stream = get_stream(name)
    if stream.task != "text":
        raise SystemExit(f"{name} is a {stream.task} stream; this writes text streams")
    texts = stream.items(0, stream.length)
    out.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    print(f"wrote {len(texts)} texts of {name} ({stream.bootstrap_length} of them its bootstrap) to {out}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
