"""The training loop: DeepSpeed ZeRO engine around a Megatron-core GPTModel, nanoGPT-style.

    prism train CONFIG [overrides]            # one process
    torchrun --nproc-per-node N -m pipeline.cli train CONFIG ...   # N processes (TP x DP)

`train` refuses bad input and decides where to resume (pipeline.checkpoint.restore), `setup` builds the Run,
`loop` trains it, `finish` closes it. In the loop, `train_step` is one optimizer step, `step_actions`
(pipeline.cadence) says what else the step does (sync, validate, log, evaluate, checkpoint), `do_step_actions`
does it and `log_step` writes one log line. The package's other rooms: `engine` (AdamW, the DeepSpeed config,
the engine, one step, a validation pass), `setup` (everything before the first step), `diagnostics` (MFU,
memory, the steps still on the device, the log line, the nonfinite report, the data checks). Process groups
and collectives are in pipeline.distributed, what a checkpoint holds in pipeline.checkpoint.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from pipeline import faults, lr_schedule, run_lock, slurm_job
from pipeline.cadence import StepActions, checkpoint_steps, planned, step_actions
from pipeline.checkpoint import restore
from pipeline.config import Config
from pipeline.console import Progress
from pipeline.distributed import (
    StopSignal,
    init_distributed,
)
from pipeline.eval.catalog import eval_tokens
from pipeline.exit_codes import (
    EXIT_CRASHED,
    EXIT_FINISHED,
    EXIT_INFRA,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    MLFLOW_STATUS,
    RECORD_REASONS,
    InfrastructureFault,
)
from pipeline.metric_names import val_loss_metric
from pipeline.train.diagnostics import UnreadSteps, log_step, report_nonfinite, say
from pipeline.train.engine import StepResult, evaluate, train_step
from pipeline.train.setup import Run, already_finished, branch_start, setup


def stop_agreement(stopper: StopSignal, device: str) -> Any:
    """A per-step check that all ranks agree to stop, without a device sync: on CUDA over a gloo group
    of CPU tensors (reading a CUDA flag would wait for the step's kernels)."""
    if device != "cuda":
        return lambda news=0.0: stopper.agreed(device, news=news)
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    return lambda news=0.0: stopper.agreed("cpu", group=group, news=news)


def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) ``cfg`` inside the current process group; returns a summary with ``exit_code``."""
    # Refuse bad input before anything expensive: a changed config on resume, a mismatched dataset.
    slurm_job.max_batch_requeue_override()  # a bad PRISM_MAX_BATCH_REQUEUE: one line on every rank
    from pipeline.model.gpt import check_spec

    check_spec(cfg)  # model.spec=transformer_engine where TE cannot run: one line, before any process group
    # the resume checks share the checkpoint hashing out over the ranks
    init_distributed(cfg.train.device, cfg.parallel.init_timeout_s)
    with run_lock.held(cfg.checkpoint_dir):  # one writer per run: a refusal reaches every rank before any write
        return train_held(cfg)


def train_held(cfg: Config) -> dict[str, Any]:
    """``train`` with the run folder's lock held (pipeline.run_lock)."""
    from pipeline import compat
    from pipeline.config import ConfigError

    resume = branch_start(cfg) or restore.resume_point(cfg)
    if resume.finished:
        return already_finished(cfg, resume)
    run = setup(cfg, resume)
    try:
        exit_code = loop(run)
        run.saver.close()  # the final or stop-signal save (or an earlier one still in flight) commits first
    except ConfigError:
        raise  # bad input met mid-run (a damaged shard): exit 2, recorded by the CLI, never retried
    except Exception as error:  # a lost peer or timed-out collective is the machine's fault, not ours
        if not (isinstance(error, InfrastructureFault) or compat.collective_failed(error)):
            record_exit(RECORD_REASONS[EXIT_CRASHED], run.state.step)  # restarted, a crash loop stopped
            raise
        say(
            f"prism train: error: infrastructure fault at step {run.state.step}: {str(error).splitlines()[0]}; "
            f"exiting with {EXIT_INFRA} (the job script retries it from the last intact checkpoint; this rank's "
            f"stacks, if it hung, in {run.watch.path.parent if run.watch else cfg.checkpoint_dir})"
        )
        exit_code = EXIT_INFRA
    finally:
        if run.watch is not None:
            run.watch.close()
    return finish(run, exit_code)


