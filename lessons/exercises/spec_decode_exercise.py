"""Exercise (lesson 20, "Speculative decoding"): the verification rule, and the blocks a run
books and keeps.

A sequence proposed k tokens d_0..d_{k-1}. One forward of the target over its newest token and
the k proposals gave k + 1 rows of logits, and the sampler drew one token from each row:
t_0..t_k, where t_j is exactly the token plain decoding would draw at that output position if
the sequence already held d_0..d_{j-1} (the sampler's random numbers are a function of the
request's seed, the output position and the token id, never of a generator's state). You write
the rule that turns those into the tokens the sequence keeps, and the block arithmetic of the
run. Check your work with

    pytest lessons/exercises/test_spec_decode_exercise.py

The test compares your rule with the reference's ``accepted_lengths``, decodes the shipped tiny
model with your rule (proposals right, wrong, and from n-gram lookups) and checks every token
against plain decoding, then runs the engine with your rule in its scheduler. Until you edit
this file the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(20강, "추측 디코딩"): 검증 규칙, 그리고 한 번의 실행이 예약하고 남기는 블록.

시퀀스가 토큰 k개 d_0..d_{k-1}를 제안했습니다. 타깃 모델이 가장 새로운 토큰과 제안 k개를 한 번의
순전파로 계산해 로짓 k + 1행을 내놓았고, 샘플러가 행마다 토큰 하나를 뽑았습니다: t_0..t_k. t_j는
시퀀스가 이미 d_0..d_{j-1}를 가지고 있었다면 일반 디코딩이 그 출력 위치에서 뽑았을 바로 그
토큰입니다(샘플러의 난수는 요청의 시드, 출력 위치, 토큰 id의 함수이지 생성기 상태의 함수가
아닙니다). 여러분은 이것들을 시퀀스가 남기는 토큰으로 바꾸는 규칙과, 그 실행의 블록 계산을
작성합니다. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_spec_decode_exercise.py

테스트는 여러분의 규칙을 레퍼런스의 ``accepted_lengths``와 비교하고, 여러분의 규칙으로 함께 배포되는
작은 모델을 디코딩해(맞는 제안, 틀린 제안, n-gram 조회로 얻은 제안) 모든 토큰을 일반 디코딩과 대조한
뒤, 여러분의 규칙을 스케줄러에 넣은 엔진을 실행합니다. 이 파일을 고치기 전까지 테스트는 여러분의
버전을 skipped로 보고하고 해답만 확인합니다.
"""


def verify(proposals: list[int], target_tokens: list[int]) -> tuple[int, int]:
    """The exact rule for one run.

    proposals:     d_0..d_{k-1}, the k tokens proposed (k may be 0);
    target_tokens: t_0..t_k, the token the target drew at each of the run's k + 1 rows.

    Returns (accepted, next_token): accepted is how many leading proposals equal the target's
    own tokens (d_j == t_j for every j < accepted), and next_token is the token the target
    drew right after them, t_accepted. The sequence then gains d_0..d_{accepted-1} and
    next_token: accepted + 1 tokens, exactly the ones plain decoding would have produced.

    Raise ValueError unless len(target_tokens) == len(proposals) + 1.
    """
    # 1. Check the lengths.
    # 2. Walk the proposals from the first: stop at the first one that differs from the
    #    target's token at the same row (everything after it was computed on a wrong prefix).
    # 3. The next token is the target's own token at the row where you stopped; when every
    #    proposal was accepted, that is the last row's token (a token for free).
    raise NotImplementedError("exercise: implement verify")


def lookahead_blocks(num_computed: int, num_proposals: int, num_accepted: int,
                     block_size: int) -> tuple[int, int]:
    """Blocks of one sequence around a speculative step.

    Before the step the sequence holds the K/V of num_computed tokens, plus one token sampled
    last step whose K/V this step computes. The scheduler books slots for that token and for
    the num_proposals proposals after it (the lookahead slots), in blocks of block_size slots.
    After verification, num_accepted proposals were kept: their K/V stays, the rejected ones'
    slots are given back, and with them every block that no longer holds a kept token.

    Returns (booked, kept): the blocks in the sequence's block table while the step runs, and
    after the rejected slots went back. (The next token the target drew has no K/V yet: it is
    computed, and booked, next step.)

    Raise ValueError when num_accepted is negative or larger than num_proposals.
    """
    # A block table holds ceil(slots / block_size) blocks; -(-a // b) is ceil(a / b) on ints.
    raise NotImplementedError("exercise: implement lookahead_blocks")
