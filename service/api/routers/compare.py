"""/v1/models/{model}/compare: is model B model A at another temperature?

Both are datasets of the model (uploaded as any dataset, with or without labels): the
scores of two models on the same positions, in the same order (a base model and its
fine-tuned checkpoint, a full-precision model and its quantized build). Stored
datasets rather than one upload carrying both: a team compares several checkpoints
against one base, so the base is uploaded once (identical content is the same
dataset), every upload takes the bounded, streamed path of datasets at language-model
K, and a comparison with another ``top_k`` costs no upload. K is the model's, so the
two always agree on it, and their scores were checked finite at upload.
"""

from __future__ import annotations

import math

import numpy as np
from fastapi import APIRouter, Depends

from calibrators.evaluation.pair import temperature_explains
from service.api.deps import ModelDep, SessionDep, StateDep
from service.api.schemas import CompareOut, CompareRequest
from service.api.uploads import require_json
from service.errors import InvalidInput
from service.server import budget
from service.server.budget import declare
from service.storage import registry

router = APIRouter(prefix="/v1/models/{model}/compare", tags=["datasets"])

#: float64 arrays of N x K the comparison holds at once (A's logits, B's distribution
#: and the temporaries of one per-row KL): what the memory guard counts.
ARRAYS = 4


@declare(budget.Budget("predict", body="max_metadata_bytes"))
@router.post("", response_model=CompareOut, dependencies=[Depends(require_json)])
def compare(
    body: CompareRequest, model: ModelDep, session: SessionDep, state: StateDep
) -> CompareOut:
    """How much of B's difference from A one temperature explains: the ``beta`` that
    brings A closest to B in KL, KL(B || A) before and after it, top-1 agreement and the
    discordance of the ranks within B's top-k. 422 when the datasets do not hold the
    same number of rows, or the comparison needs more memory than a fit worker may use."""
    a = registry.find_dataset(session, model, body.a)
    b = registry.find_dataset(session, model, body.b)
    topk_rows = [d.id for d in (a, b) if d.top_k is not None]
    if topk_rows:
        raise InvalidInput(
            "comparing two models needs their full (N, K) scores, and dataset "
            f"{topk_rows[0]} holds top-k rows. Got a top-k dataset."
        )
    if a.n_rows != b.n_rows:
        raise InvalidInput(
            f"datasets {a.id} and {b.id} must hold the scores of the same positions: the "
            f"same number of rows. Got {a.n_rows} and {b.n_rows}."
        )
    if body.top_k > model.num_classes:
        raise InvalidInput(
            f"top_k must be at most the model's {model.num_classes} classes. "
            f"Got {body.top_k}."
        )
    need = ARRAYS * 8 * a.n_rows * model.num_classes
    limit = state.fits.config.memory_budget
    if limit and need > limit:
        raise InvalidInput(
            f"comparing {a.n_rows:,} x {model.num_classes:,} scores needs about "
            f"{need / 2**30:.3g} GiB, more than a fit worker's budget of "
            f"{limit / 2**30:.3g} GiB (WELLTEMPERED_FIT_MEMORY_BYTES): compare fewer "
            f"positions. Got {a.n_rows:,} rows."
        )
    result = temperature_explains(
        np.asarray(state.arrays.load(a.scores_sha256)),
        np.asarray(state.arrays.load(b.scores_sha256)),
        kind_a=a.kind, kind_b=b.kind, top_k=body.top_k,
    )
    beta = result["beta"]
    return CompareOut(
        model=model.name, a=a.id, b=b.id, **{**result, "beta": beta if math.isfinite(beta)
                                              else None}
    )
