"""Exercise (lesson 14, "Inside the optimized engine"): pad a decode step to a captured graph.

A CUDA graph replays exactly the kernels it recorded, on exactly the shapes it recorded. The
optimized tier's model runner captures one graph per decode batch size in a short list (1, 2, 4,
8, 16, 24, ...), and runs a decode step of B sequences through the graph of the smallest
captured size that holds B, with the missing rows filled by padding that changes nothing.
Write the two functions below. Check your work with

    pytest lessons/exercises/test_graph_padding_exercise.py

The test compares your padding with the buffers the real ModelRunner fills
(optimized/model_runner.py), then runs a small model on your padded step and checks that the
real rows' logits and the KV cache are exactly those of the unpadded step. Until you edit this
file the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(14강, "최적화 엔진의 내부"): 디코드 스텝을 캡처된 그래프에 맞게 패딩하기.

CUDA 그래프는 기록한 커널을 기록한 형태 그대로 정확히 다시 실행합니다. 최적화 계층의 모델 러너는
짧은 목록(1, 2, 4, 8, 16, 24, ...)의 디코드 배치 크기마다 그래프를 하나씩 캡처하고, 시퀀스 B개의
디코드 스텝은 B를 담을 수 있는 가장 작은 캡처 크기의 그래프로 실행합니다. 모자란 행은 아무것도
바꾸지 않는 패딩으로 채웁니다. 아래 두 함수를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_graph_padding_exercise.py

테스트는 여러분의 패딩을 실제 ModelRunner(optimized/model_runner.py)가 채우는 버퍼와 비교한 뒤,
패딩한 스텝으로 작은 모델을 돌려 실제 행의 로짓과 KV 캐시가 패딩하지 않은 스텝의 것과 정확히
같은지 확인합니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고 해답만
확인합니다.
"""


def graph_size(batch: int, captured: list[int]) -> int | None:
    """The captured size a decode step of `batch` sequences runs at, or None to run eagerly.

    captured: the captured batch sizes, ascending. Example: captured [1, 2, 4, 8, 16],
    batch 5 -> 8; batch 16 -> 16; batch 17 -> None (no graph holds it: run without one).
    """
    # The smallest captured size that is at least `batch`. Which value tells the caller that
    # none is large enough?
    raise NotImplementedError("exercise: implement graph_size")


def pad_decode_step(input_ids: list[int], positions: list[int], slot_mapping: list[int],
                    block_tables: list[list[int]], seq_lens: list[int],
                    size: int) -> dict[str, list]:
    """A decode step of B sequences (one token row each), padded to `size` rows and sequences.

    Returns a dict with the keys input_ids, positions, slot_mapping (each `size` long),
    block_tables (`size` rows, each as wide as the given rows), seq_lens (`size` long) and
    query_start_loc (`size` + 1 long). The first B rows and sequences are the step's own.

    Example: input_ids [5, 7], positions [3, 8], slot_mapping [3, 24], block_tables
    [[0, 0], [2, 6]], seq_lens [4, 9], size 4 ->
        input_ids [5, 7, 0, 0], positions [3, 8, 0, 0], slot_mapping [3, 24, -1, -1],
        block_tables [[0, 0], [2, 6], [0, 0], [0, 0]], seq_lens [4, 9, 1, 1],
        query_start_loc [0, 1, 2, 3, 4]
    """
    # Each padding row must be harmless:
    # 1. its token and position can be anything valid: use token 0 at position 0;
    # 2. its K/V must be stored nowhere: which slot value means "do not store"?
    # 3. it is a sequence of its own with one query row, so query_start_loc keeps counting;
    # 4. its attention must read something valid: one key (seq_len 1) in block 0.
    raise NotImplementedError("exercise: implement pad_decode_step")
