"""Structured outputs (xgrammar) in both tiers, on the shipped tiny model: every finished output
follows its JSON schema, regex, choice or grammar; seeded sampling with a grammar stays
reproducible; n > 1 forks and preemption by recompute keep each sequence's matcher right; a
schema that cannot finish within max_tokens ends with "length"; malformed specs are refused
by name, leaving the engine and its other requests as they were."""

import copy
import json
import pickle
import re
import threading

import jsonschema
import pytest

from pagedllm import optimized, reference
from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams as Spec
from pagedllm.reference.engine.structured_outputs import params as so_params
from pagedllm.reference.engine.validation import FieldValueError
from pagedllm.serving.default_model import default_model_dir

PROMPTS = ["The with statement", "def main():", "A list is", "Return the"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "kind"]}
EMAIL = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "it depends"]
PAREN_NUMBER = ('root ::= "(" digits ")"\n'
                'digits ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]')


@pytest.fixture(scope="module")
def llm(tier):
    return tier.LLM(default_model_dir(), block_size=4, seed=0)


def generate(tier, llm, spec, prompts=PROMPTS, **params) -> list:
    params = {"max_tokens": 64, "temperature": 1.0, "seed": 7, **params}
    outs = llm.generate(prompts, tier.SamplingParams(structured_outputs=spec, **params),
                        use_tqdm=False)
    assert llm.stats()["blocks_used"] == 0  # every block came back
    return [c for o in outs for c in o.outputs]


def test_json_schema_outputs_parse_and_validate(tier, llm):
    for seed in (1, 2):
        for c in generate(tier, llm, Spec(json=PERSON), seed=seed):
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)
            # properties in the schema's order, compact separators (any_whitespace=False)
            assert list(json.loads(c.text)) == ["name", "age", "kind"]


def test_a_schema_given_as_text_is_the_same_spec(tier, llm):
    as_dict = generate(tier, llm, Spec(json=PERSON), prompts=PROMPTS[:2])
    as_text = generate(tier, llm, Spec(json=json.dumps(PERSON)), prompts=PROMPTS[:2])
    assert [c.token_ids for c in as_dict] == [c.token_ids for c in as_text]
    assert Spec(json=PERSON).key == Spec(json=json.dumps(PERSON)).key


def test_choice_regex_grammar_and_json_object(tier, llm):
    for c in generate(tier, llm, Spec(choice=CHOICES)):
        assert c.finish_reason == "stop" and c.text in CHOICES
    for c in generate(tier, llm, Spec(regex=EMAIL)):
        assert c.finish_reason == "stop" and re.fullmatch(EMAIL, c.text), c.text
    for c in generate(tier, llm, Spec(grammar=PAREN_NUMBER)):
        assert c.finish_reason == "stop" and re.fullmatch(r"\(\d{1,3}\)", c.text), c.text
    # Any object: this model sometimes closes it at once, sometimes writes a key forever
    outs = generate(tier, llm, Spec(json_object=True), max_tokens=32)
    assert any(c.finish_reason == "stop" for c in outs)
    for c in outs:
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text


def test_the_eos_ends_the_grammar_and_the_text_leaves_it_out(tier, llm):
    """The grammar's end allows only EOS: the sequence ends there with "stop" (no stop
    reason, as for any EOS); EOS is the last token id and not in the text. Even with
    min_tokens and ignore_eos, which would otherwise keep it going: nothing may follow."""
    eos = llm.tokenizer.eos_token_id
    for extra in ({}, {"min_tokens": 10}, {"ignore_eos": True}):
        for c in generate(tier, llm, Spec(choice=["yes"]), temperature=0.0, **extra):
            assert (c.text, c.finish_reason, c.stop_reason) == ("yes", "stop", None)
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]


