"""The one engine instance of a process (loaded once: JAX weights and compiled passes are reused)."""

import jax

from core import Scorer
from core.dtype import checked_bfloat16
from store.settings import get_settings

_scorer: Scorer | None = None


def get_scorer() -> Scorer:
    global _scorer
    if _scorer is None:
        _scorer = _load()
    return _scorer


def install_scorer(scorer: Scorer) -> None:
    """Serves with this engine instead of the configured one (the capacity benchmark's simulated device)."""
    global _scorer
    _scorer = scorer


def _load() -> Scorer:
    settings = get_settings()
    if settings.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", settings.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every pass program is worth it
    # The worker's one model (MODEL), named as the API names it: jobs are claimed by that name.
    name = settings.worker_model

    def load(dtype: str) -> Scorer:
        return Scorer.from_pretrained(settings.served_models[name], settings.model_cache_dir, name=name,
                                      pass_tokens=settings.pass_tokens, dtype=dtype, attention=settings.attention,
                                      max_programs=settings.max_programs,
                                      prefix_cache_bytes=settings.prefix_cache_bytes,
                                      tensor_parallel=settings.tensor_parallel, **settings.request_limits)

    # A model served in bfloat16 first passes the bfloat16 rule on a fixed request, or is served in float32.
    return checked_bfloat16(load(settings.dtype), load, name)
