"""Exercise (lesson 13, "Fusing the small ops"): the memory traffic of a chain of ops, fused or not.

A chain of elementwise ops is given as a list of ``(name, reads, writes)``: the names of the
tensors each op reads and writes, in order. ``sizes`` maps every tensor name to its size in
bytes. Run one op at a time (eager torch), every op reads its inputs from memory and writes its
outputs back. Fused into one kernel, a tensor that is produced and consumed inside the chain
never leaves the chip, unless the caller needs it afterwards.

Write the two functions below. Check your work with

    pytest lessons/exercises/test_fusion_exercise.py

The test builds the op chains of the reference's rms_norm (with its residual), silu_and_mul and
rotary (reference/ops/) and compares your fused counts with what the Triton kernels load and
store. Until you edit this file the test reports your version as skipped and checks only the
solution.

한국어:
연습 문제(13강, "작은 연산 융합하기"): 연산 사슬의 메모리 트래픽, 융합했을 때와 안 했을 때.

원소별 연산의 사슬이 ``(name, reads, writes)``의 리스트로 주어집니다: 각 연산이 순서대로 읽고 쓰는
텐서의 이름입니다. ``sizes``는 텐서 이름마다 바이트 크기를 줍니다. 연산을 하나씩 실행하면(eager
torch) 모든 연산이 입력을 메모리에서 읽고 출력을 메모리에 다시 씁니다. 한 커널로 융합하면, 사슬
안에서 만들어지고 소비되는 텐서는 호출자가 나중에 필요로 하지 않는 한 칩을 떠나지 않습니다.

아래 두 함수를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_fusion_exercise.py

테스트는 레퍼런스의 rms_norm(잔차 포함), silu_and_mul, rotary(reference/ops/)의 연산 사슬을
만들고, 여러분이 센 융합 시의 바이트 수를 Triton 커널이 실제로 load하고 store하는 양과 비교합니다.
이 파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""


def unfused_bytes(ops: list[tuple[str, tuple[str, ...], tuple[str, ...]]],
                  sizes: dict[str, int]) -> int:
    """Bytes moved when every op runs as its own kernel."""
    raise NotImplementedError("exercise: implement unfused_bytes")


def fused_bytes(ops: list[tuple[str, tuple[str, ...], tuple[str, ...]]],
                sizes: dict[str, int], outputs: set[str]) -> int:
    """Bytes moved when the whole chain runs as one kernel.

    outputs: the tensors the rest of the model needs after the chain (they must be written).
    """
    # Which tensors must come from memory? (Hint: not the ones some op of the chain produces.)
    # How many times is a tensor read by two ops of the chain loaded?
    # Which produced tensors must go back to memory?
    raise NotImplementedError("exercise: implement fused_bytes")
