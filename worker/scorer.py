"""The one engine instance of a process (loaded once: JAX weights and compiled passes are reused)."""

from functools import lru_cache

from api.settings import get_settings
from core import Scorer


@lru_cache(maxsize=1)
def get_scorer() -> Scorer:
    settings = get_settings()
    options: dict = {"max_items": settings.max_items, "max_tokens": settings.max_tokens}
    if settings.pass_tokens:
        options["pass_tokens"] = settings.pass_tokens
    return Scorer.from_pretrained(settings.model, **options)