def loop(run: Run) -> int:
    """Optimizer steps until the token budget is done, a stop signal or a non-finite loss; the exit code."""
    cfg, state, t = run.cfg, run.state, run.cfg.train
    recent: deque[float] = deque(maxlen=20)  # the last losses, for a NaN step's diagnostic
    stop_check = stop_agreement(run.stopper, run.device)
    unread = UnreadSteps(t.max_skips_in_a_row)
    progress = loop_progress(run)
    schedule = lr_schedule.schedule_of(cfg)
    while state.step < run.total_steps:
        faults.before_step(state.step + 1)  # PRISM_FAULT_* in recovery tests; nothing otherwise
        lr = schedule.at(state.step)
        fault = faults.loss_factor(state.step + 1)  # None unless a test sets PRISM_FAULT_LOSS
        result = profiled_step(run, lr, fault)
        state.step += 1
        run.profiler.step_done(state.step)  # the window's last step: traces written, the profiler stopped
        faults.log_batches(state.step, result.batches)  # PRISM_FAULT_BATCH_LOG in tests; nothing otherwise
        run.watch.step_done()  # after the first: short collective timeouts; each: the stack timer re-armed
        state.tokens_seen += t.batch_tokens
        unread.add(state.step, result)
        if run.job_end and not run.stopper.end_reached and (why := run.job_end.due(run.saver.final_save_s())):
            say(f"prism train: {why}: checkpointing at step {state.step} and stopping")
            run.stopper.end_reached = True
        # a profile request rides on the stop agreement's all-reduce: rank 0 reads it at sync steps only
        stop, news = stop_check(run.profiler.poll(step_actions(cfg, state.step, run.total_steps).sync))
        run.profiler.agreed(news, state.step, run.total_steps)
        # checkpoint.every_minutes: cadence reads the ranks' agreed clock at the sync steps its rule needs
        actions = step_actions(cfg, state.step, run.total_steps, stop, since_save=run.saver.since_save)
        if not actions.sync:
            continue  # no host sync on this step: its loss and grad norm are read at the next sync step
        run.saver.poll()  # a save in flight commits once every rank's background write is done
        bad = unread.read_back(recent)  # the one host sync since the last sync step
        progress.trained(unread.seconds)  # the step line's rate: the same clock as perf/step_time
        for step, skipped in unread.skipped:
            say(
                f"prism train: step {step} skipped (loss {skipped.loss:.4f}, grad norm {skipped.grad_norm:.3f}: "
                f"non-finite or above mean + {t.skip_sigma} std of the last {t.skip_window} steps); weights and "
                "optimizer state unchanged"
            )
        if bad is not None:
            run.saver.close()  # the diagnostics name the last good checkpoint: commit the one in flight first
            report_nonfinite(cfg, *bad, recent)
            return EXIT_NONFINITE
        run.train_loss = result.loss
        do_step_actions(run, actions, result, progress, final=stop or state.step == run.total_steps)
        unread.restart_clock()  # the steps' own time (perf/step_time) leaves this step's extra work out
        if stop and state.step < run.total_steps:  # a signal at the final step: the run is done, nothing to resume
            run.profiler.cut(state.step)  # a trace in progress keeps the steps it has
            say(
                f"prism train: stop signal received; checkpoint at step {state.step} written, exiting with "
                f"{EXIT_STOPPED} (requeue to resume)"
            )
            return EXIT_STOPPED
    return EXIT_FINISHED


def profiled_step(run: Run, lr: float, fault: float | None) -> StepResult:
    """train_step under the run's profiler (a no-op outside a profile window); a CUDA out-of-memory error
    leaves this rank's allocator snapshot (pipeline.profiling) before it ends the run."""
    import torch

    from pipeline.profiling import dump_on_oom

    step = run.state.step + 1
    try:
        with run.profiler.step(step):
            return train_step(
                run.engine,
                run.optimizer,
                run.loader,
                lr,
                run.grad_accum,
                run.device,
                run.skipper,
                run.cfg.train.z_loss,
                fault,
                run.clock,
            )
    except torch.cuda.OutOfMemoryError:
        dump_on_oom(run.cfg.run_dir, step, run.profiler.rank)
        raise


def loop_progress(run: Run) -> Progress:
    """The console's pace and ETA for the steps left, knowing which of them validate, eval and checkpoint
    (their time is set aside, not counted as training)."""
    cfg, t, start = run.cfg, run.cfg.train, run.state.step
    ahead = planned(cfg, start, run.total_steps)
    syncs = {s: a for s, a in ahead.items() if a.sync}
    return Progress(
        run.total_steps,
        start,
        t.batch_tokens,
        validation_steps=[s for s, a in ahead.items() if a.validate],
        # the clock's saves (checkpoint.every_minutes) depend on the pace: cadence counts them at the measured one
        checkpoint_steps=lambda step_seconds: checkpoint_steps(cfg, syncs, step_seconds, start),
        validation_tokens=sum(rows.shape[0] for rows in run.val_sets.values()) * cfg.model.seq_len,
        eval_steps=[s for s, a in ahead.items() if a.eval],
        eval_tokens=eval_tokens(t.eval_tasks, t.eval_limit),
    )


