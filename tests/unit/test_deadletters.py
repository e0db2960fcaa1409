"""The replay rules by dead-letter reason family (``pipeline.cli.deadletters``): pure, one test per family."""

from __future__ import annotations

import pytest

from pipeline.cli.deadletters import (
    BatchState,
    NeedsCopy,
    Refusal,
    Replay,
    batch_gate,
    first_look,
    from_copy,
    resample_hint,
)
from pipeline.transport.consumer import dead_letter_fields
from schemas import BatchManifest, GroupRef, Limits, RolloutGroup, ScoredGroup, encode
from schemas.build import synthetic_rollout, synthetic_scored

LIMITS = Limits()
ROLLOUT = synthetic_rollout(2, 12, group_id="g")
SCORED = synthetic_scored(ROLLOUT, k=4)


def dead_letter(reason: str, source: str, payload: bytes | memoryview | None, *, stage: str = "teacher",
                mtype: bytes = b"rollout") -> dict[bytes, bytes]:
    original = {b"t": mtype, b"gid": b"g", **({b"d": bytes(payload)} if payload is not None else {})}
    fields = dead_letter_fields(stage, reason, source, "1-0", "c", original)
    return {k if isinstance(k, bytes) else k.encode(): v if isinstance(v, bytes) else str(v).encode()
            for k, v in fields.items()}  # as Redis hands them back


def test_teacher_dropped_replays_the_rollout_onto_rollouts() -> None:
    plan = first_look(dead_letter("teacher_dropped: teacher_error: timeout", "rollouts", encode(ROLLOUT)), None, LIMITS)
    assert isinstance(plan, Replay) and plan.target == "rollouts" and plan.msg == ROLLOUT
    assert plan.describe() == "sends it back to rollouts to be scored again (from its dead letter)"


@pytest.mark.parametrize(("source", "msg"), [("rollouts", ROLLOUT), ("scored", SCORED)])
def test_max_deliveries_replays_onto_the_source(source: str, msg: RolloutGroup | ScoredGroup) -> None:
    plan = first_look(dead_letter("max_deliveries: delivered 6 times", source, encode(msg)), None, LIMITS)
    assert isinstance(plan, Replay) and plan.target == source and plan.msg == msg and not plan.rescore


def test_max_deliveries_of_a_batch_replays_the_manifest() -> None:
    m = BatchManifest(batch_id="b", refs=[GroupRef("g", "k", "1-0", 24)], kl_coef=0.1)
    plan = first_look(dead_letter("max_deliveries: delivered 6 times", "batches", encode(m), mtype=b"batch"),
                      None, LIMITS)
    assert isinstance(plan, Replay) and plan.target == "batches" and plan.msg == m


def test_stale_is_refused_naming_the_resample_command() -> None:
    plan = first_look(dead_letter("stale: sampled by policy version 0, 9 versions behind", "scored", encode(SCORED),
                                  stage="learner"), None, LIMITS)
    assert isinstance(plan, Refusal) and "a replay would be dropped as stale again" in plan.why
    assert plan.todo == resample_hint("g")
    assert "distillq push --force FILE" in resample_hint("g")  # a pushed group: no prompt to sample again
    assert resample_hint("3:p7").endswith("distillq dlq resample 3:p7")


def test_payload_missing_looks_for_another_copy() -> None:
    fields = dead_letter("payload_missing: key k is gone", "scored", None, stage="learner", mtype=b"scored")
    need = first_look(fields, None, LIMITS)
    assert isinstance(need, NeedsCopy) and need.target == "scored" and "its payload is gone" in need.why
    none = from_copy(need, "g", None)
    assert isinstance(none, Refusal) and "no other copy of the group is left" in none.why
    rescore = from_copy(need, "g", ("5-0", ROLLOUT))
    assert isinstance(rescore, Replay) and rescore.target == "rollouts" and rescore.rescore and rescore.msg == ROLLOUT
    assert rescore.origin == "dead letter 5-0"
    scored = from_copy(need, "g", ("6-0", SCORED))
    assert isinstance(scored, Replay) and scored.target == "scored" and scored.msg == SCORED


def test_decode_error_of_a_group_looks_for_a_copy_and_of_a_rollout_says_to_push_a_valid_one() -> None:
    need = first_look(dead_letter("decode_error: x", "scored", b"\x00junk", stage="learner", mtype=b"scored"),
                      None, LIMITS)
    assert isinstance(need, NeedsCopy) and "its payload is invalid" in need.why
    plan = first_look(dead_letter("decode_error: x", "rollouts", b"\x00junk"), None, LIMITS)
    assert isinstance(plan, Refusal) and plan.why.startswith("still invalid:") and "distillq push --force" in plan.todo
    batch = first_look(dead_letter("decode_error: x", "batches", b"\x00junk", stage="learner"), None, LIMITS)
    assert isinstance(batch, Refusal) and "distillq dlq purge" in batch.todo


@pytest.mark.parametrize(("reason", "setting"), [
    ("output_too_large: 900 bytes exceeds max_message_bytes=800", "DISTILLQ_MAX_MESSAGE_BYTES"),
    ("batch_too_large: 900 bytes", "DISTILLQ_MAX_MESSAGE_BYTES"),
    ("oversize_group: 8 sequences > batch_size 4", "batch_size"),
])
def test_reasons_that_repeat_need_force(reason: str, setting: str) -> None:
    fields = dead_letter(reason, "rollouts", encode(ROLLOUT))
    plan = first_look(fields, None, LIMITS)
    assert isinstance(plan, Refusal) and setting in plan.todo and "distillq dlq replay --force ID" in plan.todo
    assert isinstance(first_look(fields, None, LIMITS, force=True), Replay)


def test_to_rollouts_scores_a_scored_group_again_and_a_wrong_type_is_refused() -> None:
    fields = dead_letter("max_deliveries: x", "scored", encode(SCORED), mtype=b"scored")
    plan = first_look(fields, "rollouts", LIMITS)
    assert isinstance(plan, Replay) and plan.rescore and plan.msg == ROLLOUT
    wrong = first_look(dead_letter("teacher_dropped: x", "rollouts", encode(ROLLOUT)), "scored", LIMITS)
    assert isinstance(wrong, Refusal) and "expected a ScoredGroup, got a RolloutGroup" in wrong.why


def test_an_unknown_source_is_refused() -> None:
    plan = first_look(dead_letter("whatever: x", "elsewhere", encode(ROLLOUT)), None, LIMITS)
    assert isinstance(plan, Refusal) and "unknown source stream 'elsewhere'" in plan.why


@pytest.mark.parametrize(("verdict", "expect"), [
    ("never", None), ("excluded", None),
    ("in_flight", "which the learner has not acknowledged yet"),
    ("trained", "it was trained already"),
    ("unknown", "cannot tell whether it was trained"),
])
def test_the_batch_gate(verdict: str, expect: str | None) -> None:
    got = batch_gate("g", BatchState(verdict, "7-0"))  # type: ignore[arg-type]
    assert (got is None) if expect is None else (got is not None and expect in got.why)
