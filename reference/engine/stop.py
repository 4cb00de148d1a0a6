"""When a sequence ends: end-of-sequence, a stop token, a stop string, or a length limit."""

from .sampling_params import SamplingParams
from .sequence import Sequence, SequenceStatus


# --8<-- [start:check_stop]
def check_stop(seq: Sequence, new_text: str, params: SamplingParams,
               eos_token_id: int | None, max_model_len: int) -> None:
    """After the sequence's newest token (whose text is new_text) was appended: finish
    it if it should end here. A stop string ends the text just before it.

    Before min_tokens tokens exist nothing but a length limit ends a sequence, and only
    text produced after the first min_tokens tokens is searched for stop strings. The
    search looks at the new text and the len(stop) - 1 characters before it, so a stop
    string split across tokens is found, at O(new text) cost per step.
    """
    token, num_generated = seq.output_token_ids[-1], len(seq.output_token_ids)
    reason = stop_reason = None
    if num_generated > params.min_tokens:
        text = seq.output_text
        if token == eos_token_id and not params.ignore_eos:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        else:
            for stop in params.stop_strings:
                start = max(seq.stop_search_from,
                            len(text) - len(new_text) - len(stop) + 1)
                at = text.find(stop, start)
                if at != -1:
                    reason, stop_reason = "stop", stop
                    seq.output_text = text[:at]
                    break
    elif num_generated == params.min_tokens:
        seq.stop_search_from = len(seq.output_text)  # stop strings count from here on
    if reason is None and (num_generated >= params.max_tokens
                           or len(seq) >= max_model_len):
        reason = "length"
    if reason is not None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
# --8<-- [end:check_stop]
