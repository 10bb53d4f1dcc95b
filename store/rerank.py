"""Rerank (the /v1/rerank of Cohere, Jina and vLLM) as packed scoring. The template's prefix, holding the
instruction and the query, is the request's shared query; each document, after the template's separator (a
space) and followed by the template's suffix, is an item; with two labels (the tokens of "yes" and "no") the
scores have apply_softmax, so a document's relevance is P(yes) / (P(yes) + P(no)) at its end: column 0 of its
scores; with one label (bge-reranker-v2-gemma's "Yes") it is that label's probability.

The template and its labels are set per model (RERANK_TEMPLATE). The published prompts of Qwen3-Reranker,
mxbai-rerank-v2 and bge-reranker-v2-gemma are built in ("auto" picks one from the checkpoint's name, or
Qwen3-Reranker's for any Qwen3 model); other models (the bundled SmolLM2) get a plain question and answer.
"""

import json
import re
from dataclasses import dataclass

from core import RequestTokenizer, ScoringError
from core.requests import ModelSource
from store.schemas import RerankInput, ScoreInput


@dataclass(frozen=True)
class RerankTemplate:
    prefix: str  # holds {query}; {instruction} goes in the prefix or the suffix
    suffix: str
    instruction: str  # used when a request gives none
    labels: tuple[str, ...] = ("yes", "no")  # the relevant answer first; one label: its probability
    # What comes between the prefix and the document, put at the start of each item, not at the end of the
    # prefix: the query and each item are tokenized apart and joined in token space (docs/score-semantics.md), and
    # byte-level BPE tokenizers (SmolLM2's, Qwen3's) attach a word's leading space to the word ("ĠParis"). A
    # prefix ending in "Document: " would end in a lone "Ġ" token and the document would start with "Paris",
    # a split that tokenizing the whole prompt never makes; "Document:" + " Paris..." is the whole prompt's.
    separator: str = " "
    # What {instruction} becomes: this with the instruction in it, or nothing when there is none (mxbai's
    # prompt has an instruction line only when one is given).
    instruction_format: str = "{instruction}"


