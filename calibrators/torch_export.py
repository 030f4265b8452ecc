"""Every calibrator as a ``torch.nn.Module``: :func:`to_torch`.

For a team that serves its classifier in PyTorch: the calibrator becomes a module to
append to it (``torch.nn.Sequential(model, to_torch(cal))``), with the interface of
the ONNX graph (:mod:`calibrators.onnx_export`). Its ``forward(scores)`` takes a
tensor of shape (N, K), logits or, when built with ``kind="probabilities"``,
probabilities, and returns the tuple ``(probabilities, confidence, label,
entropy)``: ``probabilities`` (N, K), ``confidence`` and ``entropy`` (N,) in the
module's output dtype (float32 by default, like the ONNX graph), ``label`` int64
(N,), the first argmax of the calibrated logits.

The arithmetic is float64 inside, on float64 buffers holding the fitted numbers bit
for bit, whatever the input's dtype, as in the ONNX graph. Probabilities go in as
``log(max(p, PROBABILITY_FLOOR))``, the numpy path's rule; a ``-inf`` logit is read as
``LOG_FLOOR``, the ONNX graph's. Each map is the method's numpy ``_forward`` written
with torch operators, without data-dependent Python control flow, so that both
``torch.export.export`` (with a dynamic N) and ``torch.jit.script`` take every module.
Script, not trace: ``torch.jit.trace`` records the operators one example batch runs
and keeps its shape-derived Python numbers as constants, while ``script`` compiles
the code itself, so nothing depends on the batch it was traced with.

torch is an optional dependency (the ``torch`` extra): this module imports it, and
is the only one of ``calibrators`` that does; the service never imports this module
(import-linter contracts in pyproject.toml).

Examples
--------
>>> import torch
>>> from calibrators import from_params
>>> cal = from_params({"method": "temperature", "n_classes": 3, "weight": 0.5,
...                    "bias": None})
>>> p, confidence, label, entropy = to_torch(cal)(torch.tensor([[2.0, 0.0, 0.0]]))
>>> p.double().numpy().round(4).tolist(), label.tolist()
([[0.5761, 0.2119, 0.2119]], [0])
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from calibrators.base import Calibrator
from calibrators.linear_softmax import LinearSoftmax
from calibrators.methods.ets import EnsembleTemperatureScaler
from calibrators.methods.iop import FEATURE_RANKS, N_KNOTS, IntraOrderPreserving
from calibrators.methods.prior_shift import PriorShift
from calibrators.methods.pts import SQUASH, ParameterizedTemperatureScaler
from calibrators.methods.row_entropy import JUMP, STEPS, T_MAX, T_MIN, RowEntropyTemperature
from calibrators.methods.sms import StructuredMatrixScaler
from calibrators.methods.svs import StructuredVectorScaler
from calibrators.validation import KINDS, LOG_FLOOR, PROBABILITY_FLOOR, check_kind

__all__ = ["CalibratedScores", "to_torch"]


def _buffer(value) -> Tensor:
    """A float64 tensor holding ``value`` exactly."""
    return torch.from_numpy(np.array(value, dtype=np.float64))


def _log_softmax(z: Tensor) -> Tensor:
    return torch.log_softmax(z, dim=1)


class _Linear(nn.Module):
    """``W * phi(z) + b`` (:class:`calibrators.linear_softmax.LinearSoftmax`)."""

    def __init__(self, cal: LinearSoftmax):
        super().__init__()
        self.feature: str = cal.feature
        self.log_floor: float = LOG_FLOOR  # an attribute: TorchScript reads no globals
        self.full: bool = cal.structure == "full"
        self.register_buffer("weight", _buffer(cal.weight_))
        self.has_bias: bool = cal.bias_ is not None
        self.register_buffer("bias", _buffer(cal.bias_ if self.has_bias else 0.0))

    def forward(self, z: Tensor) -> Tensor:
        x = z
        if self.feature == "log_softmax":
            x = _log_softmax(z)
        elif self.feature == "clr":
            x = torch.clamp_min(_log_softmax(z), self.log_floor)
            x = x - x.mean(dim=1, keepdim=True)
        u = x @ self.weight.T if self.full else x * self.weight
        if self.has_bias:
            u = u + self.bias
        return u


class _Structured(nn.Module):
    """SVS and SMS: ``W x + b`` on ``x = log((softmax(beta z) + c) / (1 + K c))``."""

    def __init__(self, cal: StructuredVectorScaler | StructuredMatrixScaler):
        super().__init__()
        self.full: bool = cal.structure == "full"
        self.register_buffer("beta", _buffer(cal.beta_))
        self.register_buffer("smoothing", _buffer(cal.smoothing_))
        self.register_buffer("log_normaliser",
                             _buffer(math.log1p(cal.n_classes_ * cal.smoothing_)))
        self.register_buffer("weight", _buffer(cal.weight_))
        self.register_buffer("bias", _buffer(cal.bias_))

    def forward(self, z: Tensor) -> Tensor:
        x = torch.log(torch.softmax(self.beta * z, dim=1) + self.smoothing) - self.log_normaliser
        u = x @ self.weight.T if self.full else x * self.weight
        return u + self.bias


class _Ensemble(nn.Module):
    """ETS: ``log(w1 softmax(beta z) + w2 softmax(z) + w3 / K)``, in log space."""

    def __init__(self, cal: EnsembleTemperatureScaler):
        super().__init__()
        self.register_buffer("beta", _buffer(cal.beta_))
        # The normalised log-weights exactly as the numpy map computes them.
        self.register_buffer("log_weights", _buffer(cal._terms()))

    def forward(self, z: Tensor) -> Tensor:
        t1 = _log_softmax(z * self.beta) + self.log_weights[0]
        t2 = _log_softmax(z) + self.log_weights[1]
        t3 = self.log_weights[2]
        top = torch.maximum(torch.maximum(t1, t2), t3)
        return top + torch.log(torch.exp(t1 - top) + torch.exp(t2 - top) + torch.exp(t3 - top))


class _PerRowTemperature(nn.Module):
    """PTS: ``z * beta(z)``, the row's inverse temperature from its sorted gaps."""

    def __init__(self, cal: ParameterizedTemperatureScaler):
        super().__init__()
        k = cal.n_classes_
        m = min(cal.top_weights_.shape[0], k - 1)
        self.m: int = m
        self.register_buffer("near_weights", _buffer(cal.top_weights_[:m, 0]))
        self.register_buffer("log_weights", _buffer(cal.top_weights_[:m, 1]))
        self.register_buffer("row_weights", _buffer(cal.row_weights_ / math.log(k)))
        self.register_buffer("offset", _buffer(cal.offset_))
        self.register_buffer("beta", _buffer(cal.beta_))
        self.squash: float = SQUASH

    def forward(self, z: Tensor) -> Tensor:
        c = z - z.max(dim=1, keepdim=True).values
        top = torch.topk(c, self.m + 1, dim=1).values
        gaps = -top[:, 1:]
        e = torch.exp(c)
        total = e.sum(dim=1)
        lse = torch.log(total)
        entropy = lse - (e * c).sum(dim=1) / total
        s = (torch.exp(-gaps) @ self.near_weights + torch.log(1.0 + gaps) @ self.log_weights
             + lse * self.row_weights[0] + entropy * self.row_weights[1] + self.offset)
        beta = self.beta * torch.exp(-self.squash * torch.tanh(s / self.squash))
        return z * beta.unsqueeze(1)