def test_seeded_sampling_with_a_grammar_is_reproducible(tier, llm):
    spec = Spec(json=PERSON)
    batched = generate(tier, llm, spec, seed=11)
    again = generate(tier, llm, spec, seed=11)
    assert [c.token_ids for c in batched] == [c.token_ids for c in again]
    alone = [generate(tier, llm, spec, prompts=[p], seed=11)[0] for p in PROMPTS[:2]]
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched[:2]]
    other = generate(tier, llm, spec, seed=12)
    assert [c.token_ids for c in other] != [c.token_ids for c in batched]


def test_n_samples_fork_their_matchers(tier, llm):
    """Sample i of an n = 3 request is the request with seed + i alone: each forked sequence
    follows the grammar from where the prompt left it, in its own parser."""
    spec = Spec(json=PERSON)
    forked = generate(tier, llm, spec, prompts=PROMPTS[:2], n=3, seed=20)
    assert len(forked) == 6
    for c in forked:
        jsonschema.validate(json.loads(c.text), PERSON)
    for p, prompt in enumerate(PROMPTS[:2]):
        for i in range(3):
            alone = generate(tier, llm, spec, prompts=[prompt], seed=20 + i)[0]
            assert forked[3 * p + i].token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in forked[:3]}) > 1  # the samples differ


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_continue_in_their_grammar(tier, mode):
    """A KV pool too small for all requests at once: sequences are preempted halfway through
    their JSON, come back and finish it; the outputs are those of a pool big enough."""
    spec = Spec(json=PERSON)
    params = tier.SamplingParams(structured_outputs=spec, max_tokens=64, temperature=1.0,
                                 seed=3, n=2)
    prompts = PROMPTS * 2
    roomy = tier.LLM(default_model_dir(), block_size=4, seed=0)
    want = roomy.generate(prompts, params, use_tqdm=False)
    swap = {"preemption_mode": "swap", "swap_space_blocks": 64} if mode == "swap" else {}
    tight = tier.LLM(default_model_dir(), block_size=4, seed=0, num_gpu_blocks=40, **swap)
    got = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.stats()
    assert stats[f"preemptions_{mode}"] > 0 and stats["blocks_used"] == 0
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in want]
    for o in got:
        for c in o.outputs:
            jsonschema.validate(json.loads(c.text), PERSON)


def test_a_schema_that_cannot_finish_ends_with_length(tier, llm):
    """max_tokens comes first: finish_reason "length", and the text is what the grammar had
    accepted so far: a prefix of a valid document, not one (it does not parse)."""
    spec = Spec(json={"type": "object", "properties": {"text": {"type": "string",
                                                                "minLength": 200}},
                      "required": ["text"]})
    for c in generate(tier, llm, spec, max_tokens=12):
        assert c.finish_reason == "length" and len(c.token_ids) == 12
        assert c.text.startswith('{"text": "')
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)


def test_both_tiers_give_the_same_tokens_greedily():
    outs = {}
    for tier in (reference, optimized):
        llm = tier.LLM(default_model_dir(), block_size=4, seed=0)
        outs[tier.__name__] = [
            [c.token_ids for c in generate(tier, llm, spec, temperature=0.0)]
            for spec in (Spec(json=PERSON), Spec(regex=EMAIL), Spec(choice=CHOICES),
                         Spec(json_object=True))]
    assert outs["pagedllm.reference"] == outs["pagedllm.optimized"]


