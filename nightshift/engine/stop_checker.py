"""When a sequence stops, and its text: stop token ids, EOS, stop strings, a completed grammar,
max_tokens. Before min_tokens tokens, only max_tokens and the context length stop a sequence
(the sampler bars its stop tokens until then; stop strings are not looked for, as in vLLM).

Text is produced incrementally only for requests with stop strings (every other request
is decoded once when it finishes). The incremental step decodes a short window of
tokens before and after the read offset, so a multi-byte character split over several
tokens is only emitted once complete (the window ends in U+FFFD until then).
"""
from __future__ import annotations

from typing import Optional, Protocol

from nightshift.engine.sequence import Sequence


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def detokenize_incrementally(tokenizer: Decoder, seq: Sequence) -> str:
    """Extend seq.text with the newly decodable text of its output tokens; return the delta."""
    ids = seq.output_token_ids
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset])
    new_text = tokenizer.decode(ids[seq.prefix_offset:])
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""
    delta = new_text[len(prefix_text):]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    seq.text += delta
    return delta


def find_stop_string(text: str, delta_len: int, stops: list[str]) -> Optional[tuple[int, str]]:
    """(index in `text`, the stop string) of the earliest stop string that ends inside the last
    delta_len chars, or None."""
    best = None
    for stop in stops:
        start = max(0, len(text) - delta_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class StopChecker:
    def __init__(self, tokenizer: Decoder, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> Optional[str]:
        """Called after each appended token: the finish reason, or None to go on.

        A stop token (EOS or stop_token_ids) stays in token_ids but not in the text;
        a stop string is cut from the text (the tokens that produced it are kept). A constrained
        sequence stops as soon as its grammar is complete (nothing but EOS could follow).
        """
        params = seq.sampling
        token = seq.token_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.text = self.final_text(seq, drop_last=True)
            return "stop"
        if seq.matcher is not None and seq.matcher.is_stopped():
            seq.text = self.final_text(seq, drop_last=token in self.eos_token_ids)
            return "stop"
        if params.stop:
            delta = detokenize_incrementally(self.tokenizer, seq)
            if delta and seq.num_output_tokens >= params.min_tokens:
                found = find_stop_string(seq.text, len(delta), params.stop)
                if found is not None:
                    seq.text = seq.text[:found[0]]
                    seq.stop_string = found[1]
                    return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.text = self.final_text(seq, drop_last=False)
            return "length"
        return None

    def final_text(self, seq: Sequence, drop_last: bool) -> str:
        ids = seq.output_token_ids
        return self.tokenizer.decode(ids[:-1] if drop_last else ids)