class _IntraOrder(nn.Module):
    """IOP: the sorted gaps rescaled by positive multipliers, summed from the bottom."""

    def __init__(self, cal: IntraOrderPreserving):
        super().__init__()
        k = min(cal.rank_scale_.shape[0], cal.n_classes_ - 1)
        # ``a + FLOOR`` and ``W`` with negative entries read as 0, as the numpy map reads them.
        a, w = cal._weights(k)
        self.k: int = k
        self.register_buffer("rank_part", _buffer(a))
        self.register_buffer("weight", _buffer(w))
        self.register_buffer("beta", _buffer(cal.beta_))
        self.register_buffer("columns", torch.tensor([min(r, k) for r in FEATURE_RANKS]))
        self.register_buffer("knots", _buffer(np.arange(N_KNOTS)))
        self.top_knot: float = N_KNOTS - 1.0
        self.inv_ln2: float = 1.0 / math.log(2.0)

    def forward(self, z: Tensor) -> Tensor:
        vals, idx = torch.topk(z, self.k + 1, dim=1)
        distance = self.beta * (vals[:, :1] - vals.index_select(1, self.columns))
        xi = torch.clamp(torch.log(distance + 1.0) * self.inv_ln2, 0.0, self.top_knot)
        hats = torch.relu(1.0 - torch.abs(xi.unsqueeze(2) - self.knots))
        multiplier = hats.reshape(hats.shape[0], -1) @ self.weight + self.rank_part
        increments = multiplier * self.beta * (vals[:, :-1] - vals[:, 1:])
        above = torch.flip(torch.cumsum(torch.flip(increments, [1]), dim=1), [1])
        top = torch.cat([above, torch.zeros_like(above[:, :1])], dim=1)
        tail = self.beta * (z - vals[:, -1:])
        return tail.scatter(1, idx, top)


