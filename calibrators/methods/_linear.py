"""Vector, matrix and Dirichlet scaling, penalised towards temperature scaling.

All three fit ``u = W phi(z) + b`` by minimising the mean NLL plus a ridge
penalty centred on temperature scaling, ``W = beta I, b = 0`` (``beta`` the
temperature-scaling optimum on the same features, fitted first)::

    loss(W, b) = mean_n [logsumexp(u_n) - u_n,y_n]
                 + lam / (K (K - 1)) * sum_{i != j} W_ij**2
                 + lam / K * sum_i (W_ii - beta)**2
                 + mu / K * sum_j b_j**2

The off-diagonal and bias terms are ODIR's (Kull et al., 2019); ODIR leaves the
diagonal free, here ``lam`` pulls it to ``beta`` too (vector scaling has only
this diagonal part). With ``lam = mu = inf`` the model is temperature scaling
itself, so the penalty path runs from temperature scaling (strongest) to the
unpenalised model (weakest), and the search can choose either end. The
gradient is analytic, ``dloss/dW = (P - Y)^T phi(z) / N + penalty'``, and the
problem is solved by scipy's L-BFGS-B from temperature scaling, in variables
whitened per class by the curvature of the loss (``PenalisedSoftmax.solve``):
the log-probability features of Dirichlet scaling make the plain problem badly
conditioned.

When ``reg_lambda`` / ``reg_mu`` are not given they are chosen by k-fold
cross-validation: stage 1 walks ``lam`` with ``mu`` tied to it, starting at
temperature scaling (both infinite; not solved, scored as it is) and then down
the grid, strongest first; stage 2 walks ``mu`` at the chosen ``lam``. Within
each fold each fit is warm-started from its neighbour's solution (so it starts
near its own optimum; ``bench/odir.py`` measures what that saves). A walk stops
after ``PATIENCE`` candidates worse than the best by more than ``NOISE``
standard errors of their paired per-row difference (differences the rows cannot
tell from zero do not stop it); while the weakest candidate is the best it goes
on past the grid, ``EXTEND_FACTOR`` weaker at a time, up to ``EXTEND_STEPS``
times. After each stage a finer second pass tries the chosen penalty times and
divided by ``REFINE_FACTOR`` (``sqrt(10)``, half a step of the grid): the CV NLL
along the grid is not always unimodal. The candidate with the lowest CV NLL of
both stages wins (temperature scaling included: ``fit_info_["temperature_scaling"]``),
and the final model is refitted on all rows at its penalties. The folds share
``beta``, fitted on all rows: temperature scaling has seen every held-out fold, a
small bias towards keeping it. Everything is deterministic for a given ``seed``.
``bench/search_splits.py`` measures every method against temperature scaling on
the 5-split protocol.

References
----------
Kull, Perello-Nieto, Kängsepp, Silva Filho, Song, Flach. "Beyond temperature
scaling: Obtaining well-calibrated multiclass probabilities with Dirichlet
calibration", NeurIPS 2019.
"""

from __future__ import annotations

import math
import time
from typing import ClassVar

import numpy as np

from calibrators.base import Progress
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes, lbfgs_bytes
from calibrators.linear_softmax import LinearSoftmax
from calibrators.methods.temperature import TemperatureScaler
from calibrators.numerics import map_rows, n_threads, single_threaded_blas
from calibrators.options import Integer, Positive, check_grid
from calibrators.solvers.crossval import NOISE, cross_validate_path, fold_assignment
from calibrators.solvers.penalised import BLOCK_ROWS, MAX_BLOCK_CLASSES, PenalisedSoftmax
from calibrators.validation import (
    INT64_MAX,
    INT64_MIN,
    MAX_FOLDS,
    MAX_ITERATIONS,
    CalibrationInputError,
    logits64,
)

#: Default penalty grid (both lam and mu), strongest first. The penalties are
#: normalised by the number of entries, so useful values are large.
DEFAULT_GRID = (1e5, 1e4, 1e3, 1e2, 10.0, 1.0)
#: L-BFGS tolerance inside the search (only the ranking of candidates matters).
CV_TOL = 1e-6
#: While the weakest candidate tried is the best, the walk goes on past the grid's
#: weakest value, each step this factor weaker, at most EXTEND_STEPS steps.
EXTEND_FACTOR = 10.0
EXTEND_STEPS = 4
#: After each stage of the search, the chosen penalty times and divided by this
#: factor are tried too (None: no second pass; ``bench/odir.py --refine``).
REFINE_FACTOR = math.sqrt(10)

