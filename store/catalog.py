"""The deployment's models as the API sees them (MODELS, or MODEL alone): each one's tokenizer, limits and
rerank prompt, loaded without its weights. A request names its model (`model`, or the default: the first);
every route resolves that name here, so an unknown one is the same 400 `unknown_model` everywhere."""

import time
from dataclasses import dataclass

from core import RequestTokenizer, ScoringError
from store.rerank import RerankPrompt, rerank_prompt, template_for
from store.settings import Settings


@dataclass(frozen=True)
class ServedModel:
    name: str
    source: str
    tokenizer: RequestTokenizer  # its model_name is `name`: what jobs store and workers claim by
    rerank: RerankPrompt


class ModelCatalog:
    def __init__(self, models: list[ServedModel]) -> None:
        self._models = {model.name: model for model in models}
        self.default = models[0].name
        self.created = int(time.time())  # when this API process loaded them (GET /v1/models' `created`)

    @classmethod
    def load(cls, settings: Settings) -> "ModelCatalog":
        """Every served model's tokenizer and rerank prompt (RERANK_TEMPLATE, "auto" chosen per model); a
        model or template that cannot load stops the start."""
        models = []
        for name, source in settings.served_models.items():
            tokenizer = RequestTokenizer.from_pretrained(source, settings.model_cache_dir, name=name,
                                                         **settings.request_limits)
            template = template_for(settings.rerank_template, source, settings.model_cache_dir)
            models.append(ServedModel(name, source, tokenizer, rerank_prompt(template, tokenizer)))
        return cls(models)

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default), or ScoringError `unknown_model` (400)."""
        model = self._models.get(self.default if name is None else name)
        if model is None:
            raise ScoringError("unknown_model", f"model {name!r} is not served here; this deployment serves "
                                                f"{', '.join(map(repr, self._models))}")
        return model
