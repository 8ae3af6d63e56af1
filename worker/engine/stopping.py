"""When a request stops: max_tokens, EOS, stop token ids, stop strings (none of these three
before `min_tokens`), a finished grammar.

Checked after every token on the step thread, so each check costs O(1) in the request's size:
a set lookup for the ids, and one decode of a window as long as the longest stop string (whose
length the ingress bounds, `RequestLimits.stop_chars`) for the strings."""

from __future__ import annotations

from collections.abc import Callable

from core.outputs import FinishReason
from worker.models.model_dir import Tokenizer
from worker.scheduler.request import Req


class StopChecker:
    def __init__(
        self, eos_token_ids: tuple[int, ...], tokenizer_loader: Callable[[], Tokenizer] | None
    ) -> None:
        self.eos = frozenset(eos_token_ids)
        self._loader = tokenizer_loader
        self._tokenizer: Tokenizer | None = None
        self._load_error = ""

    def check(self, req: Req) -> FinishReason | None:
        """Called after each new token of `req`."""
        p, last = req.params, req.output[-1]
        if len(req.output) >= p.min_tokens:
            if last in p.stop_token_set or (not p.ignore_eos and last in self.eos):
                return "stop"
            if p.stop and self._hits_stop_string(req):
                return "stop"
        if req.grammar is not None and req.grammar.done:
            return "stop"  # the structured output is complete: only EOS could follow
        if len(req.output) >= p.max_tokens:
            return "length"
        return None

    def _hits_stop_string(self, req: Req) -> bool:
        tok = self._get_tokenizer()
        if tok is None:
            raise ValueError("stop strings need the model's tokenizer, which this engine lacks")
        # A token is at least one character, so the last len(stop)+1 tokens hold any match
        # that ends in the newest token.
        stops, out = req.params.stop, req.output
        tail = tok.decode(out[-(req.params.longest_stop + 1) :], skip_special_tokens=False)
        found = [s for s in stops if s in tail]
        if not found:
            return False  # the common case: one decode
        # Only matches that end in the new token count (earlier ones would have stopped before,
        # or came before min_tokens).
        before = tok.decode(out[-(req.params.longest_stop + 1) : -1], skip_special_tokens=False)
        return any(s not in before for s in found)

    def check_stop_strings_supported(self) -> None:
        """Raise ValueError when stop strings cannot be checked (no tokenizer loads): refusing
        the request up front beats failing inside a step that other requests share."""
        if self._get_tokenizer() is None:
            raise ValueError(
                "stop strings need the model's tokenizer, which could not be loaded"
                f"{f' ({self._load_error})' if self._load_error else ''}; drop `stop` or "
                "use stop_token_ids"
            )

    def _get_tokenizer(self) -> Tokenizer | None:
        if self._tokenizer is None and self._loader is not None:
            try:
                self._tokenizer = self._loader()
            except Exception as err:  # noqa: BLE001 - transformers raises OSError/ValueError/...
                self._load_error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                self._loader = None  # do not retry on every request
        return self._tokenizer
