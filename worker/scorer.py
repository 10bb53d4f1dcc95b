"""The one engine instance of a process (loaded once: JAX weights and compiled passes are reused)."""

from functools import lru_cache

import jax

from core import Scorer
from store.settings import get_settings


@lru_cache(maxsize=1)
def get_scorer() -> Scorer:
    settings = get_settings()
    if settings.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", settings.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every pass program is worth it
    return Scorer.from_pretrained(settings.model, settings.model_cache_dir, pass_tokens=settings.pass_tokens, dtype=settings.dtype,
                                  attention=settings.attention, max_programs=settings.max_programs,
                                  **settings.request_limits)