TEMPLATES = {
    # Qwen3-Reranker's model card: the system prompt, then "<Instruct>: ...\n<Query>: ...\n<Document>: ...".
    "qwen3-reranker": RerankTemplate(
        prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
               'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
               "<Instruct>: {instruction}\n<Query>: {query}\n<Document>:",
        suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        instruction="Given a web search query, retrieve relevant passages that answer the query",
    ),
    # mxbai-rerank-base/large-v2 (Qwen2), as mixedbread's mxbai-rerank package formats it: the chat prefix,
    # ["instruction: ...\n"] "query: ...", "\n", "document: ...", "\n", the task prompt, the chat suffix;
    # relevance from the logits of "1" and "0" (their difference: P("1") / (P("1") + P("0")) here).
    "mxbai-rerank-v2": RerankTemplate(
        prefix="<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
               "<|im_start|>user\n{instruction}query: {query}",
        suffix="\nYou are a search relevance expert who evaluates how well documents match search queries. For "
               "each query-document pair, carefully analyze the semantic relationship between them, then provide "
               "your binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"
               "<|im_end|>\n<|im_start|>assistant\n",
        instruction="",
        labels=("1", "0"),
        separator="\ndocument: ",
        instruction_format="instruction: {instruction}\n",
    ),
    # BAAI/bge-reranker-v2-gemma's model card: <bos> "A: {query}", "\n", "B: {passage}", "\n", the prompt;
    # scored by the "Yes" token (the card ranks by its logit; here its probability, the same order when the
    # model puts its mass on its answer tokens, as it was trained to).
    "bge-reranker-v2-gemma": RerankTemplate(
        prefix="A: {query}",
        suffix="\n{instruction}",
        instruction="Given a query A and a passage B, determine whether the passage contains an answer to the "
                    "query by providing a prediction of either 'Yes' or 'No'.",
        labels=("Yes",),
        separator="\nB: ",
    ),
    # For small general models such as the bundled SmolLM2-135M-Instruct, which was never trained to judge
    # relevance: a plain question and answer, the instruction asked after each document, " yes" / " no" as
    # the answer's first token. It ranks better than ChatML prompts (with "yes"/"Yes" labels or few-shot
    # examples), which rank little better than chance; it still ranks only roughly.
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
    label_token_ids: tuple[int, ...]
    limits: RequestTokenizer  # its tokenizer and request limits

    def score_input(self, body: RerankInput) -> tuple[ScoreInput, dict]:
        """The scoring request of a rerank request, and what its results need (stored with the job)."""
        instruction = body.instruction or self.template.instruction
        instruction_text = self.template.instruction_format.format(instruction=instruction) if instruction else ""
        values = {"query": body.query, "instruction": instruction_text}
        query, suffix = fill(self.template.prefix, values), fill(self.template.suffix, values)
        separator = self.template.separator
        self._check_size(len(body.documents), suffix)
        items = [separator + (doc if isinstance(doc, str) else doc.text) + suffix for doc in body.documents]
        score = ScoreInput(query=query, items=items, label_token_ids=list(self.label_token_ids),
                           apply_softmax=len(self.label_token_ids) > 1, model=body.model)
        return score, {"top_n": body.top_n or None, "return_documents": body.return_documents,
                       "separator": separator, "suffix": suffix}

    def _check_size(self, documents: int, suffix: str) -> None:
        """Refuses, before the items are built, a request whose documents alone are over the limits: the
        suffix (the instruction, in some templates) goes after every document, so many documents with a long
        instruction would otherwise build and tokenize millions of tokens only to refuse them. Its tokens, less a
        couple that may merge with the document's end."""
        limits = self.limits
        if documents > limits.max_items:
            raise ScoringError("too_many_items", f"{documents} documents; the limit is {limits.max_items}")
        per_document = len(limits.tokenizer(suffix, add_special_tokens=False).input_ids) - 2 if suffix else 0
        if documents * per_document > limits.max_tokens:
            raise ScoringError("too_many_tokens", f"{documents} documents, each followed by the template's "
                                                  f"{per_document + 2}-token suffix (its instruction), are over "
                                                  f"{limits.max_tokens} tokens")


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
        setting = auto_template(ModelSource.resolve(model, model_cache_dir))
    if setting not in TEMPLATES:
        raise ValueError(f"RERANK_TEMPLATE {setting!r}: expected auto, {', '.join(TEMPLATES)} or a JSON object")
    return TEMPLATES[setting]


# A checkpoint's name (its path, config.json's _name_or_path, a GGUF's general.name) -> its template.
_RERANKER_NAMES = {"qwen3-reranker": "qwen3-reranker", "mxbai-rerank": "mxbai-rerank-v2",
                   "bge-reranker-v2-gemma": "bge-reranker-v2-gemma"}


def auto_template(source: ModelSource) -> str:
    """RERANK_TEMPLATE=auto: the reranker the checkpoint's name says (mxbai-rerank-v2 and bge-reranker-v2-gemma
    are plain Qwen2 and Gemma models: only their names tell them apart), else Qwen3-Reranker's prompt for a
    Qwen3 model, else the plain question and answer."""
    names = [source.name, str(source.path)]
    if source.kind == "hf":
        names.append(str(json.loads((source.path / "config.json").read_text()).get("_name_or_path", "")))
    elif source.kind == "gguf" and source.name != "smollm2-135m":
        import gguf

        fields = gguf.GGUFReader(str(source.path)).fields
        names += [str(fields[key].contents()) for key in ("general.name", "general.basename") if key in fields]
    text = " ".join(names).lower().replace("_", "-")
    for name, template in _RERANKER_NAMES.items():
        if name in text:
            return template
    return "qwen3-reranker" if source.config().family == "qwen3" else "smollm2"


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
    if len(ids) not in (1, 2) or len(set(ids)) != len(ids):
        raise ValueError(f"a rerank template needs two distinct labels (yes, no) or one (yes), got {template.labels}")
    return RerankPrompt(template, tuple(ids), request_tokenizer)
