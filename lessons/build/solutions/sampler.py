"""Solution of milestone 6: one token per row of logits, greedy or drawn."""

import torch

GREEDY_BELOW = 1e-5  # a temperature below this is greedy, as in vLLM


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           generator: torch.Generator) -> torch.Tensor:
    logits = logits.float()  # [S, vocab], a new tensor: the caller's logits stay as they are
    S, vocab = logits.shape
    tokens = torch.argmax(logits, dim=-1)  # [S]: greedy, the first index on ties
    drawn = (temperature >= GREEDY_BELOW).nonzero()[:, 0]  # [D]
    if drawn.numel():
        scaled = logits[drawn] / temperature[drawn].float()[:, None]  # [D, vocab]
        k = top_k[drawn]
        k = torch.where((k <= 0) | (k >= vocab), vocab, k)  # [D]: off keeps every token
        kth = torch.sort(scaled, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # below the k-th largest
        probs = torch.softmax(scaled, dim=-1)  # [D, vocab]
        tokens[drawn] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens
