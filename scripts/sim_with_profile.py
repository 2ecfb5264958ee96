"""`bench sim --data` on a bundle prepared on the file, with another bundle's latency profile: the same simulated
costs, so that only the ramps differ (docs/own-data.md compares minilm-rt's ramps learnt from a file of rt-drift's
texts alone with the zoo's, which also learn from its in-domain texts).

    PYTHONPATH=. python scripts/sim_with_profile.py OWN_BUNDLE PROFILE_BUNDLE DATA OUT.json [SEEDS]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from rampserve.bench.sim import SimSettings, run_seeds
from rampserve.bundle_format.latency import LatencyProfile
from rampserve.bundle_format.manifest import read_manifest
from rampserve.runtime.bundle import write_profile


def main(own: Path, profiled: Path, data: Path, out: Path, seeds: int = 3) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / own.name
        shutil.copytree(own, copy)
        write_profile(copy, LatencyProfile.from_json(read_manifest(profiled)["profile"]))
        model = read_manifest(own)["meta"]["source"]["ref"]
        settings = SimSettings(model=model, data=data, bundle=copy, saturation=False, risk_step_sweep=())
        result = run_seeds(settings, seeds, progress=print)
    report = result.report() | {"bundle": str(own), "profile_of": str(profiled)}
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(result.summary["rampserve"], indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]),
         *(int(a) for a in sys.argv[5:]))
