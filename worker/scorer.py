"""The one engine instance of a process (loaded once: JAX weights and compiled passes are reused)."""

from functools import lru_cache

from api.settings import get_settings
from core import Scorer


@lru_cache(maxsize=1)
def get_scorer() -> Scorer:
    settings = get_settings()
    return Scorer.from_pretrained(settings.model, pass_tokens=settings.pass_tokens, dtype=settings.dtype,
                                  attention=settings.attention, **settings.request_limits)
