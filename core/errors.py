"""The one exception type of the scoring contract (see docs/score-semantics.md, Errors)."""

ERROR_CODES = (
    "empty_query",
    "empty_label_token_ids",
    "label_token_id_out_of_range",
    "token_id_out_of_range",
    "mixed_input_types",
    "too_many_items",
    "too_many_tokens",
    "too_many_labels",
    "unknown_model",
    "invalid_input",
)


class ScoringError(ValueError):
    """A request the engine refuses. `code` is stable: the API maps it to a 4xx without string matching."""

    def __init__(self, code: str, message: str):
        if code not in ERROR_CODES:
            raise ValueError(f"unknown scoring error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
