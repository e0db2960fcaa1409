"""An example learner that trains a (tiny, local) student on the feeder's batches.

    python -m pipeline.demo.learner --student DIR --weights-dir DIR [--eval-teacher DIR] --steps 300

Per step: read a batch (``pipeline.learner.client.Learner``), ``to_torch`` it, and minimise

    pg_weight * importance-sampled policy gradient on the feeder's per-token advantages
              (coef * (teacher logprob - student logprob) of each sampled token: reverse KL)
  + kd_weight * top-k forward KL to the teacher (with a tail bucket)

then every ``checkpoint_every`` steps (and at the last) checkpoint (model, optimizer, step, version and the ids
of the batches trained since the last one: ``pipeline.learner.checkpoint``) and ack the batches that checkpoint
holds, and every ``sync_every`` steps publish the weights (a Hugging Face checkpoint folder per version,
``Learner.publish_weights``) and the new policy version, which rollout workers and student servers pick up.
In that order a crash loses no acknowledged update and trains no batch twice into the weights: the batches
trained since the last checkpoint are unacknowledged, so they come back and are trained again from it (at most
``checkpoint_every`` of them); a restarted learner restores its checkpoint, publishes its weights again (under a
version above any published before the crash, so the samplers load them), and acknowledges without training a
redelivered batch that the checkpoint already holds. Each step's figures go to ``--metrics-file`` (JSONL):
the losses, the sampler-trainer KL of the batch's tokens and the share of them the PPO clip held, the seconds
of each phase (``wait_s`` for the batch, ``forward_backward_s``, ``optimizer_s``, ``checkpoint_s``,
``publish_s``, ``eval_s``), the batch's sampled reverse KL (and its ``cross.*`` stats where a teacher of another
tokenizer scored its groups) and, every ``eval_every`` steps, the exact reverse KL to the teacher on held-out prompts
(the tiny arithmetic task's, or ``--heldout-file``'s: JSONL rows with ``messages``, the reverse KL on the first
``--eval-kl-prompts`` of them where given; where they carry ``accept`` answers, the student's task accuracy at
the first and last step and the teacher's at the first, on all of them, as ``heldout_task_accuracy`` and
``teacher_task_accuracy``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any, Literal

import structlog
import torch
from pydantic import Field

from pipeline.config import add_redis_args
from pipeline.demo.tinymodels import arithmetic_problem
from pipeline.errors import ConfigurationError
from pipeline.flags import Flag, FlagSettings, HelpFormatter, add_flags, from_args
from pipeline.learner import losses
from pipeline.learner.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from pipeline.learner.chunked import gather_logprobs
from pipeline.learner.client import Learner, LearnerBatch
from pipeline.learner.teacher_weights import parse_teacher_weights, weigh
from pipeline.learner.torch_batch import TorchBatch, to_torch
from pipeline.models.weights import load_causal_lm
from pipeline.stages.exits import run_command
from pipeline.weightstore.stores import is_url
from schemas import TrainBatch

log = structlog.get_logger("distillq.example_learner")
#: a checkpoint keeps the ids of the last 64 batches it holds (``pipeline.learner.checkpoint``): every batch of a
#: checkpoint interval must be among them for a redelivered one to be recognised
MAX_CHECKPOINT_EVERY = 64


@dataclass
class LearnerConfig:
    student: str
    weights_dir: str
    steps: int = 300
    lr: float = 2e-3
    lr_decay: str = "none"  # or "linear": from lr at step 1 to 0 at ``steps`` (a function of the step)
    pg_weight: float = 1.0
    kd_weight: float = 1.0
    clip: float = 0.2
    sync_every: int = 1
    checkpoint_every: int = 1  # checkpoint, then ack the batches it holds, every N steps (and at the last)
    eval_teacher: str | None = None
    eval_every: int = 25
    eval_prompts: int = 48
    eval_kl_prompts: int | None = None  # the reverse KL on the first N held-out prompts only (None: all)
    heldout_file: str | None = None
    device: str = "cpu"
    eval_max_new: int = 8
    metrics_file: str | None = None
    trained_log: str | None = None  # JSONL: the restored step at each start, and each step's batch and group ids
    batch_timeout_s: float = 60.0
    redis_url: str | None = None
    namespace: str | None = None
    seed: int = 0
    checkpoint_dir: str | None = None  # default: <weights_dir>/checkpoint
    teacher_weight: str | None = None  # "math=1,code=0.5": a weight per teacher pool (``learner.teacher_weights``)


def heldout_prompts(tokenizer: Any, n: int, seed: int = 12345) -> list[list[int]]:
    from pipeline.demo.pretrain import chat_ids

    rng = random.Random(seed)
    return [chat_ids(tokenizer, arithmetic_problem(rng, "heldout")[0]) for _ in range(n)]


def read_heldout(path: str, n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of a held-out JSONL file (each with ``messages``, optionally ``accept``)."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:n]


def message_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids: list[int] = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                   return_dict=False)
    return ids


class Evaluator:
    """Held-out figures of the student against the teacher: exact reverse KL, and task accuracy where the
    held-out rows carry ``accept`` answers."""

    def __init__(self, cfg: LearnerConfig, student: Any, tokenizer: Any) -> None:
        self.cfg, self.student, self.tokenizer = cfg, student, tokenizer
        self.teacher = load_causal_lm(cfg.eval_teacher).to(cfg.device) if cfg.eval_teacher else None
        rows = read_heldout(cfg.heldout_file, cfg.eval_prompts) if cfg.heldout_file else []
        self.task_rows = [r for r in rows if r.get("accept")] if self.teacher is not None else []
        if self.teacher is None:
            self.prompts: list[list[int]] = []
        elif rows:
            self.prompts = [message_ids(tokenizer, r["messages"]) for r in rows[:cfg.eval_kl_prompts]]
        else:
            self.prompts = heldout_prompts(tokenizer, cfg.eval_prompts)
        self.eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [2]

    def reverse_kl(self, step: int) -> float:
        from pipeline.models.evaluation import reverse_kl_on_prompts

        self.student.eval()
        # the same sampling seed at every evaluation: start and end are compared on common random numbers
        kl = reverse_kl_on_prompts(self.student, self.teacher, self.prompts, seed=self.cfg.seed,
                                   max_new=self.cfg.eval_max_new, eos_ids=self.eos_ids)
        self.student.train()
        return kl

    def task(self, model: Any) -> float:
        from pipeline.demo.taskeval import task_accuracy

        return self._on_task(model, lambda: task_accuracy(model, self.tokenizer, self.task_rows,
                                                          max_new=self.cfg.eval_max_new))  # fmt: skip

    def answer_logprob(self, model: Any) -> float:
        from pipeline.demo.taskeval import answer_logprob

        return self._on_task(model, lambda: answer_logprob(model, self.tokenizer, self.task_rows))

    def _on_task(self, model: Any, metric: Callable[[], float]) -> float:
        """``metric()`` with ``model`` in eval mode; the student back in train mode after."""
        model.eval()
        value = metric()
        self.student.train()
        return value

    def record(self, rec: dict[str, float], step: int, *, first: bool = False, last: bool = False) -> None:
        """Add the held-out figures due at ``step`` to ``rec``."""
        if self.teacher is None:
            return
        if first or last or step % self.cfg.eval_every == 0:
            rec["heldout_reverse_kl"] = self.reverse_kl(step)
        if self.task_rows and (first or last):
            rec["heldout_task_accuracy"] = self.task(self.student)
            rec["heldout_answer_logprob"] = self.answer_logprob(self.student)
        if self.task_rows and first:
            rec["teacher_task_accuracy"] = self.task(self.teacher)
            rec["teacher_answer_logprob"] = self.answer_logprob(self.teacher)


def train(cfg: LearnerConfig, on_step: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.seed)
    student = load_causal_lm(cfg.student).to(cfg.device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.student)
    evaluator = Evaluator(cfg, student, tokenizer)
    # fused: one kernel over every tensor (on the real student's 124M parameters, 0.08 s a step against 0.64 s)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0, fused=True)
    history: list[dict[str, float]] = []
    version = 0

    ckpt_dir = cfg.checkpoint_dir or str(Path(cfg.weights_dir) / "checkpoint")
    with contextlib.ExitStack() as files, Learner(cfg.redis_url, namespace=cfg.namespace) as learner:
        out, trained_log = _append(files, cfg.metrics_file), _append(files, cfg.trained_log)
        ckpt, version, step = restore(ckpt_dir, student, opt, learner, cfg)
        _log_line(trained_log, event="start", step=step)
        started = time.perf_counter()
        rec0: dict[str, float] = {"step": float(step), "policy_version": float(version)}
        evaluator.record(rec0, step, first=True)
        _emit(rec0, history, out, on_step)
        student.train()
        held = Held()  # trained since the last checkpoint, not acknowledged
        while step < cfg.steps:
            t_wait = time.perf_counter()
            b = learner.next_batch(HELD_WAIT_S if held.batches else cfg.batch_timeout_s)
            if b is None and held.batches:
                # the feeder may be waiting for these very acks (its ready-batch cap, or the batches stream's
                # backlog cap, below checkpoint_every): checkpoint what it holds now rather than wait forever
                log.info("checkpoint_early", held=len(held.batches), step=step, waited_s=HELD_WAIT_S)
                held = held.settle(learner, ckpt_dir, student, opt, step, version)
                b = learner.next_batch(cfg.batch_timeout_s)
            if b is None:
                log.warning("no_batch", waited_s=cfg.batch_timeout_s, step=step + 1)
                break
            if ckpt is not None and ckpt.trained(b.batch.batch_id):
                learner.ack(b)  # a crash came between its checkpoint and its ack: already in the weights
                continue
            step += 1
            _log_line(trained_log, event="step", step=step, batch_id=b.batch.batch_id,
                      groups=[g.group_id for g in b.batch.groups])
            t0 = time.perf_counter()
            set_lr(opt, cfg, step)
            fig = train_step(student, opt, b.batch, cfg)
            held.batches.append(b)
            version += (synced := step % cfg.sync_every == 0)
            # Checkpoint, then ack what it holds, then publish: a crash before the checkpoint redelivers the held
            # batches to the previous checkpoint; after it, they are acked again untrained (``trained`` above).
            held, phases = _checkpoint_and_publish(learner, cfg, held, ckpt_dir, student, opt, step, version, synced)
            t3 = time.perf_counter()
            rec = _record(step, fig, b.batch, version, t3 - t0)
            rec.update(phases, wait_s=t0 - t_wait, held=float(len(held.batches)))
            evaluator.record(rec, step, last=step == cfg.steps)
            rec["eval_s"] = time.perf_counter() - t3
            rec["wall_s"] = time.perf_counter() - started
            _emit(rec, history, out, on_step)
        held.settle(learner, ckpt_dir, student, opt, step, version)  # no batch came: what it trained, kept
    return history


def _append(files: contextlib.ExitStack, path: str | None) -> IO[str] | None:
    """``path`` opened to append (its folder made) until ``files`` closes, or None."""
    if path is None:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return files.enter_context(open(path, "a"))


def kept_steps(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``step`` records of a ``--trained-log`` whose step is in the weights: a ``start`` restoring step S drops
    the earlier ``step`` lines above S (trained, then lost with a crash before their checkpoint)."""
    recs = list(records)
    starts = [r for r in recs if r.get("event") == "start"]
    return [r for r in recs if r.get("event") == "step"
            and all(r["step"] <= s["step"] for s in starts if s["t"] > r["t"])]


