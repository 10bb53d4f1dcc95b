"""The built-in rerank templates against their model cards: each card's own formatting code, reproduced here,
gives the same token ids as the engine's request (query + item, joined in token space), with the bundled
SmolLM2 tokenizer (no network: the cards' tokenizers are not at hand; see the README for what that leaves
open). RERANK_TEMPLATE=auto picks the template from the checkpoint's name or config."""

import copy
import json

import numpy as np
import pytest
from tokenizers.processors import TemplateProcessing

from core.requests import ModelSource, RequestTokenizer
from store.rerank import TEMPLATES, rerank_prompt, template_for
from store.schemas import RerankInput, rerank_results

DOCUMENTS = ["Paris is the capital of France.", "(aside) text, then 1984.", "", "  spaced  \n", "Ünïcode café!"]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def tokenizer():
    return ModelSource.resolve("tiny-random").tokenizer()


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """The bundled tokenizer made to add a BOS token, as Gemma's does (add_special_tokens=True)."""
    tok = copy.deepcopy(tokenizer)
    bos, bos_id = tok.bos_token, tok.bos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                              special_tokens=[(bos, bos_id)])
    assert tok("A: x").input_ids[0] == bos_id
    return tok


def engine_ids(tokenizer, template: str, document: str, instruction: str | None = None) -> tuple[list, list]:
    """The whole prompt's token ids as the engine scores it, and the labels' ids."""
    prompt = rerank_prompt(TEMPLATES[template], RequestTokenizer(tokenizer, len(tokenizer), model_name="t"))
    score, _ = prompt.score_input(RerankInput(query=QUERY, documents=[document], instruction=instruction))
    request = RequestTokenizer(tokenizer, len(tokenizer), model_name="t").tokenize(
        score.query, score.items, score.label_token_ids)
    return list(request.query + request.items[0]), list(request.label_token_ids)


# ---- each model card's formatting code, as published ------------------------------------------------------

def qwen3_reranker_card(tokenizer, query: str, doc: str, instruction: str | None = None) -> list[int]:
    """Qwen/Qwen3-Reranker's model card (format_instruction, process_inputs)."""
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_tokens = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(suffix, add_special_tokens=False)
    if instruction is None:
        instruction = "Given a web search query, retrieve relevant passages that answer the query"
    pair = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(
        instruction=instruction, query=query, doc=doc)
    return prefix_tokens + tokenizer([pair], padding=False, return_attention_mask=False)["input_ids"][0] \
        + suffix_tokens


def mxbai_rerank_v2_card(tokenizer, query: str, doc: str, instruction: str | None = None) -> list[int]:
    """mixedbread-ai/mxbai-rerank-*-v2 as its mxbai-rerank package builds the input (no truncation)."""
    sep = "\n"
    task = ("You are a search relevance expert who evaluates how well documents match search queries. For each "
            "query-document pair, carefully analyze the semantic relationship between them, then provide your "
            "binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:")
    chat = {"prefix": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                      "assistant.<|im_end|>\n<|im_start|>user\n",
            "suffix": "<|im_end|>\n<|im_start|>assistant\n"}
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    query_text = "query: {query}".format(query=query)
    if instruction:
        query_text = "instruction: {instruction}".format(instruction=instruction) + sep + query_text
    combined = ids(query_text) + ids(sep) + ids("document: {document}".format(document=doc))
    return ids(chat["prefix"]) + combined + ids(sep) + ids(task) + ids(chat["suffix"])


def bge_reranker_v2_gemma_card(tokenizer, query: str, passage: str, prompt: str | None = None) -> list[int]:
    """BAAI/bge-reranker-v2-gemma's model card (get_inputs, without truncation or padding)."""
    if prompt is None:
        prompt = ("Given a query A and a passage B, determine whether the passage contains an answer to the query "
                  "by providing a prediction of either 'Yes' or 'No'.")
    sep = "\n"
    prompt_inputs = tokenizer(prompt, return_tensors=None, add_special_tokens=False)["input_ids"]
    sep_inputs = tokenizer(sep, return_tensors=None, add_special_tokens=False)["input_ids"]
    query_inputs = tokenizer(f"A: {query}", return_tensors=None, add_special_tokens=False)["input_ids"]
    passage_inputs = tokenizer(f"B: {passage}", return_tensors=None, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id] + query_inputs + sep_inputs + passage_inputs + sep_inputs + prompt_inputs