def do_step_actions(run: Run, actions: StepActions, result: StepResult, progress: Progress, final: bool) -> None:
    """A sync step's extra work, in this order: validation, the log line, downstream evals, the checkpoint
    (``final``: the last step's or a stop signal's)."""
    from pipeline.stragglers import gather_rank_times, straggler_metrics

    cfg, state, t = run.cfg, run.state, run.cfg.train
    val_losses = {}
    if actions.validate:
        with progress.aside("validation"):  # every set: its time stays out of tokens/s
            scored = {m: evaluate(run.engine, rows, t.micro_batch_size, run.device) for m, rows in run.val_sets.items()}
            val_losses = {m: loss for m, (loss, _) in scored.items()}
        run.val_loss = val_losses[val_loss_metric(None)]  # the run's own val split: the summary's val loss
        save_val_items(run, {m: rows for m, (_, rows) in scored.items()})
    if actions.log:
        stragglers = straggler_metrics(gather_rank_times(run.clock, run.device))  # every rank: a collective
        pace = progress.pace(state.step)
        log_step(cfg, run.tracker, state, run.total_steps, result, val_losses, run.device, pace, stragglers)
    if actions.eval:  # before the checkpoint: a resume from it never skips this step's eval
        with progress.aside("eval"):
            downstream_eval(run)
    if actions.checkpoint:
        with progress.aside("checkpoint"):  # the time the step is blocked: staging, or the whole write
            run.saver.save(state, final=final)


def downstream_eval(run: Run) -> None:
    """This step's zero-shot scores, on every rank: to the tracker at the step, one console line."""
    import torch.distributed as dist

    from pipeline.eval import items as eval_items
    from pipeline.eval.in_run import eval_line
    from pipeline.eval.zeroshot import score_metrics

    t0 = time.perf_counter()
    scores, items = run.evals(run.engine)
    if scores:  # where lm-eval returned them (global rank 0 among them)
        run.tracker.log_metrics(score_metrics(scores), run.state.step)
        say(eval_line(run.state.step, scores, time.perf_counter() - t0))
        if dist.get_rank() == 0:  # one writer of the per-item file (pipeline.eval.items), as `prism eval` writes it
            data = eval_items.write_items(run.cfg.run_dir, run.state.step, items)[1]
            run.tracker.log_artifact_text(data, eval_items.items_artifact(run.state.step))


def save_val_items(run: Run, per_row: dict[str, np.ndarray]) -> None:
    """Rank 0 writes a validation's per-sequence losses of every set (pipeline.eval.items) and logs them as
    artifacts: a few KB per set (4 bytes a row). The tracker journals them, so an outage loses nothing."""
    import torch.distributed as dist

    from pipeline.eval import items as eval_items

    if dist.get_rank() != 0:
        return
    for vs in run.cfg.validation_sets():
        data = eval_items.write_val(run.cfg.run_dir, vs.name, run.state.step, per_row[vs.metric])[1]
        run.tracker.log_artifact_text(data, eval_items.val_artifact(vs.name, run.state.step))


def finish(run: Run, exit_code: int) -> dict[str, Any]:
    """The exit record, the signal handlers and loader back, the tracking run closed; the summary."""
    reason = RECORD_REASONS[exit_code]
    # before restoring the signal handlers: a late stop signal must not kill us first
    record_exit(reason, run.state.step)
    run.stopper.restore()
    run.loader.close()
    if run.node_metrics is not None:
        run.node_metrics.finish()
    run.tracker.finish(MLFLOW_STATUS[exit_code])
    return {
        "steps": run.state.step,
        "total_steps": run.total_steps,
        "tokens_seen": run.state.tokens_seen,
        "train_loss": run.train_loss,
        "val_loss": run.val_loss,
        "run_id": run.state.run_id,
        "exit_reason": reason,
        "exit_code": exit_code,
    }


def record_exit(reason: str, step: int) -> None:
    """The exit record for the launcher (pipeline/restart.py reads it), from global rank 0 only."""
    import torch.distributed as dist

    from pipeline.exit_codes import write_exit_record

    if dist.get_rank() == 0:
        write_exit_record(reason, step)
