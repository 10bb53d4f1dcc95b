"""Rerank (the /v1/rerank of Cohere, Jina and vLLM) as packed scoring. The template's prefix, holding the
instruction and the query, is the request's shared query; each document, after the template's separator (a
space) and followed by the template's suffix, is an item; the labels are the tokens of "yes" and "no", with apply_softmax, so a document's relevance is
P(yes) / (P(yes) + P(no)) at its end: column 0 of its scores.

The template and its labels are set per model (RERANK_TEMPLATE). Qwen3-Reranker's published prompt is built in
for Qwen3 models; other models (the bundled SmolLM2) get a plain question and answer.
"""

import json
import re
from dataclasses import dataclass

from core import RequestTokenizer
from core.requests import ModelSource
from store.schemas import RerankInput, ScoreInput


@dataclass(frozen=True)
class RerankTemplate:
    prefix: str  # holds {query}; {instruction} goes in the prefix or the suffix
    suffix: str
    instruction: str  # used when a request gives none
    labels: tuple[str, str] = ("yes", "no")
    # What comes between the prefix and the document, put at the start of each item, not at the end of the
    # prefix: the query and each item are tokenized apart and joined in token space (score-semantics.md), and
    # byte-level BPE tokenizers (SmolLM2's, Qwen3's) attach a word's leading space to the word ("ĠParis"). A
    # prefix ending in "Document: " would end in a lone "Ġ" token and the document would start with "Paris",
    # a split that tokenizing the whole prompt never makes; "Document:" + " Paris..." is the whole prompt's.
    separator: str = " "


TEMPLATES = {
    # Qwen3-Reranker's model card: the system prompt, then "<Instruct>: ...\n<Query>: ...\n<Document>: ...".
    "qwen3-reranker": RerankTemplate(
        prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
               'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
               "<Instruct>: {instruction}\n<Query>: {query}\n<Document>:",
        suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        instruction="Given a web search query, retrieve relevant passages that answer the query",
    ),
    # For small general models such as the bundled SmolLM2-135M-Instruct, which was never trained to judge
    # relevance: a plain question and answer, the instruction asked after each document, " yes" / " no" as
    # the answer's first token. Of the prompts tried on a few queries it ranked best (ChatML prompts, with
    # "yes"/"Yes" labels or few-shot examples, ranked little better than chance); it still ranks only roughly.
    "smollm2": RerankTemplate(
        prefix="Question: {query}\nDocument:",
        suffix="\n{instruction} Answer:",
        instruction="Does the document answer the question?",
        labels=(" yes", " no"),
    ),
}


_PLACEHOLDER = re.compile(r"\{(query|instruction)\}")


def fill(text: str, values: dict[str, str]) -> str:
    """The template text with {query} and {instruction} replaced in one pass, so neither value's own text is
    substituted in turn (an instruction or a query may contain "{query}")."""
    return _PLACEHOLDER.sub(lambda match: values[match[1]], text)


@dataclass(frozen=True)
class RerankPrompt:
    """A template with the token ids of its labels in the served model's tokenizer."""

    template: RerankTemplate
    label_token_ids: tuple[int, int]

    def score_input(self, body: RerankInput) -> tuple[ScoreInput, dict]:
        """The scoring request of a rerank request, and what its results need (stored with the job)."""
        values = {"query": body.query, "instruction": body.instruction or self.template.instruction}
        query, suffix = fill(self.template.prefix, values), fill(self.template.suffix, values)
        separator = self.template.separator
        items = [separator + (doc if isinstance(doc, str) else doc.text) + suffix for doc in body.documents]
        score = ScoreInput(query=query, items=items, label_token_ids=list(self.label_token_ids), apply_softmax=True,
                           model=body.model)
        return score, {"top_n": body.top_n or None, "return_documents": body.return_documents,
                       "separator": separator, "suffix": suffix}


def template_for(setting: str, model: str, model_cache_dir: str | None = None) -> RerankTemplate:
    """RERANK_TEMPLATE: "auto", a name of TEMPLATES or a JSON object of a template's fields. A JSON template
    without a "separator" may end its prefix with the space before the document: that space becomes the
    separator (the start of each item), as in the built-in templates."""
    if setting.lstrip().startswith("{"):
        fields = json.loads(setting)
        prefix = fields["prefix"]
        separator = fields.get("separator")
        if separator is None:
            stripped = prefix.rstrip(" ")
            prefix, separator = stripped, prefix[len(stripped):]
        if "{query}" not in prefix:
            # The query is the shared prefix of the packed pass; without it every request would score the same.
            raise ValueError("RERANK_TEMPLATE: the prefix must hold {query}")
        return RerankTemplate(prefix=prefix, suffix=fields.get("suffix", ""), instruction=fields.get("instruction", ""),
                              labels=tuple(fields.get("labels", ("yes", "no"))), separator=separator)
    if setting == "auto":
        # Of the architectures the engine runs, only Qwen3 has per-head q/k norms.
        setting = "qwen3-reranker" if ModelSource.resolve(model, model_cache_dir).config().qk_norm else "smollm2"
    if setting not in TEMPLATES:
        raise ValueError(f"RERANK_TEMPLATE {setting!r}: expected auto, {', '.join(TEMPLATES)} or a JSON object")
    return TEMPLATES[setting]


def rerank_prompt(template: RerankTemplate, request_tokenizer: RequestTokenizer) -> RerankPrompt:
    """The labels' token ids, read from the tokenizer: each label must be exactly one token, the one that
    follows the suffix (mind the space: " yes" and "yes" are different tokens)."""
    ids = []
    for label in template.labels:
        tokens = request_tokenizer.tokenizer(label, add_special_tokens=False).input_ids
        if len(tokens) != 1:
            raise ValueError(f"rerank label {label!r} is {len(tokens)} tokens in {request_tokenizer.model_name}'s "
                             "tokenizer; it must be one")
        ids.append(tokens[0])
    if len(ids) != 2 or ids[0] == ids[1]:
        raise ValueError(f"a rerank template needs two distinct labels (yes, no), got {template.labels}")
    return RerankPrompt(template, (ids[0], ids[1]))
