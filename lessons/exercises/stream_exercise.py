"""Exercise (lesson 15, "Serving it"): what a stream may send, step by step.

The engine reports a request's whole text after every step (``RequestOutput.outputs[0].text``,
cumulative). A streaming server sends only what is new. One catch: when a stop string
completes, the engine cuts it out of the text, and the last snapshot is *shorter* than the one
before. Text already sent cannot be taken back, so while the request runs the server holds back
the last ``longest_stop - 1`` characters: they might be the start of a stop string.

Write ``stream_deltas``: given the snapshots of one request (the last one is the final text,
after the request finished) and the length of its longest stop string (0 when it has none),
return the text sent after each snapshot, one string per snapshot (empty when nothing may be
sent yet). Check your work with

    pytest lessons/exercises/test_stream_exercise.py

The test runs the tiny model with stop strings step by step and checks that your deltas add up
to the final text, never send a character that is later cut, and hold back no more than
needed. Until you edit this file the test reports your version as skipped and checks only the
solution.

한국어:
연습 문제(15강, "서빙하기"): 스트림이 스텝마다 보내도 되는 것.

엔진은 스텝이 끝날 때마다 요청의 텍스트 전체를 보고합니다(``RequestOutput.outputs[0].text``,
누적). 스트리밍 서버는 새로 생긴 부분만 보냅니다. 함정이 하나 있습니다: 정지 문자열(stop string)이
완성되면 엔진이 그것을 텍스트에서 잘라 내므로, 마지막 스냅샷이 그 직전 것보다 *짧아집니다*. 이미
보낸 텍스트는 되돌릴 수 없으므로, 요청이 실행되는 동안 서버는 마지막 ``longest_stop - 1``개 문자를
보내지 않고 붙잡아 둡니다: 정지 문자열의 시작일 수 있기 때문입니다.

``stream_deltas``를 작성하세요: 한 요청의 스냅샷들(마지막 것은 요청이 끝난 뒤의 최종 텍스트)과
가장 긴 정지 문자열의 길이(없으면 0)가 주어지면, 스냅샷마다 그 뒤에 보내는 텍스트를 스냅샷당
문자열 하나로 돌려줍니다(아직 아무것도 보낼 수 없으면 빈 문자열). 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_stream_exercise.py

테스트는 작은 모델을 정지 문자열과 함께 스텝 단위로 돌리고, 여러분의 델타를 이어 붙이면 최종
텍스트가 되는지, 나중에 잘리는 문자를 보내지 않는지, 필요 이상으로 붙잡아 두지 않는지 확인합니다.
이 파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""


def stream_deltas(snapshots: list[str], longest_stop: int) -> list[str]:
    """The delta sent after each snapshot; ''.join(result) == snapshots[-1].

    Example: snapshots ["The", "The en", "The"], one stop string " end" (4 characters,
    3 held back): after "The" nothing is safe (""); after "The en", the first 3 characters
    ("The"); the request then finished with " end" cut: the rest of "The" is "".
    """
    # While running (every snapshot but the last): everything up to len(text) - (longest_stop
    # - 1) is safe; never move backwards (a snapshot may be no longer than the last).
    # The last snapshot is final: send the rest of it.
    raise NotImplementedError("exercise: implement stream_deltas")