@pytest.mark.parametrize("kwargs, reason", [
    ({"json": {"type": "objekt"}}, 'Unsupported type "objekt"'),
    ({"json": '{"type": "object",'}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON schema"),
    ({"regex": "[a-"}, "Unclosed '['"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
    ({"grammar": 'start ::= "a"'}, "root"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "non-empty list"),
    ({"choice": ["yes", ""]}, "non-empty strings"),
    ({"json_object": "yes"}, "must be true"),
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
])
def test_malformed_specs_are_refused_by_name(kwargs, reason):
    with pytest.raises(ValueError, match=re.escape(reason)) as err:
        Spec(**kwargs)
    assert err.value.field == "structured_outputs"


def test_structured_outputs_must_be_the_params_class():
    with pytest.raises(TypeError) as err:
        reference.SamplingParams(structured_outputs={"json": PERSON})
    assert err.value.field == "structured_outputs"


def test_a_refusal_at_the_door_leaves_the_engine_and_its_requests_alone(tier, checkpoints):
    """An engine without a tokenizer (a random checkpoint's folder without one) refuses a
    structured output by name at add_request; the request already running does not notice,
    and no block leaks."""
    llm = tier.LLM(checkpoints["llama3"], block_size=4)
    engine = llm.engine
    engine.tokenizer = None  # as a model folder without a tokenizer
    engine.eos_token_id = None
    plain = tier.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 14, 3]}
    engine.add_request("a", prompt, plain)
    engine.step()
    with pytest.raises(FieldValueError, match="tokenizer") as err:
        engine.add_request("b", prompt, tier.SamplingParams(
            structured_outputs=Spec(choice=["x"])))
    assert err.value.field == "structured_outputs" and "b" not in engine.groups
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    alone = tier.LLM(checkpoints["llama3"], block_size=4).generate([prompt], plain,
                                                                   use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert engine.stats()["blocks_used"] == 0


def test_a_repeated_spec_is_compiled_once(tier, llm):
    generate(tier, llm, Spec(regex="[0-9]{3}"), prompts=PROMPTS[:1], max_tokens=4)
    cache = llm.engine.grammars.compiler.cache
    before = cache.compiles
    for _ in range(3):
        generate(tier, llm, Spec(regex="[0-9]{3}"), prompts=PROMPTS[:1], max_tokens=4)
    assert cache.compiles == before
    generate(tier, llm, Spec(regex="[0-9]{4}"), prompts=PROMPTS[:1], max_tokens=5)
    assert cache.compiles == before + 1


def test_a_new_grammar_compiles_while_the_other_requests_step(tier, llm):
    """The compile runs on the compiler's thread: held there (an Event), it holds up only its
    own request, which waits outside the scheduler, while the running request decodes; once
    released, the request runs and follows its grammar."""
    engine = llm.engine
    generate(tier, llm, Spec(choice=["warm"]), prompts=PROMPTS[:1])  # the compiler exists
    compiler = engine.grammars.compiler
    release, original = threading.Event(), compiler._compile
    compiler._compile = lambda spec: release.wait(60) and original(spec)
    plain = tier.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": llm.tokenizer("A list is")["input_ids"]}
    try:
        engine.add_request("plain", prompt, plain)
        engine.add_request("held", prompt, tier.SamplingParams(
            temperature=0.0, max_tokens=12, structured_outputs=Spec(regex="[0-9]{5}")))
        for _ in range(4):
            engine.step()
        assert len(engine.groups["plain"].seqs[0].output_token_ids) == 4
        held = engine.groups["held"]
        assert held.seqs[0].output_token_ids == [] and held.grammar is None
        assert engine.stats()["waiting"] == 1 and engine.has_unfinished_requests()
    finally:
        release.set()
        compiler._compile = original
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert re.fullmatch("[0-9]{5}", outs["held"].text) and outs["held"].finish_reason == "stop"
    alone = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    assert outs["plain"].token_ids == alone.token_ids
    assert engine.stats()["blocks_used"] == 0


def test_a_failed_compile_ends_only_its_request(tier, llm):
    """A compile that fails after the spec parsed (the compiler raises) ends its request with
    finish_reason "error"; nothing else notices, no block is held."""
    engine = llm.engine
    generate(tier, llm, Spec(choice=["warm"]), prompts=PROMPTS[:1])
    compiler = engine.grammars.compiler

    def broken(spec):
        raise FieldValueError("structured_outputs", "injected compile failure")

    compiler._compile, original = broken, compiler._compile
    try:
        params = tier.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate([PROMPTS[0], PROMPTS[1]], [params, tier.SamplingParams(
            max_tokens=6, structured_outputs=Spec(regex="[a-z]{7}"))], use_tqdm=False)
    finally:
        compiler._compile = original
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert outs[0].outputs[0].token_ids == generate(
        tier, llm, None, prompts=PROMPTS[:1], temperature=0.0, max_tokens=6,
        ignore_eos=True)[0].token_ids
    assert engine.stats()["blocks_used"] == 0 and not engine.has_unfinished_requests()


# -- issue 38: what nothing satisfies, schemas past the limits, one conversion ----------------
def nested_arrays(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("kwargs, reason", [
    ({"regex": r"[^\s\S]"}, "nothing can satisfy structured_outputs.regex"),
    ({"grammar": 'root ::= root "a"'}, "nothing can satisfy structured_outputs.grammar"),
    ({"grammar": 'root ::= x\nx ::= x "b" | root'}, "nothing can satisfy"),
    ({"json": nested_arrays(so_params.MAX_SCHEMA_DEPTH)},
     f"a schema may nest at most {so_params.MAX_SCHEMA_DEPTH}"),
    ({"json": "[" * 100_000}, "nested too deep"),
    ({"json": {"anyOf": [{"$ref": "#/$defs/a"}] * (so_params.MAX_SCHEMA_REFS + 1),
               "$defs": {"a": {"type": "integer"}}}},
     f"at most {so_params.MAX_SCHEMA_REFS}"),
], ids=["empty-class", "left-recursive", "mutually-left-recursive", "deep-schema",
        "deep-schema-text", "too-many-refs"])
def test_specs_nothing_satisfies_or_past_the_limits_are_refused(kwargs, reason):
    with pytest.raises(ValueError, match=re.escape(reason)) as err:
        Spec(**kwargs)
    assert err.value.field == "structured_outputs"


def test_the_limits_themselves_and_a_spec_that_only_allows_empty_text_are_accepted():
    Spec(json=nested_arrays(so_params.MAX_SCHEMA_DEPTH - 1))  # the string leaf: one more
    Spec(json={"anyOf": [{"$ref": "#/$defs/a"}] * so_params.MAX_SCHEMA_REFS,
               "$defs": {"a": {"type": "integer"}}})
    Spec(grammar='root ::= ""')  # the empty text satisfies it: EOS may come first


def test_a_grammar_no_token_of_the_vocabulary_can_start_fails_its_compile():
    """The params check the grammar against the 256 bytes; a vocabulary without byte fallback
    may still have no token the grammar allows first: the compile refuses it by name (its
    request then ends with finish_reason "error", which a server answers as a 400)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from pagedllm.reference.engine.structured_outputs.grammar import GrammarCache

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="</s>"))
    cache = GrammarCache(PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>"),
                         vocab_size=3, eos_token_id=2)
    assert cache.get(Spec(regex="a+b")) is not None
    with pytest.raises(FieldValueError, match="no token of its vocabulary") as err:
        cache.get(Spec(regex="c+"))
    assert err.value.field == "structured_outputs" and cache.compiles == 1


def test_the_grammar_made_with_the_params_is_the_one_compiled(tier, llm, monkeypatch):
    """The schema is converted once, when the params are made (a server makes them off its
    event loop): the compile thread compiles that Grammar and does not convert again."""
    xgr = so_params.load_xgrammar()
    calls, original = [], xgr.Grammar.from_json_schema

    def counted(schema, *args, **kwargs):
        calls.append(schema)
        return original(schema, *args, **kwargs)

    monkeypatch.setattr(xgr.Grammar, "from_json_schema", staticmethod(counted))
    spec = Spec(json={"type": "string", "maxLength": 3, "description": tier.__name__})
    assert spec.to_grammar() is spec.to_grammar()
    out = generate(tier, llm, spec, prompts=PROMPTS[:1], max_tokens=8)[0]
    assert out.finish_reason == "stop" and len(calls) == 1


def test_the_params_pickle_and_copy_without_their_grammar():
    """A data-parallel replica gets the params pickled; xgrammar's Grammar does not pickle,
    so it stays behind and the copy converts again when it is compiled."""
    spec = Spec(json=PERSON)
    for copied in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec), copy.copy(spec)):
        assert copied == spec and copied.key == spec.key
        assert str(copied.to_grammar()) == str(spec.to_grammar())