@pytest.mark.parametrize("document", DOCUMENTS)
@pytest.mark.parametrize("instruction", [None, "Find the city."])
def test_qwen3_reranker_prompt_is_the_model_cards(tokenizer, document, instruction):
    ids, labels = engine_ids(tokenizer, "qwen3-reranker", document, instruction)
    assert ids == qwen3_reranker_card(tokenizer, QUERY, document, instruction)
    assert labels == [tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")]


@pytest.mark.parametrize("document", DOCUMENTS)
@pytest.mark.parametrize("instruction", [None, "Find the city."])
def test_mxbai_rerank_v2_prompt_is_the_model_cards(tokenizer, document, instruction):
    ids, labels = engine_ids(tokenizer, "mxbai-rerank-v2", document, instruction)
    assert ids == mxbai_rerank_v2_card(tokenizer, QUERY, document, instruction)
    ids_of = lambda label: tokenizer(label, add_special_tokens=False)["input_ids"][0]
    assert labels == [ids_of("1"), ids_of("0")]  # the card's score: logit("1") - logit("0")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_bge_reranker_v2_gemma_prompt_is_the_model_cards(bos_tokenizer, document):
    ids, labels = engine_ids(bos_tokenizer, "bge-reranker-v2-gemma", document)
    assert ids == bge_reranker_v2_gemma_card(bos_tokenizer, QUERY, document)
    assert labels == [bos_tokenizer("Yes", add_special_tokens=False)["input_ids"][0]]


def test_one_label_relevance_is_its_probability_and_documents_come_back():
    prompt = rerank_prompt(TEMPLATES["bge-reranker-v2-gemma"],
                           RequestTokenizer(ModelSource.resolve("tiny-random").tokenizer(), 49152, model_name="t"))
    score, spec = prompt.score_input(RerankInput(query=QUERY, documents=DOCUMENTS[:3]))
    assert not score.apply_softmax and len(score.label_token_ids) == 1
    logprobs = np.log([[0.2], [0.7], [0.1]])
    results = rerank_results({"items": score.items, "rerank": spec}, logprobs)
    assert [r.index for r in results] == [1, 0, 2]
    assert results[0].relevance_score == pytest.approx(0.7)
    assert [r.document.text for r in results] == [DOCUMENTS[1], DOCUMENTS[0], DOCUMENTS[2]]


HF = {"vocab_size": 151936, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
      "intermediate_size": 128}


@pytest.mark.parametrize("folder,config,expected", [
    ("mxbai-rerank-base-v2", {"model_type": "qwen2"}, "mxbai-rerank-v2"),
    ("model", {"model_type": "qwen2", "_name_or_path": "mixedbread-ai/mxbai-rerank-large-v2"}, "mxbai-rerank-v2"),
    ("bge-reranker-v2-gemma", {"model_type": "gemma", "head_dim": 32}, "bge-reranker-v2-gemma"),
    ("Qwen3-Reranker-0.6B", {"model_type": "qwen3"}, "qwen3-reranker"),
    ("any-qwen3", {"model_type": "qwen3"}, "qwen3-reranker"),  # as before: a Qwen3 model gets Qwen3-Reranker's
    ("gemma-3-1b-it", {"model_type": "gemma3_text", "head_dim": 32}, "smollm2"),  # q/k norms, but no reranker
    ("qwen2-0.5b", {"model_type": "qwen2"}, "smollm2"),
])
def test_auto_picks_the_template_from_the_checkpoints_name_or_config(tmp_path, folder, config, expected):
    path = tmp_path / folder
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**HF, **config}))
    assert template_for("auto", str(path)) == TEMPLATES[expected]
