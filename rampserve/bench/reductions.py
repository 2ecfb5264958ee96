"""How a text model's linear ramps should reduce a site's (tokens, hidden) activation: the first token or the mean
over the input's own tokens (`token_mean_masked`).

Both ramps are a linear head on a 768- (or 384-) wide vector: the same cost but for the reduction itself, a gather
against a sum over the input's tokens, microseconds beside an encoder layer. Each is trained as `prepare` trains it
(on the workload's bootstrap inputs, against the model's own answers) and scored on the distinct inputs of the
evaluation part, each weighted by how often the stream visits it: its agreement with the model's final answer, and
the share of inputs it can answer, most confident first, at 99% agreement (`exit_share_at`), which is what the
controller can take from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from rampserve.ramps.specs import spec_for
from rampserve.ramps.torch_reductions import reduce_activation
from rampserve.ramps.train import Features, TrainConfig, train_ramps
from rampserve.runtime.prepare import MIXED_AGREEMENT, bootstrap_inputs, exit_share_at, feeds_for
from rampserve.runtime.sources import ModelSource, load_trained
from rampserve.runtime.torch_backend import TorchBackend, site_activations
from rampserve.workloads.streams import get_stream

REDUCTIONS = ("first_token", "token_mean_masked")
BATCH = 32


@dataclass(frozen=True)
class ReductionSettings:
    model: str = "mpnet-rt"
    workload: str = "rt-drift"
    bootstrap_items: int = 8000  # as `prepare`
    small: bool = False
    train: TrainConfig = TrainConfig()


def _reduced(backend: TorchBackend, encoder, texts: list[str], sites: list[str], desc: str
             ) -> tuple[dict[tuple[str, str], torch.Tensor], torch.Tensor]:
    """Every site's activation reduced both ways, and the model's logits, for `texts` (run in order of length)."""
    order = np.argsort([len(t) for t in texts], kind="stable")
    parts: dict[tuple[str, str], list[torch.Tensor]] = {(s, r): [] for s in sites for r in REDUCTIONS}
    logits = []
    batches = (feeds_for(backend, encoder, [texts[i] for i in order[a:a + BATCH]])
               for a in range(0, len(order), BATCH))
    for activations, output in tqdm(site_activations(backend, batches, sites), total=-(-len(order) // BATCH),
                                    desc=desc, unit="batch"):
        for (site, how), chunks in parts.items():
            chunks.append(reduce_activation(activations[site], how).float())
        logits.append(output.float())
    back = torch.from_numpy(np.argsort(order))
    return {key: torch.cat(chunks)[back] for key, chunks in parts.items()}, torch.cat(logits)[back]


def run_reductions(settings: ReductionSettings) -> dict:
    started = time.perf_counter()
    source = ModelSource.parse(settings.model, small=settings.small)
    backend = TorchBackend(load_trained(source))
    sites = [s.value for s in backend.sites]
    bootstrap = bootstrap_inputs(settings.workload, settings.bootstrap_items, source)
    if bootstrap.task != "text":
        raise ValueError(f"{settings.workload} is not a text workload: token reductions concern text models")
    stream = get_stream(settings.workload)
    evaluation = stream.base_ids(stream.evaluation.start, stream.evaluation.stop)
    distinct, first, visits = np.unique(evaluation, return_index=True, return_counts=True)
    eval_texts = [stream.items(stream.evaluation.start + int(i), stream.evaluation.start + int(i) + 1)[0]
                  for i in first]
    train_x, train_logits = _reduced(backend, bootstrap.encoder, list(bootstrap.items), sites, "bootstrap")
    eval_x, eval_logits = _reduced(backend, bootstrap.encoder, eval_texts, sites, "evaluation")
    final = eval_logits.argmax(dim=1).numpy()
    weights = visits / visits.sum()
    per_visit = np.repeat(np.arange(len(distinct)), visits)
    results: dict[str, list[dict]] = {}
    for how in REDUCTIONS:
        width = train_x[(sites[0], how)].shape[1]
        specs = {s: spec_for("linear", (1, width), len(train_logits[0]), token_reduce=how) for s in sites}
        features = Features({s: train_x[(s, how)] for s in sites}, train_logits.argmax(dim=1), 0.0, train_logits)
        ramps, _ = train_ramps(features, specs, settings.train, progress=False)
        rows = []
        for site in sites:
            labels, errors = ramps[site].from_features(eval_x[(site, how)].numpy())
            correct = labels == final
            rows.append({"site": site, "agreement": float(weights @ correct),
                         "exit_share_at_99": exit_share_at(errors[per_visit], correct[per_visit], MIXED_AGREEMENT)})
        results[how] = rows
    return {"model": settings.model, "workload": settings.workload, "sites": sites,
            "bootstrap_inputs": len(bootstrap.items), "evaluation_inputs": int(len(distinct)),
            "evaluation_visits": int(visits.sum()), "agreement_for_exit_share": MIXED_AGREEMENT,
            "reductions": results, "seconds": round(time.perf_counter() - started, 1)}