def trained_groups(records: Iterable[dict[str, Any]]) -> Counter[str]:
    """Group id -> how many times it is in the weights, from a ``--trained-log``'s records."""
    return Counter(g for r in kept_steps(records) for g in r["groups"])


def _log_line(f: IO[str] | None, **rec: Any) -> None:
    """One line of ``--trained-log``, flushed: it must be on disk before the step it names trains. A ``step``
    line whose step is above the ``step`` of a later ``start`` line was not in the weights that restart restored
    (the crash came before its checkpoint): that batch is trained again, and only the later line counts."""
    if f is not None:
        f.write(json.dumps({"t": time.time(), **rec}) + "\n")
        f.flush()


def _checkpoint_and_publish(learner: Learner, cfg: LearnerConfig, held: Held, ckpt_dir: str, student: Any,
                            opt: torch.optim.Optimizer, step: int, version: int,
                            synced: bool) -> tuple[Held, dict[str, float]]:
    """After step ``step``: the checkpoint and its acks when one is due, then the weights when a version is; the
    batches still held and the seconds of both."""
    phases = {"checkpoint_s": 0.0, "publish_s": 0.0}
    if step % cfg.checkpoint_every == 0 or step == cfg.steps:
        t1 = time.perf_counter()
        held = held.settle(learner, ckpt_dir, student, opt, step, version)
        phases["checkpoint_s"] = time.perf_counter() - t1
    if synced:
        t2 = time.perf_counter()
        learner.publish_weights(student, version, cfg.weights_dir, tokenizer_dir=cfg.student)
        phases["publish_s"] = time.perf_counter() - t2
    return held, phases


