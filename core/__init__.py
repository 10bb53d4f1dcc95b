"""packscore's scoring engine: exact packed multi-item scoring on a causal LM (JAX)."""

from core.errors import ERROR_CODES, ScoringError
from core.packing import TokenizedRequest
from core.requests import MODEL_NAMES, RequestTokenizer
from core.scorer import ItemScores, PassResult, Scorer, scores_from_logprobs

__all__ = ["ERROR_CODES", "MODEL_NAMES", "ItemScores", "PassResult", "RequestTokenizer", "Scorer", "ScoringError",
           "TokenizedRequest", "scores_from_logprobs"]
