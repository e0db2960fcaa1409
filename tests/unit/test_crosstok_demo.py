"""``demo --cross-tokenizer``'s held-out reverse KL on text: on one tokenizer it is the token-level figure of the same
tokens; across tokenizers the teacher scores its own tokens of the same text; a completion that is not UTF-8 text is
scored on the byte fallback and counted."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.demo.crosstok_demo import (
    TEACHER_VOCAB_SIZE,
    Side,
    cross_stats,
    ensure_cross_models,
    heldout_questions,
    sequence_kl,
    text_reverse_kl,
    token_logprobs,
)
from pipeline.demo.pretrain import chat_ids
from pipeline.demo.tinymodels import ensure_tiny_models, is_heldout

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sides() -> tuple[Side, Side, Side]:
    """The tiny student (all 256 bytes), the tiny teacher on the student's tokenizer, and the teacher of a tokenizer
    of its own (untrained: the figures are compared, not their size)."""
    tiny = ensure_tiny_models()
    return Side.load(tiny.student), Side.load(tiny.teacher), Side.load(ensure_cross_models().teacher)


@pytest.fixture(scope="module")
def cross_student() -> Side:
    """The demo's student (untrained): the plain demo's, on the shared tiny tokenizer over all 256 bytes."""
    return Side.load(ensure_cross_models().student)


def ids(side: Side, text: str) -> list[int]:
    return [int(t) for t in side.tokenizer(text, add_special_tokens=False)["input_ids"]] + \
        [int(side.tokenizer.eos_token_id)]


def test_each_tokenizer_has_its_own_vocabulary_and_the_same_markup(sides: tuple[Side, Side, Side],
                                                                    cross_student: Side) -> None:
    plain, _, cross = sides
    student = cross_student
    assert ensure_cross_models().student == ensure_tiny_models().student  # the plain demo's student
    assert len(cross.tokenizer) == TEACHER_VOCAB_SIZE and len(student.tokenizer) == len(plain.tokenizer) == 416
    assert sorted(cross.vocab.special.values()) == sorted(student.vocab.special.values())
    assert len(ids(student, "68")) == 2 and len(ids(cross, "68")) == 3  # other merges: "68" is one token, or two
    # both have a token for every byte: whatever the student samples, the teacher reads (on the byte fallback)
    assert all(v.byte_id(b) is not None for v in (student.vocab, cross.vocab) for b in range(256))
    for side in (student, cross):
        assert side.tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False,
                                                  add_generation_prompt=True) == "<|user|>1+2=<|assistant|>"


def test_on_one_tokenizer_it_is_the_token_level_figure(sides: tuple[Side, Side, Side]) -> None:
    student, teacher, _ = sides
    for question, answer in (("12+30=", "42"), ("7+9=", "16"), ("25+25=", "50")):
        completion = ids(student, answer)
        prompt = chat_ids(student.tokenizer, question)
        direct = float(np.sum(token_logprobs(student.model, prompt, completion)
                              - token_logprobs(teacher.model, prompt, completion)))
        kl, nbytes, fallback = sequence_kl(student, teacher, question, completion)
        assert kl == pytest.approx(direct, abs=1e-4)
        assert (nbytes, fallback) == (len(answer), False)


def test_across_tokenizers_the_teacher_scores_its_own_tokens_of_the_text(sides: tuple[Side, Side, Side],
                                                                          cross_student: Side) -> None:
    _, _, cross = sides
    student = cross_student
    question, answer = "31+37=", "68"
    completion = ids(student, answer)
    own = ids(cross, answer)
    assert len(own) == len(completion) + 1
    s_lp = token_logprobs(student.model, chat_ids(student.tokenizer, question), completion).sum()
    t_lp = token_logprobs(cross.model, chat_ids(cross.tokenizer, question), own).sum()
    kl, nbytes, fallback = sequence_kl(student, cross, question, completion)
    assert kl == pytest.approx(float(s_lp - t_lp), abs=1e-4)
    assert (nbytes, fallback) == (2, False)


def test_a_completion_that_is_not_text_is_scored_on_the_byte_fallback(sides: tuple[Side, Side, Side]) -> None:
    student, _, cross = sides
    s_tok, t_tok = student.tokenizer, cross.tokenizer
    # the byte 0xC3 alone, then "1" and a lone continuation byte 0xA9: not UTF-8
    completion = [*ids(student, "4")[:-1], s_tok.convert_tokens_to_ids("Ã"), *ids(student, "1")[:-1],
                  s_tok.convert_tokens_to_ids("©"), int(s_tok.eos_token_id)]
    kl, nbytes, fallback = sequence_kl(student, cross, "1+3=", completion)
    own = [*ids(cross, "4")[:-1], t_tok.convert_tokens_to_ids("Ã"), *ids(cross, "1")[:-1],
           t_tok.convert_tokens_to_ids("©"), int(t_tok.eos_token_id)]  # the teacher's single-byte tokens
    s_lp = token_logprobs(student.model, chat_ids(s_tok, "1+3="), completion).sum()
    t_lp = token_logprobs(cross.model, chat_ids(t_tok, "1+3="), own).sum()
    assert fallback and nbytes == 4
    assert kl == pytest.approx(float(s_lp - t_lp), abs=1e-4)


def test_the_mean_over_held_out_prompts_per_completion_and_per_byte(sides: tuple[Side, Side, Side],
                                                                     cross_student: Side) -> None:
    _, _, cross = sides
    questions = heldout_questions(12)
    assert all(is_heldout(*(int(x) for x in q[:-1].split("+"))) for q in questions)
    a = text_reverse_kl(cross_student, cross, questions, seed=3)
    b = text_reverse_kl(cross_student, cross, questions, seed=3)
    assert a == b  # common random numbers: the same samples for the same weights
    assert a.sequences == 12 and a.text_bytes > 0
    assert a.byte_fallback > 0  # the untrained student writes bytes that are not text: scored, not skipped
    assert a.per_byte == pytest.approx(a.per_sequence * a.sequences / a.text_bytes)
    assert math.isfinite(a.per_sequence) and a.per_sequence > 0  # an untrained student, far from the teacher


def test_cross_stats_where_the_records_carry_them() -> None:
    assert cross_stats([{"step": 1.0, "tokens": 10.0}]) == {}
    got = cross_stats([{"step": 1.0, "tokens": 10.0, "cross.aligned_share": 0.8, "cross.topk_mapped_mass": 0.5},
                       {"step": 2.0, "tokens": 30.0, "cross.aligned_share": 1.0, "cross.topk_mapped_mass": 0.9}])
    assert got == {"aligned_token_share": pytest.approx(38 / 40), "topk_mapped_mass": pytest.approx(32 / 40)}


@pytest.mark.parametrize(("extra", "named"), [({"real": True}, "--real"), ({"teachers": 2}, "--teachers 2")])
def test_the_flag_is_refused_with_another_pair(extra: dict[str, object], named: str) -> None:
    import argparse

    from pipeline.cli.commands.demo import check_args
    from pipeline.stages.exits import EXIT_USAGE, CliError

    args = argparse.Namespace(**{"real": False, "teachers": 1, "cross_tokenizer": True, "weights_url": None, **extra})
    with pytest.raises(CliError) as e:
        check_args(args)
    assert e.value.status == EXIT_USAGE and e.value.message.endswith(f"not with {named}")
    check_args(argparse.Namespace(real=False, teachers=1, cross_tokenizer=True, weights_url=None))  # alone: fine