@dataclass
class Held:
    """Batches trained since the last checkpoint: acknowledged once a checkpoint holds them."""

    batches: list[LearnerBatch] = field(default_factory=list)

    def settle(self, learner: Learner, ckpt_dir: str, student: Any, opt: torch.optim.Optimizer, step: int,
               version: int) -> Held:
        """Checkpoint (with these batches' ids), then acknowledge them; an empty ``Held`` for the next ones."""
        if self.batches:
            save_checkpoint(ckpt_dir, student, opt, step=step, policy_version=version,
                            batch_ids=[b.batch.batch_id for b in self.batches])
            for b in self.batches:
                learner.ack(b)
        return Held()


def set_lr(opt: torch.optim.Optimizer, cfg: LearnerConfig, step: int) -> None:
    """The learning rate of ``step`` (1-based): a function of the step alone, so a restarted or resumed learner
    goes on with the rate it would have had."""
    factor = max(0.0, 1 - (step - 1) / max(cfg.steps, 1)) if cfg.lr_decay == "linear" else 1.0
    for group in opt.param_groups:
        group["lr"] = cfg.lr * factor


def restore(ckpt_dir: str, student: Any, opt: torch.optim.Optimizer, learner: Learner,
            cfg: LearnerConfig) -> tuple[Checkpoint | None, int, int]:
    """(checkpoint, policy version, step) to go on from. A restarted learner continues from its checkpoint;
    either way the weights it starts from are saved for the samplers and their version published (again)."""
    ckpt = load_checkpoint(ckpt_dir, student, opt)
    published = learner.policy_version()
    if ckpt is not None:
        log.info("resumed", checkpoint=str(ckpt.path), step=ckpt.step, policy_version=ckpt.policy_version,
                 optimizer_state=(ckpt.path / "optimizer.safetensors").exists())
    version = ckpt.policy_version if ckpt is not None else max(published, 0)
    if ckpt is not None and published > version:
        # versions published after the checkpoint went with the crash: the samplers load only a newer version,
        # so the restored weights go out as the next one (their samples then count as stale)
        log.info("republished_above_lost_versions", checkpoint_version=version, published=published)
        version = published + 1
    if ckpt is None and is_url(cfg.weights_dir):
        # weights that go to a store leave no file: the weights it starts from are checkpointed before they are
        # published, so the checkpoint marks a learner that is up (docker-compose.yml's health check)
        save_checkpoint(ckpt_dir, student, opt, step=0, policy_version=version, batch_ids=[])
    learner.publish_weights(student, version, cfg.weights_dir, tokenizer_dir=cfg.student)
    return ckpt, version, ckpt.step if ckpt is not None else 0


