"""Output text, a few tokens at a time (vLLM's prefix and read offsets).

Decoding a sequence's whole output after every new token costs O(length) per step, O(length²)
per request. The new token cannot be decoded alone either: a token need not end on a character
boundary (byte-level BPE splits UTF-8 characters), and some tokenizers decide a token's leading
space from its neighbour. So keep two offsets into the output: text up to ``read_offset`` has
been emitted, and decoding from ``prefix_offset`` (a few tokens earlier) gives the context.
Each step decodes that short window with and without the new tokens; the difference is the new
text, held back while it ends in an incomplete character (U+FFFD). ``flush`` emits what is held
back when the sequence ends, so the final text equals decoding the whole output at once.
"""

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # tokens before this are in self.text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --8<-- [start:add]
    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ('' if none yet)."""
        self.token_ids.append(token_id)
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""  # nothing complete yet: wait for the next token
        new = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new
        return new
    # --8<-- [end:add]

    def flush(self) -> str:
        """The sequence ended: emit the text still held back (an incomplete character)."""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        new = after[len(before):] if len(after) > len(before) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += new
        return new