class _PriorShift(nn.Module):
    """Prior shift: the base's calibrated logits plus a log-weight per class."""

    def __init__(self, cal: PriorShift):
        super().__init__()
        self.base = _calibrated_logits(cal.base_)
        self.register_buffer("log_weight", _buffer(cal.log_weight_))

    def forward(self, z: Tensor) -> Tensor:
        return self.base(z) + self.log_weight


class _RowEntropy(nn.Module):
    """Row-entropy: ``beta_i * x_i`` after the fixed safeguarded Newton steps of
    :func:`calibrators.methods.row_entropy.row_log_betas` (the same steps, unrolled)."""

    def __init__(self, cal: RowEntropyTemperature):
        super().__init__()
        self.register_buffer("target", _buffer(cal.target_))
        self.log_k: float = math.log(cal.n_classes_)
        self.steps: int = STEPS
        self.t_min: float = T_MIN
        self.t_max: float = T_MAX
        self.jump: float = JUMP

    def forward(self, z: Tensor) -> Tensor:
        c = z - z.max(dim=1, keepdim=True).values
        spread = -c.min(dim=1).values
        x = c / torch.where(spread > 0, spread, torch.ones_like(spread)).unsqueeze(1)
        gap = torch.clamp(self.log_k - self.target, min=0.0)
        lo = torch.clamp(0.5 * torch.log(8.0 * torch.clamp(gap, min=1e-300)),
                         self.t_min, self.t_max)
        lo = lo.expand(x.shape[0])
        var0 = x.var(dim=1, unbiased=False)
        ratio = 2.0 * gap / torch.where(var0 > 0, var0, torch.full_like(var0, math.inf))
        t = torch.minimum(torch.maximum(0.5 * torch.log(torch.clamp(ratio, min=1e-300)), lo),
                          torch.full_like(lo, self.t_max))
        hi = torch.full_like(t, self.t_max)
        n_lo = torch.full_like(t, math.nan)
        n_hi = torch.full_like(t, math.nan)
        for _ in range(self.steps):
            beta = torch.exp(t)
            e = torch.exp(x * beta.unsqueeze(1))
            s = e.sum(dim=1)
            mean = (e * x).sum(dim=1) / s
            d = x - mean.unsqueeze(1)
            var = (e * d * d).sum(dim=1) / s
            f = torch.log(s) - beta * mean - self.target
            newton = t - f / (-(beta * beta) * var)
            above = f > 0
            lo = torch.where(above, t, lo)
            n_lo = torch.where(above, newton, n_lo)
            hi = torch.where(above, hi, t)
            n_hi = torch.where(above, n_hi, newton)
            other = torch.where(above, n_hi, n_lo)
            fallback = torch.minimum(0.5 * (lo + hi), lo + self.jump)
            t = torch.where((other > lo) & (other < hi), other, fallback)
            t = torch.where((newton >= lo) & (newton <= hi), newton, t)
        return x * torch.exp(t).unsqueeze(1)