#: How long a learner holding batches not yet checkpointed waits for the next one before it checkpoints them: a
#: feeder whose cap on unacknowledged batches is below ``--checkpoint-every`` sends no more until they are acked.
HELD_WAIT_S = 5.0


@dataclass(frozen=True)
class StepFigures:
    """One optimiser step's losses, how far the trained policy is from the one that sampled the batch, and the
    seconds of its two phases."""

    loss: float
    pg: float
    kd: float
    ratio_kl: float  # mean of r - 1 - log r over the trained tokens, r = trainer / sampler probability (>= 0)
    clip_frac: float  # share of the trained tokens whose ratio is outside [1 - clip, 1 + clip]
    forward_backward_s: float
    optimizer_s: float


def train_step(student: Any, opt: torch.optim.Optimizer, batch: TrainBatch, cfg: LearnerConfig) -> StepFigures:
    """One step on ``batch``: IS policy gradient (PPO-clipped at ``cfg.clip``) on the reverse-KL advantages plus
    top-k forward KL (``step_losses``), the gradient norm clipped at 1, the optimizer's update."""
    t0 = time.perf_counter()
    tb = weigh(to_torch(batch, device=next(student.parameters()).device), batch,
               parse_teacher_weights(cfg.teacher_weight))  # each teacher pool's share of the loss
    new, pg, kd = step_losses(student, tb, cfg.clip)
    loss = cfg.pg_weight * pg + cfg.kd_weight * kd
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    t1 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    t2 = time.perf_counter()
    ratio_kl, clip_frac = sampler_drift(new.detach(), tb.student_logprobs, tb.loss_mask, cfg.clip)
    return StepFigures(float(loss.detach()), float(pg.detach()), float(kd.detach()),  # float() of a grad tensor warns
                       ratio_kl, clip_frac, t1 - t0, t2 - t1)