class _Problem(PenalisedSoftmax):
    """The penalised NLL of the module docstring: ``off = lam / (K (K - 1))``, ``diag =
    lam / K`` with the diagonal pulled to ``beta`` (temperature scaling's inverse
    temperature on the same features), ``bias = mu / K``.

    ``lam = mu = inf`` is temperature scaling itself, ``W = beta I, b = 0``:
    :meth:`solve` returns it without solving.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, structure: str, lam: float, mu: float,
                 beta: float = 1.0):
        if math.isinf(lam) != math.isinf(mu):
            raise ValueError(f"lam and mu must be both infinite or both finite. Got {lam}, {mu}.")
        k = x.shape[1]
        super().__init__(x, y, structure, off=lam / (k * (k - 1)), diag=lam / k, bias=mu / k,
                         target=beta)
        self.lam, self.mu = lam, mu
        self.temperature = self.at_centre()



class LinearScaler(LinearSoftmax):
    """Shared fitting of the vector/matrix/Dirichlet scalers (see module docstring).

    Parameters
    ----------
    reg_lambda : float, optional
        Weight of the penalty on ``W - beta I`` (``beta``: temperature scaling's
        inverse temperature), its off-diagonal and diagonal parts each normalised
        by their number of entries; 0 or more; chosen by cross-validation when
        None.
    reg_mu : float, optional
        Weight of the penalty on the bias, 0 or more; chosen by cross-validation
        when None.
    grid : sequence of float, default=DEFAULT_GRID
        Candidate penalty weights for the cross-validation (stored in
        ``to_params()`` sorted, strongest first, without repeats).
    n_folds : int, default=3
        2 to 1,000 (``MAX_FOLDS``).
    seed : int, default=0
        Seed of the fold assignment (``numpy.random.default_rng``): an int64, >= 0
        when a penalty is cross-validated.
    max_iter : int, default=1000
        L-BFGS iterations per fit; 1 to 1,000,000 (``MAX_ITERATIONS``).
    tol : float, default=1e-9
        L-BFGS tolerance on the relative loss decrease and projected gradient.
    """

    has_bias = True
    option_checks: ClassVar[dict] = {
        "reg_lambda": Positive(allow_zero=True, allow_none=True),
        "reg_mu": Positive(allow_zero=True, allow_none=True),
        "grid": check_grid,
        "n_folds": Integer(2, MAX_FOLDS),
        "seed": Integer(INT64_MIN, INT64_MAX),
        "max_iter": Integer(1, MAX_ITERATIONS),
        "tol": Positive(),
    }

    def __init__(
        self,
        *,
        reg_lambda: float | None = None,
        reg_mu: float | None = None,
        grid=DEFAULT_GRID,
        n_folds: int = 3,
        seed: int = 0,
        max_iter: int = 1000,
        tol: float = 1e-9,
    ):
        self.reg_lambda = reg_lambda
        self.reg_mu = reg_mu
        self.grid = grid
        self.n_folds = n_folds
        self.seed = seed
        self.max_iter = max_iter
        self.tol = tol

    def checked_options(self) -> dict:
        options = super().checked_options()
        searched = options["reg_mu"] is None or options["reg_lambda"] is None
        if searched and options["seed"] < 0:
            raise CalibrationInputError(
                "seed must be an integer >= 0 when a penalty is chosen by cross-validation "
                f"(reg_lambda or reg_mu None). Got {options['seed']!r}."
            )
        return options

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: float64 copies of the scores, and for a
        full ``W`` the solver's ``K**2``-sized state.

        ``P`` parameters (``2 K`` diagonal, ``K**2 + K`` full); ``F`` folds, ``T =
        min(F, n_threads())`` of them fitted at once; ``b = min(N, BLOCK_ROWS)``.
        The solver holds ``S = 2 lbfgs_bytes(P, 20) + 8 * 30 P + B``: two L-BFGS-B
        workspaces (a result and the next solve), parameter-sized temporaries and
        the whitening ``B`` of a full ``W``: ``4 * 8 K (K + 1)**2 + 2 * 8 b K``
        (per-class curvature blocks, their Cholesky factors and inverses) up to
        ``MAX_BLOCK_CLASSES`` classes; above, that term at ``MAX_BLOCK_CLASSES`` (a
        bound that keeps the model non-decreasing in K) plus ``8 (6 K (K + 1) + 4 b
        (K + 1))`` (diagonal + rank-1 factors); for a diagonal ``W`` (whitened by its 2 x
        2 blocks) ``4 * 8 b K``, the blocks' temporaries.

        * bytes = ``8 N K + max(2 * 8 N K + S, T * fold, temperature) + 8 C (F P + N)
          + chunk_bytes(1, K, threads=1)``: the features; the final fit's logits
          and softmax, or ``fold = 8 N K (3 (F - 1) + 1) / F + S`` (a fold's copies
          and temporaries) when a penalty is cross-validated (else 0), or the
          temperature fit on the features (``min(chunk_bytes(3, K), 3 * 8 N K) + 32
          N``: its model, its chunks bounded by the rows);
          the fold solutions and per-row held-out NLLs of the ``C`` candidates
          tried (per searched penalty ``len(grid) + EXTEND_STEPS``, 2 more with
          ``REFINE_FACTOR``; 1 more, temperature scaling, when ``mu`` is
          searched); a chunk of slack for small temporaries.
        * flops = the temperature fit's + ``100 (1 + C F / 2) (4 N K**2 + SWEEP_FLOPS
          N K)`` for a full ``W`` (without ``4 N K**2`` for a diagonal one): about
          100 loss evaluations per solve, the warm-started fold solves about half
          as many.
        """
        n, k = n_samples, n_classes
        full = cls.structure == "full"
        params = k * k + k if full else 2 * k
        folds = options["n_folds"]
        searched = [options["reg_mu"] is None, options["reg_lambda"] is None]
        candidates = sum(searched) * (
            len(options["grid"]) + EXTEND_STEPS + (2 if REFINE_FACTOR else 0)
        ) + int(searched[0])
        temperature = TemperatureScaler.fit_cost(n, k, TemperatureScaler().checked_options())
        rows = min(n, BLOCK_ROWS)
        whitening = 4 * FLOAT64 * rows * k  # a diagonal W's 2 x 2 blocks: their temporaries
        if full:
            kb = min(k, MAX_BLOCK_CLASSES)
            whitening = 4 * FLOAT64 * kb * (kb + 1) ** 2 + 2 * FLOAT64 * rows * kb
            if k > MAX_BLOCK_CLASSES:
                whitening += FLOAT64 * (6 * k * (k + 1) + 4 * rows * (k + 1))
        solver = 2 * lbfgs_bytes(params, 20) + 30 * FLOAT64 * params + whitening
        scores = FLOAT64 * n * k
        fold = scores * (3 * (folds - 1) + 1) / folds + solver if candidates else 0
        threads = min(folds, n_threads())
        # the temperature fit's chunks, on the N rows of held features
        centre = min(chunk_bytes(3, n_classes=k), 3 * scores) + 4 * FLOAT64 * n
        memory = scores + max(2 * scores + solver, threads * fold, centre) + (
            FLOAT64 * candidates * (folds * params + n) + chunk_bytes(1, n_classes=k, threads=1)
        )
        evaluation = (4.0 * n * k * k if full else 0.0) + SWEEP_FLOPS * n * k
        return Cost(bytes=int(memory), flops=temperature.flops
                    + 100.0 * (1 + candidates * folds / 2) * evaluation)

    def _features(self, x: np.ndarray, kind: str) -> np.ndarray:
        """``phi`` of the validated scores, float64 (N, K), in row blocks."""
        return map_rows(lambda block: self._phi(logits64(block, kind)), x)

    def _cross_validate(self, feats, y, fold_of, candidates, warm, progress, beta):
        """:func:`cross_validate_path` of the penalised problems (``candidates``: (lam,
        mu) pairs), the diagonal pulled to ``beta``."""
        return cross_validate_path(
            lambda x, yy, cand: _Problem(x, yy, self.structure, *cand, beta=beta),
            feats, y, fold_of, candidates, warm, progress,
            max_iter=self.max_iter, tol=max(self.tol, CV_TOL),  # options as validated by fit
            noise=NOISE, solve_options=self._solve_options(),
        )

    def _solve_options(self) -> dict:
        """A diagonal W is whitened by its exact 2 x 2 (w_i, b_i) curvature blocks
        (:meth:`PenalisedSoftmax.solve`): log-probability features couple the two."""
        return {"diagonal_blocks": True} if self.structure == "diagonal" else {}

    def _fit(self, x: np.ndarray, y: np.ndarray, *, kind: str, options: dict,
             progress: Progress) -> dict:
        with single_threaded_blas():
            return self._fit_penalised(x, y, kind, options, progress)

    def _fit_penalised(self, x, y, kind, opts, progress) -> dict:
        started = time.perf_counter()
        feats = self._features(x, kind)
        n, _ = feats.shape
        grid = opts["grid"]
        # The centre of every penalty: temperature scaling on the same features.
        beta = float(TemperatureScaler().fit(feats, y).weight_)
        lam = opts["reg_lambda"]
        mu = opts["reg_mu"]
        tied = mu is None  # stage 1 moves mu with lam
        # Stage 1: lam along the grid with mu tied to it, temperature scaling (both
        # infinite) first; stage 2: mu along the grid at the chosen lam. A given
        # penalty skips its stage.
        stages = []
        if lam is None:
            stages.append("lam")
        if mu is None:
            stages.append("mu")
        total = len(stages) * (len(grid) + 1) * opts["n_folds"] + 1
        done = [0]

        def tick(fits):
            done[0] += fits
            progress(min(0.95, 0.95 * done[0] / total))

        evaluations = 0
        tried = []  # (stage, (lam, mu), cv_nll, fold solutions), every candidate scored
        if stages:
            if n < 2 * opts["n_folds"]:
                raise CalibrationInputError(
                    f"cross-validating the penalties needs at least {2 * opts['n_folds']} rows; "
                    f"give reg_lambda and reg_mu explicitly for tiny sets. Got {n} rows."
                )
            fold_of = fold_assignment(n, opts["n_folds"], opts["seed"])
            warm = [None] * opts["n_folds"]

            def walk(stage, cands, start, report):
                scores, thetas, evals = self._cross_validate(
                    feats, y, fold_of, cands, start, report, beta)
                tried.extend((stage, c, sc, th)
                             for c, sc, th in zip(cands, scores, thetas, strict=False))
                return scores, thetas, evals

            for stage in stages:
                if stage == "lam":
                    cands = [(g, g if tied else mu) for g in grid]
                    if tied:
                        cands.insert(0, (math.inf, math.inf))
                else:
                    # at the chosen lam; after temperature scaling, the strongest finite one
                    at = lam if lam is None or math.isfinite(lam) else grid[0]
                    cands = [(at, g) for g in grid]

                def weaker(cand, f, stage=stage):
                    a, b = cand
                    return (a * f, b * f if tied else b) if stage == "lam" else (a, b * f)

                scores, thetas, evals = walk(stage, cands, warm, tick)
                evaluations += evals
                best = int(np.argmin(scores))
                # Past the grid's weakest value while the weakest tried is the best.
                extended = 0
                while best == len(cands) - 1 and extended < EXTEND_STEPS:
                    cands = [*cands, weaker(cands[-1], 1.0 / EXTEND_FACTOR)]
                    more, sols, evals = walk(stage, cands[-1:], thetas[-1], lambda _: None)
                    evaluations += evals
                    scores, thetas = scores + more, thetas + sols
                    best, extended = int(np.argmin(scores)), extended + 1
                if REFINE_FACTOR and math.isfinite(cands[best][1]):
                    # A finer pass: the chosen value times and divided by the factor
                    # (the tie of stage 1 kept), each warm-started from the choice.
                    for f in (REFINE_FACTOR, 1.0 / REFINE_FACTOR):
                        _, _, evals = walk(stage, [weaker(cands[best], f)], thetas[best],
                                           lambda _: None)
                        evaluations += evals
                chosen = min((t for t in tried if t[0] == stage), key=lambda t: t[2])
                lam, mu = chosen[1]
                warm = chosen[3]
            _, (lam, mu), _, warm = min(tried, key=lambda t: t[2])
        prob = _Problem(feats, y, self.structure, lam, mu, beta=beta)
        # The final fit starts from the mean of the folds' solutions at the
        # chosen penalties (each fold path itself started from temperature scaling).
        start = prob.initial() if not stages else np.mean(warm, axis=0)
        res = prob.solve(start, max_iter=opts["max_iter"], tol=opts["tol"],
                         **self._solve_options())
        evaluations += prob.evaluations
        w, b = prob.unpack(res.x)
        self.weight_, self.bias_ = w.copy(), b.copy()
        progress(1.0)

        def finite(value):
            return value if value is None or math.isfinite(value) else None

        cv = [{"stage": stage, "reg_lambda": finite(a), "reg_mu": finite(b),
               "cv_nll": float(sc)} for stage, (a, b), sc, _ in tried]
        return {
            "reg_lambda": finite(lam),
            "reg_mu": finite(mu),
            "temperature_scaling": prob.temperature,
            "temperature": 1.0 / beta,
            "converged": bool(res.success),
            "message": str(res.message),
            "iterations": int(res.nit),
            "loss": float(res.fun),
            "gradient_max": float(np.max(np.abs(res.jac))),
            "evaluations": evaluations,
            "seconds": time.perf_counter() - started,
            "cross_validation": {"n_folds": opts["n_folds"], "candidates": cv} if cv else None,
        }
