"""Structured output: a request's output constrained to a JSON schema, any JSON object, a regular
expression or one of a list of strings, by masking the logits of every token the grammar does not
allow before each token is sampled.

    params = SamplingParams(structured_output=StructuredOutput(json={"type": "object", ...}))

A grammar library does the matching (``GRAMMAR_BACKENDS``; the engine's ``structured_output_backend``):
``llguidance`` by default, ``xgrammar`` as the other (``benchmarks/sampling_cost.py --grammars`` measures
both). The engine compiles a request's grammar when the request arrives (a bad schema or regex is a ``ValueError``
naming the field then, never a failure mid-generation) and keeps one matcher per request in the
sampler: its state is the output so far, which a preemption, a swap or a change of cache kind keep,
so it survives them all. When the grammar is complete the request stops (finish reason "stop").
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router validates requests without loading torch
    import torch

GRAMMAR_BACKENDS = ("llguidance", "xgrammar")
# JSON is written on one line as ``json.dumps`` writes it: free whitespace would let a model that has
# lost its way pad the output with blanks until ``max_tokens`` instead of closing the object.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of ``json`` (a JSON schema, as a dict or its
    text), ``json_object`` (any JSON object), ``regex`` or ``choice`` (one of these strings)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None

    def __post_init__(self) -> None:
        given = [name for name, value in (("json", self.json), ("json_object", self.json_object or None),
                                          ("regex", self.regex), ("choice", self.choice)) if value is not None]
        if len(given) != 1:
            raise ValueError(f"structured_output: give exactly one of json, json_object, regex, choice; got {given}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_output: the JSON schema is not valid JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_output: a JSON schema must be an object")
            object.__setattr__(self, "json", schema)
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_output: regex must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_output: choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> str:
        """A canonical text of the constraint (compiled grammars are cached by it)."""
        if self.json is not None:
            return "json:" + json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex:" + self.regex
        return "choice:" + json.dumps(self.choice)

    def as_schema_or_regex(self) -> tuple[dict | None, str | None]:
        """(schema, None) or (None, regex): what the grammar libraries compile."""
        if self.json is not None:
            return self.json, None
        if self.json_object:
            return {"type": "object"}, None
        if self.regex is not None:
            return None, self.regex
        return None, "(" + "|".join(re.escape(c) for c in self.choice) + ")"


class _LLGuidance:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict | None, regex: str | None):
        grammar = (self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
                   if schema is not None else self.llg.LLMatcher.grammar_from_regex(regex))
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(messages[0].strip().splitlines()[0] if messages else "the grammar is not valid")
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.lt.fill_next_token_bitmask(matcher, bitmask, row)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.consume_token(token)

    @staticmethod
    def is_done(matcher) -> bool:
        return matcher.is_stopped()

    @staticmethod
    def error(matcher) -> str | None:
        return matcher.get_error() or None if matcher.is_error() else None


class _XGrammar:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer,
                                                                                        vocab_size=vocab_size))
        self.vocab_size = vocab_size

    def compile(self, schema: dict | None, regex: str | None):
        try:
            return (self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                      separators=(JSON_LAYOUT["item_separator"],
                                                                  JSON_LAYOUT["key_separator"]))
                    if schema is not None else self.compiler.compile_regex(regex))
        except RuntimeError as exc:
            raise ValueError(str(exc).splitlines()[0]) from None

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def is_done(matcher) -> bool:
        return matcher.is_terminated()

    @staticmethod
    def error(matcher) -> str | None:
        return None


class StructuredOutputs:
    """The engine's grammars (compiled once per constraint, least recently used dropped past
    ``cache_size``) and one matcher per constrained request."""

    def __init__(self, tokenizer, vocab_size: int, backend: str = "llguidance", cache_size: int = 64) -> None:
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"structured_output_backend: unknown {backend!r}; valid: {list(GRAMMAR_BACKENDS)}")
        self.backend_name = backend
        self.lib = (_LLGuidance if backend == "llguidance" else _XGrammar)(tokenizer, vocab_size)
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._matchers: dict[str, object] = {}
        self._bitmask: torch.Tensor | None = None

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of ``spec``; ValueError("structured_output: ...") when it is not valid."""
        compiled = self._compiled.get(spec.key)
        if compiled is None:
            try:
                compiled = self.lib.compile(*spec.as_schema_or_regex())
            except ValueError as exc:
                raise ValueError(f"structured_output: {exc}") from None
            self._compiled[spec.key] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec.key)
        return compiled

    def add(self, request_id: str, spec: StructuredOutput) -> None:
        self._matchers[request_id] = self.lib.matcher(self.compile(spec))

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> list[int]:
        """Set to -inf, in ``logits`` [B, V], every token row i's grammar does not allow next (rows of
        requests without one untouched). Returns the constrained rows."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return rows
        vocab = logits.shape[1]
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = self.lib.bitmask(max(len(rows), 8))
        bitmask = self._bitmask[: len(rows)]
        for j, i in enumerate(rows):
            self.lib.fill(self._matchers[request_ids[i]], bitmask, j)
        sub = logits[rows]
        width = min(vocab, self.lib.vocab_size)
        part = sub[:, :width].contiguous()
        self.lib.apply(part, bitmask)
        sub[:, :width] = part
        if vocab > width:  # rows past the grammar's vocabulary: never allowed
            sub[:, width:] = float("-inf")
        logits[rows] = sub
        return rows

    def accept(self, request_id: str, token: int) -> bool:
        """Advance ``request_id``'s matcher by ``token``; True when its grammar is now complete (the
        request stops there)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not self.lib.accept(matcher, token):
            return True  # a token the mask allowed was refused: the grammar has nothing more to say
        return self.lib.is_done(matcher)