def step_losses(student: Any, tb: TorchBatch, clip: float | None,
                reduction: losses.Reduction = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the trainer's logprobs of the sampled tokens ``[B, T-1]``, the policy-gradient loss, the top-k forward KL
    with a tail bucket), each loss reduced over its mask (``reduction``: the mean, or the sum that learner ranks
    divide by the whole batch's token counts).

    The chunked losses (``pipeline.learner.chunked``): from the base model's hidden states and the lm_head, in one
    pass over the head for both (the sampled token's id and the teacher's top-k ids gathered together at every
    position either loss trains), so no ``[B, N, V]`` logits exist at any vocabulary size.
    """
    hidden = student.get_decoder()(input_ids=tb.input_ids, attention_mask=tb.attention_mask.long())
    h, head = hidden.last_hidden_state[:, :-1], student.get_output_embeddings()
    ids = torch.cat([tb.labels[..., None], tb.teacher_topk_ids.long()], -1)
    lp = gather_logprobs(h, head.weight, ids, torch.maximum(tb.loss_mask, tb.distill_mask), bias=head.bias)
    new = lp[..., 0]
    pg = losses.importance_sampled_pg_loss(new, tb.student_logprobs, tb.advantages, tb.loss_mask, clip,
                                           reduction=reduction)
    kd = losses.reduce_masked(
        losses.topk_forward_kl_from_logprobs(lp[..., 1:], tb.teacher_topk_logprobs, "tail"), tb.distill_mask,
        reduction)
    return new, pg, kd


def sampler_drift(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, clip: float | None) -> tuple[float, float]:
    """(KL(sampler || trainer) estimated on the sampled tokens as the mean of ``r - 1 - log r``, the share of
    tokens whose ratio ``r = exp(new - old)`` lies outside ``[1 - clip, 1 + clip]``), over ``mask``."""
    log_r = (new.float() - old.float()).masked_fill(mask <= 0, 0.0)
    k3 = torch.expm1(log_r) - log_r
    outside = ((log_r.exp() - 1).abs() > clip).float() if clip is not None else torch.zeros_like(log_r)
    return float(losses.reduce_masked(k3, mask)), float(losses.reduce_masked(outside, mask))


def optimiser_step(
    student: Any, opt: torch.optim.Optimizer, batch: TrainBatch, cfg: LearnerConfig
) -> tuple[float, float, float]:
    """``train_step``'s (loss, policy-gradient loss, top-k forward KL)."""
    fig = train_step(student, opt, batch, cfg)
    return fig.loss, fig.pg, fig.kd


def _record(step: int, fig: StepFigures, batch: TrainBatch, version: int, step_s: float) -> dict[str, float]:
    stats = batch.stats or {}
    lags = [int(k.split("_", 1)[1]) for k in stats if k.startswith("staleness_")]  # at delivery
    return {
        "step": float(step), "loss": fig.loss, "pg_loss": fig.pg, "kd_loss": fig.kd, "ratio_kl": fig.ratio_kl,
        "clip_frac": fig.clip_frac, "forward_backward_s": fig.forward_backward_s, "optimizer_s": fig.optimizer_s,
        "batch_reverse_kl": stats.get("reverse_kl", float("nan")), "tokens": stats.get("tokens", 0.0),
        "groups": stats.get("groups", 0.0), "policy_version": float(version),
        "batch_policy_version": float(batch.policy_version), "staleness_max": float(max(lags, default=0)),
        "step_s": step_s,
        # groups scored by a teacher of another tokenizer: cross.groups, cross.aligned_share, cross.topk_mapped_mass
        **{k: float(v) for k, v in stats.items() if k.startswith("cross.")},
    }


def _emit(rec: dict[str, float], history: list[dict[str, float]], out: Any,
          on_step: Callable[[dict[str, float]], None] | None) -> None:
    history.append(rec)
    if out is not None:
        out.write(json.dumps(rec) + "\n")
        out.flush()
    if on_step is not None:
        on_step(rec)
    if "heldout_reverse_kl" in rec:
        log.info("eval", step=int(rec["step"]), heldout_reverse_kl=round(rec["heldout_reverse_kl"], 4))


def _lr_decay(text: str) -> str:
    if text not in ("none", "linear"):
        raise argparse.ArgumentTypeError(f"none or linear, got {text!r}")
    return text


class LearnerSettings(FlagSettings):
    """``python -m pipeline.demo.learner``'s flags (``pipeline.flags``; none is read from the environment but
    ``--redis-url``/``--namespace``, ``RedisSettings``)."""

    student: Annotated[str, Flag(metavar="DIR")] = Field(description="the student model folder it starts from")
    weights_dir: Annotated[str, Flag(metavar="DIR|URL")] = Field(
        description="where each published version goes: a folder, or a `redis://` or `s3://` URL "
                    "([weights.md](weights.md))")
    steps: Annotated[int, Flag(metavar="N")] = Field(300, description="training steps")
    lr: Annotated[float, Flag(metavar="LR")] = Field(2e-3, description="AdamW learning rate")
    lr_decay: Annotated[Literal["none", "linear"], Flag(metavar="none|linear", parse=_lr_decay)] = Field(
        "none", description="`none`, or `linear`: from `--lr` at step 1 to 0 at `--steps`, a function of the step")
    pg_weight: Annotated[float, Flag(metavar="W")] = Field(
        1.0, description="weight of the importance-sampled policy gradient on the feeder's advantages")
    kd_weight: Annotated[float, Flag(metavar="W")] = Field(
        1.0, description="weight of the top-k forward KL to the teacher")
    sync_every: Annotated[int, Flag(metavar="N")] = Field(
        1, description="publish the weights as the next version every N steps")
    checkpoint_every: Annotated[int, Flag(metavar="N")] = Field(
        1, description="checkpoint every N steps and at the last, acknowledging the batches the checkpoint holds "
                       "(a crash trains at most the N since the last one again; the feeder's "
                       "`--max-ready-batches` must be at least N: unacknowledged batches count against it)")
    eval_teacher: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None, description="a local teacher for the held-out evaluation")
    eval_every: Annotated[int, Flag(metavar="N")] = Field(25, description="evaluate every N steps")
    eval_prompts: Annotated[int, Flag(metavar="N")] = Field(48, description="held-out prompts")
    eval_kl_prompts: Annotated[int | None, Flag(metavar="N", default_text="all")] = Field(
        None, description="the reverse KL on the first N held-out prompts only")
    heldout_file: Annotated[str | None, Flag(metavar="PATH")] = Field(
        None, description="JSONL rows with `messages`, and optionally `accept` answers, to evaluate on instead of "
                          "the arithmetic prompts")
    eval_max_new: Annotated[int, Flag(metavar="N")] = Field(8, description="tokens sampled per held-out prompt")
    device: Annotated[str, Flag(metavar="DEVICE")] = Field(
        "cpu", description="torch device of the student, the teacher and each batch")
    metrics_file: Annotated[str | None, Flag(metavar="PATH")] = Field(
        None, description="JSONL, one record per step")
    trained_log: Annotated[str | None, Flag(metavar="PATH")] = Field(
        None, description="JSONL, what the weights hold: a line per start (the step restored) and per step before "
                          "it trains (its batch and group ids); a step above a later start's was trained again "
                          "after that restart ([learner.md](learner.md))")
    batch_timeout: Annotated[float, Flag(metavar="SECONDS")] = Field(
        60.0, description="give up after this many seconds without a batch")
    checkpoint_dir: Annotated[str | None, Flag(
        metavar="DIR", default_text="`WEIGHTS_DIR/checkpoint`; required when `--weights-dir` is a URL")] = Field(
        None, description="where the checkpoint (model, optimizer, step, version) is kept")
    teacher_weight: Annotated[str | None, Flag(metavar="POOL=W[,POOL=W...]", default_text="1 each")] = Field(
        None, description="a weight per teacher pool in both losses, e.g. `math=1,code=0.5` (0: leave its groups "
                          "out); a pool not named weighs 1 ([teacher-pools.md](teacher-pools.md))")


