"""Checks lesson 20's exercise: the verification rule gives plain decoding's tokens, and the
block arithmetic of a speculative step is the engine's.

    pytest lessons/exercises/test_spec_decode_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/spec_decode_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path.

The references: ``accepted_lengths`` in reference/ops/spec_decode.py (the rule over a batch of
runs), ``sample`` in reference/ops/sampling.py (the counter-based sampler: a row's token is a
function of its logits, its stream and its output position), the shipped tiny model, and the
engine itself (its scheduler's verification op, and its block tables seen by a step observer).
"""

import random

import pytest
import torch

from pagedllm.reference import LLM, NoCache, SamplingParams, load_model
from pagedllm.reference.ops.sampling import SamplingMetadata, SamplingRow, sample
from pagedllm.reference.ops.spec_decode import accepted_lengths
from pagedllm.reference.spec_decode import NgramProposer
from pagedllm.serving.default_model import default_model_dir

EXERCISE = "spec_decode_exercise"  # impl (conftest.py): the solution's file, then yours

PROBES = {"verify": ([1], [1, 2]), "lookahead_blocks": (4, 2, 1, 4)}
PROMPTS = [">>> x = 1\n>>> x = 1\n>>> x = 1\n>>>", "The with statement",
           ">>> s = 'a'\n>>> s\n'a'\n>>> s = 'b'\n>>> s\n"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, *PROBES[function])


@pytest.fixture(scope="module")
def tiny():
    """The shipped tiny model's folder and model, run on one torch thread (the machine is
    shared, and the model is tiny: more threads only wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    path = default_model_dir()
    yield path, load_model(path)
    torch.set_num_threads(before)


# -- the rule, on its own ----------------------------------------------------------------------
def test_verify_worked_examples(impl):
    verify = use(impl, "verify")
    assert verify([5, 6, 7], [5, 6, 7, 8]) == (3, 8), (
        "every proposal equals the target's token: all 3 are kept, and the last row's token "
        "comes for free"
        "\n제안이 모두 타깃의 토큰과 같습니다: 3개를 모두 남기고, "
        "마지막 행의 토큰은 덤으로 얻습니다")
    assert verify([5, 6, 7], [5, 9, 7, 8]) == (1, 9), (
        "the second proposal differs: keep the first, then take the target's own token (9); "
        "the third matched, but its row was computed after a wrong token and does not count"
        "\n둘째 제안이 다릅니다: 첫째만 남기고 타깃 자신의 토큰(9)을 씁니다. "
        "셋째는 일치했지만 그 행은 틀린 토큰 뒤에서 계산되었으므로 세지 않습니다")
    assert verify([9, 2, 3], [1, 2, 3, 4]) == (0, 1), (
        "the first proposal is wrong: nothing is kept, the step is a plain decode step"
        "\n첫 제안이 틀렸습니다: 아무것도 남지 않고, 이 스텝은 일반 디코드 스텝이 됩니다")
    assert verify([], [42]) == (0, 42), ("no proposals: one row, one token"
                                         "\n제안이 없으면: 행 하나, 토큰 하나")
    for proposals, targets in (([1, 2], [1, 2]), ([1], [1, 2, 3]), ([], [])):
        with pytest.raises(ValueError):
            verify(proposals, targets)


@pytest.mark.parametrize("seed", range(3))
def test_verify_matches_the_reference_op(impl, seed):
    """Random runs, with long runs of matches: your count is accepted_lengths' count."""
    verify = use(impl, "verify")
    rng = random.Random(seed)
    for _ in range(300):
        k = rng.randint(0, 6)
        targets = [rng.randrange(5) for _ in range(k + 1)]
        proposals = [t if rng.random() < 0.7 else rng.randrange(5) for t in targets[:k]]
        want = accepted_lengths(torch.tensor([targets]), torch.tensor([proposals]).view(1, k),
                                torch.tensor([k]))[0].item()
        got = verify(list(proposals), list(targets))
        assert got == (want, targets[want]), (
            f"proposals {proposals}, target tokens {targets}: you returned {got}, the rule "
            f"keeps {want} and then takes {targets[want]}"
            f"\n제안 {proposals}, 타깃 토큰 {targets}: 여러분은 {got}를 돌려주었고, 규칙은 "
            f"{want}개를 남긴 뒤 {targets[want]}를 씁니다")


