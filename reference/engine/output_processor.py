"""Sampled tokens into text and outputs: detokenize, check stops, advance grammars, and build
each request's ``RequestOutput`` (vLLM V1's ``OutputProcessor``).

The scheduler calls ``append_token`` for every token drawn (inside ``update_from_output``, the
one place a step's results change the requests); the engine calls ``make_output`` for the
requests a step touched.
"""

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput
from .sequence import Sequence, SequenceGroup
from .stop import check_stop
from .structured_outputs.grammar import advance


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int):
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id
        self.max_model_len = max_model_len

    def append_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
                     top: dict[int, float]) -> None:
        """The token joins the sequence: its logprobs, its text (where read before the end),
        the stop checks, the grammar's matcher."""
        params = group.sampling_params
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.logprobs.append({token: logprob, **top})
        new_text = ""
        # Text as it grows only where someone reads it before the end: a stream, or a stop
        # string to search for. Otherwise it is decoded once, when the sequence finishes.
        if self.tokenizer is not None and (params.stop_strings
                                           or params.output_kind == "cumulative"):
            if seq.detokenizer is None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            new_text = seq.detokenizer.add(token)
            seq.output_text += new_text
        check_stop(seq, new_text, params, self.eos_token_id, self.max_model_len)
        if seq.matcher is not None:  # the grammar takes the token; complete, it ends here
            advance(seq, token)
        if seq.is_finished and self.tokenizer is not None:
            if seq.detokenizer is None:
                seq.output_text = self.decode(seq.output_token_ids)
            elif seq.stop_reason not in params.stop_strings:
                seq.output_text += seq.detokenizer.flush()  # the text held back, if any

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        prompt_ids = list(group.seqs[0].prompt_token_ids)
        if group.is_beam_search and group.is_finished:
            completions = [CompletionOutput(
                i, self.decode(b.tokens), list(b.tokens), b.cum_logprob, None,
                "stop" if b.finished else "length") for i, b in enumerate(group.finished_beams)]
            return RequestOutput(group.request_id, group.prompt, prompt_ids, completions, True)
        completions = [CompletionOutput(
            seq.index, seq.output_text, list(seq.output_token_ids), seq.cumulative_logprob,
            list(seq.logprobs) if getattr(group.sampling_params, "logprobs", None) is not None
            else None, seq.finish_reason, seq.stop_reason) for seq in group.seqs]
        # the prompt's entries once all are in (the same list every time: no copy)
        wanted = group.prompt_logprobs
        done = wanted is not None and len(wanted) == len(prompt_ids)
        return RequestOutput(group.request_id, group.prompt, prompt_ids, completions,
                             group.is_finished, prompt_logprobs=wanted if done else None,
                             prompt_token_ranks=group.prompt_token_ranks if done else None)

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
