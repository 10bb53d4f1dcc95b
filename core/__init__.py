"""packscore's scoring engine: exact packed multi-item scoring on a causal LM (JAX).

The engine (Scorer and its results) is imported on first use, so that the API, which only validates and
tokenizes requests, does not load JAX.
"""

from typing import TYPE_CHECKING

from core.errors import ERROR_CODES, ScoringError
from core.requests import MODEL_NAMES, RequestTokenizer, TokenizedRequest, scores_from_logprobs

if TYPE_CHECKING:
    from core.scorer import InFlightPass, ItemScores, PassResult, Scorer

_ENGINE = ("InFlightPass", "ItemScores", "PassResult", "Scorer")

__all__ = ["ERROR_CODES", "MODEL_NAMES", "InFlightPass", "ItemScores", "PassResult", "RequestTokenizer", "Scorer",
           "ScoringError", "TokenizedRequest", "scores_from_logprobs"]


def __getattr__(name: str) -> object:
    if name in _ENGINE:
        from core import scorer

        return getattr(scorer, name)
    raise AttributeError(f"module 'core' has no attribute {name!r}")