def learner_config(s: LearnerSettings, redis_url: str | None, namespace: str | None) -> LearnerConfig:
    """The run's config from its flags; ``redis_url``/``namespace`` None: the environment's (``RedisSettings``)."""
    return LearnerConfig(student=s.student, weights_dir=s.weights_dir, steps=s.steps, lr=s.lr, lr_decay=s.lr_decay,
                         pg_weight=s.pg_weight, kd_weight=s.kd_weight, sync_every=s.sync_every,
                         checkpoint_every=s.checkpoint_every,
                         eval_teacher=s.eval_teacher, eval_every=s.eval_every, eval_prompts=s.eval_prompts,
                         eval_kl_prompts=s.eval_kl_prompts, heldout_file=s.heldout_file, eval_max_new=s.eval_max_new,
                         device=s.device, metrics_file=s.metrics_file, trained_log=s.trained_log,
                         batch_timeout_s=s.batch_timeout,
                         redis_url=redis_url, namespace=namespace, checkpoint_dir=s.checkpoint_dir,
                         teacher_weight=s.teacher_weight)


def main(argv: list[str] | None = None) -> int:
    from pipeline.logs import configure_logging

    p = argparse.ArgumentParser(prog="python -m pipeline.demo.learner", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    add_flags(p, LearnerSettings)
    add_redis_args(p)
    a = p.parse_args(argv)
    configure_logging()
    cfg = learner_config(from_args(LearnerSettings, a), a.redis_url, a.namespace)
    a.func = lambda _: run(cfg)
    return run_command(a)  # a configuration error: one line, exit status 2; Redis away: one line, 3


def check_config(cfg: LearnerConfig) -> None:
    """Refuse, before anything loads, a configuration that cannot work (``ConfigurationError``)."""
    for flag, folder in (("--student", cfg.student), ("--eval-teacher", cfg.eval_teacher)):
        if folder is not None and not (Path(folder) / "config.json").is_file():
            raise ConfigurationError(f"{flag} {folder}: not a model folder (no config.json there)")
    try:
        parse_teacher_weights(cfg.teacher_weight)
    except ValueError as e:
        raise ConfigurationError(f"--teacher-weight: {e}") from None
    if cfg.heldout_file is not None and not Path(cfg.heldout_file).is_file():
        raise ConfigurationError(f"--heldout-file {cfg.heldout_file}: no such file")
    for flag, value in (("--sync-every", cfg.sync_every), ("--eval-every", cfg.eval_every),
                        ("--checkpoint-every", cfg.checkpoint_every)):
        if value < 1:
            raise ConfigurationError(f"{flag} must be at least 1, got {value}")
    if cfg.checkpoint_every > MAX_CHECKPOINT_EVERY:
        raise ConfigurationError(f"--checkpoint-every must be at most {MAX_CHECKPOINT_EVERY} (the batch ids a "
                                 f"checkpoint keeps), got {cfg.checkpoint_every}")


def run(cfg: LearnerConfig) -> int:
    """Check ``cfg``, train: 0 when a step ran, 1 when none did (no batch within ``batch_timeout_s``)."""
    check_config(cfg)
    if is_url(cfg.weights_dir):  # redis:// or s3:// (docs/weights.md): the checkpoint needs a folder of its own
        if not cfg.checkpoint_dir:
            raise ConfigurationError("--checkpoint-dir is required when --weights-dir is a URL")
    else:
        Path(cfg.weights_dir).mkdir(parents=True, exist_ok=True)
    history = train(cfg)
    return 0 if len(history) > 1 else 1  # history[0] is the step-0 record: no step ran without a batch


if __name__ == "__main__":
    sys.exit(main())
