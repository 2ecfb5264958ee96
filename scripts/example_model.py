"""Write the README quickstart's files: `my.onnx` (a perceptron trained on scikit-learn's handwritten digits, its
input `pixels`: 64 FP32 numbers), `inputs.npy` (the digits, for `prepare --data`) and `request.json` (a v2 infer
request, for curl).

    python scripts/example_model.py [DIR]    # DIR: the current folder by default
"""

from __future__ import annotations

import sys
from pathlib import Path

from rampserve.zoo.digits import write_example

if __name__ == "__main__":
    for path in write_example(Path(sys.argv[1] if len(sys.argv) > 1 else ".")):
        print(f"wrote {path}")