# -- the rule against plain decoding, on the tiny model -----------------------------------------
def decode(model, prompt_ids: list[int], temperature: float, max_tokens: int,
           propose=None, verify=None, k: int = 4) -> tuple[list[int], int]:
    """(output tokens, forwards). Without `propose`: plain decoding, one token per forward.
    With it: each forward computes the sequence and up to k proposals, the sampler draws one
    token per row (row j at output position len(output) + j: the position plain decoding
    would draw it at), and `verify` says what is kept. Every forward recomputes the whole
    sequence (NoCache): slow in general, instant on the tiny model, and no KV to roll back."""
    vocab = model.config.vocab_size
    output, forwards = [], 0
    while len(output) < max_tokens:
        proposals = propose(prompt_ids, output, k)[:max_tokens - len(output) - 1] if propose \
            else []
        ids = prompt_ids + output + proposals
        rows = [SamplingRow(temperature=temperature, top_p=0.95, stream=7,
                            position=len(output) + j) for j in range(len(proposals) + 1)]
        last = torch.arange(len(ids) - len(rows), len(ids))  # the run's k + 1 rows
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.arange(len(ids)), NoCache(),
                           logits_indices=last)
        targets = sample(logits, SamplingMetadata.from_rows(rows, vocab)).token_ids.tolist()
        forwards += 1
        if not proposals:
            output.append(targets[0])
            continue
        accepted, next_token = verify(list(proposals), list(targets))
        output += proposals[:accepted] + [next_token]
    return output, forwards


def oracle(truth: list[int], wrong: float, seed: int):
    """Proposes plain decoding's own next tokens, each replaced by a random token with
    probability `wrong`: every acceptance pattern, long runs included."""
    rng = random.Random(seed)

    def propose(prompt_ids, output, k):
        n = len(output)
        return [t if rng.random() >= wrong else rng.randrange(4096) for t in truth[n:n + k]]
    return propose


def ngram(prompt_ids, output, k):
    return NgramProposer(k, prompt_lookup_max=3, prompt_lookup_min=1).lookup(
        prompt_ids + output, k)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_your_rule_decodes_exactly_as_plain_decoding(impl, tiny, temperature):
    verify = use(impl, "verify")
    path, model = tiny
    tokenizer = LLM(path).tokenizer
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        plain, plain_forwards = decode(model, ids, temperature, 20)
        for name, propose in (("oracle, all right", oracle(plain, 0.0, 0)),
                              ("oracle, 30 % wrong", oracle(plain, 0.3, 1)),
                              ("n-gram", ngram)):
            spec, forwards = decode(model, ids, temperature, 20, propose, verify)
            first = next((i for i, (a, b) in enumerate(zip(plain, spec, strict=False))
                          if a != b), None)
            assert spec == plain, (
                f"{prompt!r}, temperature {temperature}, proposals {name}: your rule's tokens "
                f"part from plain decoding's at output {first}: plain {plain}, yours {spec}"
                f"\n{prompt!r}, 온도 {temperature}, 제안 {name}: 여러분 규칙의 토큰이 "
                f"출력 {first}에서 일반 디코딩과 갈라집니다: 일반 {plain}, 여러분 {spec}")
            if name == "oracle, all right":
                assert forwards <= -(-20 // 5), (
                    f"every proposal was right, yet {forwards} forwards for 20 tokens: keep "
                    "every matching proposal, and the last row's token too"
                    f"\n제안이 모두 맞았는데 토큰 20개에 순전파 {forwards}번: 일치하는 제안을 모두 "
                    "남기고, 마지막 행의 토큰도 쓰세요")
        assert plain_forwards == 20


def test_the_engine_with_your_rule(impl, tiny):
    """Your rule as the scheduler's verification op: the engine's outputs are plain decoding's,
    greedy and seeded, and the steps it saves are the ones the solution saves."""
    verify = use(impl, "verify")
    path, _ = tiny
    calls = []

    def op(target_ids, draft_ids, num_draft):  # [B, K + 1], [B, K], [B] -> [B]
        kept = []
        for t, d, n in zip(target_ids.tolist(), draft_ids.tolist(), num_draft.tolist(),
                           strict=True):
            accepted, next_token = verify(d[:n], t[:n + 1])
            assert next_token == t[accepted], (
                f"proposals {d[:n]}, target tokens {t[:n + 1]}: after {accepted} accepted the "
                f"next token is the target's {t[accepted]}, not {next_token}"
                f"\n제안 {d[:n]}, 타깃 토큰 {t[:n + 1]}: {accepted}개를 수락한 뒤 다음 토큰은 "
                f"{next_token}가 아니라 타깃의 {t[accepted]}입니다")
            kept.append(accepted)
        calls.append(kept)
        return torch.tensor(kept, dtype=torch.int64)

    for params in (SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)):
        plain = [o.outputs[0].token_ids for o in LLM(path, block_size=4).generate(
            PROMPTS, params, use_tqdm=False)]
        llm = LLM(path, block_size=4, speculative_config=NGRAM)
        assert hasattr(llm.engine.scheduler, "verify_op"), (
            "the scheduler no longer takes its verification op as verify_op: this test needs "
            "updating\n스케줄러가 더 이상 검증 연산을 verify_op로 받지 않습니다: "
            "이 테스트를 고쳐야 합니다")
        llm.engine.scheduler.verify_op = op
        spec = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert spec == plain, ("the engine with your rule changed a token"
                               "\n여러분의 규칙을 쓴 엔진이 토큰을 바꿨습니다")
        assert llm.stats()["blocks_used"] == 0
    assert calls, ("the engine never called your rule: no run was verified"
                   "\n엔진이 여러분의 규칙을 한 번도 부르지 않았습니다: 검증한 실행이 없습니다")
    assert sum(map(sum, calls)) > 0, ("no proposal was ever accepted"
                                      "\n수락한 제안이 하나도 없습니다")


