"""Milestone 6 of the build-it track: the sampler (lessons/build/06-sampler.md).

Write sample. Check your work with

    pytest lessons/build/test_build_sampler.py

한국어:
엔진 직접 만들기 트랙의 마일스톤 6: 샘플러(lessons/build/06-sampler.md).

sample을 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/build/test_build_sampler.py
"""

import torch

GREEDY_BELOW = 1e-5  # a temperature below this is greedy, as in vLLM


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           generator: torch.Generator) -> torch.Tensor:
    """One token id per row: [S] int64 from logits [S, vocab].

    Row s is greedy when temperature[s] < GREEDY_BELOW: the most likely token, the lowest id
    among equals (torch.argmax returns the first of several maxima). Otherwise it is drawn,
    with the random numbers of generator only, from the softmax of logits / temperature over
    the top_k[s] most likely tokens (a token tied with the k-th most likely one is kept too);
    top_k[s] <= 0, or >= vocab, keeps every token. A token whose logit is -inf is never
    chosen. The logits passed in are not modified.
    """
    raise NotImplementedError("milestone 6: write sample")