#: The torch map of each kind of calibrator (the most specific class first).
MAPS: tuple[tuple[type[Calibrator], type[nn.Module]], ...] = (
    (LinearSoftmax, _Linear),
    (StructuredVectorScaler, _Structured),
    (StructuredMatrixScaler, _Structured),
    (EnsembleTemperatureScaler, _Ensemble),
    (ParameterizedTemperatureScaler, _PerRowTemperature),
    (IntraOrderPreserving, _IntraOrder),
    (PriorShift, _PriorShift),
    (RowEntropyTemperature, _RowEntropy),
)


def _calibrated_logits(calibrator: Calibrator) -> nn.Module:
    """The torch map of ``calibrator``'s calibrated logits (see :data:`MAPS`)."""
    for cls, module in MAPS:
        if isinstance(calibrator, cls):
            return module(calibrator)
    raise TypeError(
        f"to_torch exports the calibrators of {', '.join(c.__name__ for c, _ in MAPS)}. "
        f"Got {type(calibrator).__name__}."
    )


class CalibratedScores(nn.Module):
    """Scores in, the four outputs of a calibrator out (see the module docstring).

    Build it with :func:`to_torch`.
    """

    def __init__(self, calibrated_logits: nn.Module, probabilities: bool, dtype: torch.dtype):
        super().__init__()
        self.calibrated_logits = calibrated_logits
        self.probabilities: bool = probabilities
        self.dtype: torch.dtype = dtype
        self.log_floor: float = LOG_FLOOR
        self.probability_floor: float = PROBABILITY_FLOOR

    def forward(self, scores: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        z = scores.to(torch.float64)
        if self.probabilities:
            z = torch.log(torch.clamp_min(z, self.probability_floor))
        else:
            z = torch.where(torch.isneginf(z), torch.full_like(z, self.log_floor), z)
        u = self.calibrated_logits(z)
        label = torch.argmax(u, dim=1)
        s = u - u.max(dim=1, keepdim=True).values
        e = torch.exp(s)
        total = e.sum(dim=1, keepdim=True)
        p = e / total
        entropy = torch.log(total.squeeze(1)) - (p * s).sum(dim=1)
        confidence = 1.0 / total.squeeze(1)
        return p.to(self.dtype), confidence.to(self.dtype), label, entropy.to(self.dtype)


def to_torch(
    calibrator: Calibrator, kind: str = "logits", *, dtype: torch.dtype = torch.float32
) -> CalibratedScores:
    """The fitted ``calibrator`` as a torch module (see the module docstring).

    Parameters
    ----------
    calibrator : Calibrator
        Fitted, of any method of :data:`calibrators.METHODS`.
    kind : {"logits", "probabilities"}, default "logits"
        What the module's input holds.
    dtype : torch.dtype, default torch.float32
        Of ``probabilities``, ``confidence`` and ``entropy`` (``label`` is int64).

    Returns
    -------
    CalibratedScores
        In eval mode, without parameters to train (its fitted numbers are buffers).

    Raises
    ------
    NotFittedError
        ``calibrator`` is not fitted.
    KindError
        ``calibrator`` does not take ``kind`` (:attr:`Calibrator.input_kinds`).
    TypeError
        A calibrator class without a torch map (not one of :data:`MAPS`).
    """
    check_kind(kind)
    calibrator.check_input_kind(kind)
    return CalibratedScores(_calibrated_logits(calibrator), kind == KINDS[1], dtype).eval()