# -- the blocks of a speculative step -----------------------------------------------------------
def test_lookahead_blocks_worked_examples(impl):
    lookahead_blocks = use(impl, "lookahead_blocks")
    # 47 tokens computed, the 48th computed now, 4 proposals: 52 slots, 13 blocks of 4
    assert lookahead_blocks(47, 4, 4, 4) == (13, 13), (
        "all 4 accepted: the 52 slots stay, 13 blocks"
        "\n4개를 모두 수락하면 슬롯 52개가 그대로, 블록 13개")
    assert lookahead_blocks(47, 4, 0, 4) == (13, 12), (
        "none accepted: 48 slots stay, and the 13th block, which held only rejected proposals, "
        "goes back\n하나도 수락하지 않으면 슬롯 48개가 남고, 거절된 제안만 담은 13번째 블록은 "
        "반환됩니다")
    assert lookahead_blocks(10, 0, 0, 16) == (1, 1), ("a plain decode step books one slot"
                                                      "\n일반 디코드 스텝은 슬롯 하나를 예약합니다")
    assert lookahead_blocks(14, 3, 1, 16) == (2, 1)
    assert lookahead_blocks(15, 3, 1, 16) == (2, 2), (
        "15 computed, the 16th computed now and 1 proposal accepted: 17 tokens keep their K/V, "
        "2 blocks (this step's own token keeps its slot too)"
        "\n계산된 15개에 지금 계산하는 16번째와 수락한 제안 1개: K/V를 가진 토큰 17개, "
        "블록 2개(이번 스텝의 토큰도 자기 슬롯을 유지합니다)")
    assert lookahead_blocks(16, 3, 1, 16) == (2, 2)
    for accepted in (-1, 4):
        with pytest.raises(ValueError):
            lookahead_blocks(8, 3, accepted, 4)


def test_lookahead_blocks_are_the_engines(impl, tiny):
    """Every step of n-gram speculation on the tiny model, blocks of 4 slots: the block table's
    length while the step runs, and after the rejected slots went back."""
    lookahead_blocks = use(impl, "lookahead_blocks")
    path, _ = tiny
    llm = LLM(path, block_size=4, speculative_config=NGRAM)
    engine = llm.engine
    before = {}

    def observe(engine, sched, inputs):  # just before the forward: the slots are booked
        item = sched.scheduled[0]
        before.update(seq=item.seq, computed=item.seq.num_computed_tokens,
                      k=len(item.spec_token_ids), blocks=len(engine.kv.get_block_ids(item.seq)[0]))

    engine.add_step_observer(observe)
    checked = 0
    for prompt in PROMPTS:
        engine.add_request(prompt, prompt, SamplingParams(temperature=0, max_tokens=40,
                                                          ignore_eos=True))
        engine.step()  # the prefill
        while engine.has_unfinished_requests():
            accepted_before = engine.scheduler.spec_metrics.num_accepted_tokens
            engine.step()
            seq = before["seq"]
            if seq.is_finished:
                break  # its blocks all went back
            accepted = engine.scheduler.spec_metrics.num_accepted_tokens - accepted_before
            got = lookahead_blocks(before["computed"], before["k"], accepted, 4)
            want = (before["blocks"], len(engine.kv.get_block_ids(seq)[0]))
            assert got == want, (
                f"{before['computed']} tokens computed, {before['k']} proposals, {accepted} "
                f"accepted, blocks of 4: the engine booked {want[0]} blocks and kept {want[1]}, "
                f"you said {got}"
                f"\n계산된 토큰 {before['computed']}개, 제안 {before['k']}개, 수락한 제안 "
                f"{accepted}개, 블록당 슬롯 4개: 엔진은 블록 {want[0]}개를 예약하고 {want[1]}개를 "
                f"남겼는데, 여러분은 {got}라고 했습니다")
            checked += before["k"] > 0
    assert checked >= 5, checked
