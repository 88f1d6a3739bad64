"""The driver around Optuna: it asks for a trial, launches an ordinary `prism train` run for it, reports the
run's val loss at each rung, stops a pruned run, and closes a trial when its run ends; then the confirmation
stage. Its record of every launch (``<folder>/search.json``) is written before the launch, so a driver killed
at any point is resumed by ``--resume`` without a run started twice."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline import config
from pipeline.atomic import write_atomic
from pipeline.config import ConfigError
from pipeline.runs.launch import LocalLauncher, SlurmLauncher
from pipeline.runs.outcome import checkpoints_of, outcome, tokens_trained, val_losses
from pipeline.search import report
from pipeline.search.spec import SearchSpec, run_overrides, tracking_uri, trial_key, trial_overrides

STATE_FILE = "search.json"
OPTUNA_FILE = "optuna-journal.log"
FINAL = ("complete", "pruned", "failed")


# --- the driver's record: search.json -------------------------------------------------------------------
class State:
    """``<folder>/search.json``: the parent MLflow run and one record per run the search started."""

    def __init__(self, folder: Path):
        self.path = folder / STATE_FILE
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {"runs": {}}

    @property
    def runs(self) -> dict[str, dict[str, Any]]:
        return self.data["runs"]

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=1) + "\n")


# --- the driver ------------------------------------------------------------------------------------------
class Driver:
    def __init__(self, spec: SearchSpec, resume: bool, say: Any = print, poll_s: float = 1.0):
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        self.spec, self.say, self.poll_s = spec, say, poll_s
        self.t0 = time.monotonic()
        exists = (spec.folder / STATE_FILE).is_file() or (spec.folder / OPTUNA_FILE).is_file()
        if exists and not resume:
            raise ConfigError(f"{spec.folder} already holds search {spec.name!r}; continue it with --resume")
        if resume and not exists:
            raise ConfigError(f"--resume: {spec.folder} holds no search yet; run without --resume to start it")
        spec.folder.mkdir(parents=True, exist_ok=True)
        self.state = State(spec.folder)
        self.uri = tracking_uri(spec)
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the driver prints each event itself
        storage = JournalStorage(JournalFileBackend(str(spec.folder / OPTUNA_FILE)))
        self.study = optuna.create_study(
            study_name=spec.name,
            storage=storage,
            sampler=make_sampler(spec),
            pruner=make_pruner(spec),
            direction="minimize",
            load_if_exists=True,
        )
        self.launcher: Any = (
            LocalLauncher(spec.concurrency)
            if spec.executor == "local"
            else SlurmLauncher(spec.folder, spec.name, spec.slurm, spec.nproc_per_node)
        )
        if spec.sampler == "grid":
            self.enqueue_grid()
        self.best: tuple[float, str] | None = None

    def enqueue_grid(self) -> None:
        """The grid sampler: every schedule queued once (Optuna's enqueue_trial), in an order the seed
        shuffles; a searched lr is still drawn by the sampler. Idempotent, so a resume queues only what a
        killed driver had not queued yet. (Optuna's GridSampler stops the study from inside tell(), which
        only works under study.optimize, not with ask/tell.)"""
        import random

        queued = {t.system_attrs.get("fixed_params", {}).get("schedule") for t in self.study.get_trials(deepcopy=False)}
        order = list(self.spec.schedules)
        random.Random(self.spec.seed).shuffle(order)
        for sched in order[: self.spec.trials]:
            if sched not in queued:
                self.study.enqueue_trial({"schedule": sched}, skip_if_exists=False)

    # -- records
    def new_record(
        self, key: str, kind: str, overrides: list[str], status: str = "launching", **extra: Any
    ) -> dict[str, Any]:
        cfg = config.load(self.spec.config_path, overrides)
        rec = {
            "key": key,
            "kind": kind,
            "config": str(self.spec.config_path),
            "overrides": overrides,
            "folder": str(Path(cfg.run.output_dir)),
            "marker": f"run.output_dir={cfg.run.output_dir}",
            "run_dir": str(cfg.run_dir),
            "checkpoint_dir": str(cfg.checkpoint_dir),
            "status": status,  # launching (written just before the launch) | queued | running | stopping | FINAL
            "handle": None,
            **extra,
        }
        self.state.runs[key] = rec
        self.state.save()  # before the launch: a driver killed now looks for the run before starting one
        return rec

    def launch(self, rec: dict[str, Any]) -> None:
        found = self.launcher.find(rec)  # started by a driver killed before it wrote the pid down
        if not found and rec["kind"] == "trial":
            report.child_run(self.spec, self.state, self.uri, rec, self.say)
        rec["handle"] = found or self.launcher.start(rec)
        rec["status"] = "running"
        self.state.save()
        how = "found running" if found else "launched"
        self.say(f"  {self.label(rec)}: {how}, {self.launcher.describe(rec)} -> {rec['run_dir']}")

    def label(self, rec: dict[str, Any]) -> str:
        lr = f", lr {rec['lr']:.2e}" if rec.get("lr") is not None else ""
        return f"{rec['key']} [{rec['schedule']}{lr}]"

    # -- the search
    def ask(self) -> dict[str, Any]:
        trial = self.study.ask(fixed_distributions=self.distributions())
        return self.record_for(trial.number, trial.params)

    def distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution, FloatDistribution

        dists: dict[str, Any] = {"schedule": CategoricalDistribution(self.spec.schedules)}
        if self.spec.lr:
            dists["lr"] = FloatDistribution(*self.spec.lr, log=True)
        return dists

    def record_for(self, number: int, params: dict[str, Any]) -> dict[str, Any]:
        sched, lr = params["schedule"], params.get("lr")
        overrides = trial_overrides(self.spec, number, sched, lr)
        return self.new_record(trial_key(number), "trial", overrides, trial=number, schedule=sched, lr=lr)

    def trial(self, rec: dict[str, Any]) -> Any:
        import optuna

        frozen = self.study.get_trials(deepcopy=False)[rec["trial"]]
        return optuna.trial.Trial(self.study, frozen._trial_id), frozen

    def adopt(self) -> None:
        """On --resume: every run of the last driver found again, every asked trial started exactly once."""
        from optuna.trial import TrialState

        for rec in self.state.runs.values():
            if rec["status"] == "launching":
                self.launch(rec)
            elif rec["status"] in ("running", "stopping"):
                alive = self.launcher.alive(rec)
                self.say(
                    f"  {self.label(rec)}: {rec['status']}, {self.launcher.describe(rec)} {'still running' if alive else 'ended meanwhile'}"
                )
        known = {rec.get("trial") for rec in self.state.runs.values()}
        for frozen in self.study.get_trials(deepcopy=False):
            if frozen.state != TrialState.RUNNING or frozen.number in known:
                continue
            if "schedule" not in frozen.params:  # the driver died inside ask(): nothing was started for it
                self.study.tell(frozen.number, state=TrialState.FAIL, skip_if_finished=True)
                continue
            self.launch(self.record_for(frozen.number, frozen.params))

    def step(self, rec: dict[str, Any]) -> None:
        """Report what a running trial measured since the last look; prune it or close it when it ended."""
        from optuna.trial import TrialState

        alive = self.launcher.alive(rec)  # before reading: a run that ended has all its values written
        trial, frozen = self.trial(rec)
        if rec["status"] == "running" and frozen.state == TrialState.RUNNING:
            values, source = val_losses(rec, self.uri)
            batch = self.spec.base.train.batch_tokens
            for tokens in self.spec.rungs.points[:-1]:  # the last rung is the full budget: nothing to prune
                step = tokens // batch
                if step not in values or tokens in frozen.intermediate_values:
                    continue
                trial.report(values[step], tokens)
                rec.setdefault("rungs", {})[str(tokens)] = values[step]
                # a run that ended before this look (its driver was down) has spent its budget: its rungs
                # still inform the pruner, and finish() closes it by how it ended
                if alive and trial.should_prune():
                    self.study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
                    rec["status"] = "stopping"
                    self.state.save()
                    self.launcher.stop(rec)
                    self.say(
                        f"  {self.label(rec)}: pruned at {tokens:,} tokens (val {values[step]:.4f}, from {source}); "
                        f"stopping {self.launcher.describe(rec)}"
                    )
                    break
                self.say(
                    f"  {self.label(rec)}: rung {tokens:,} tokens, val {values[step]:.4f} (from {source}): continues"
                )
            self.state.save()
        elif rec["status"] == "running":  # told by the last driver, not yet marked here
            rec["status"] = "stopping" if frozen.state == TrialState.PRUNED else rec["status"]
        if rec["status"] == "stopping" and alive:
            self.launcher.stop(rec)  # idempotent: a second stop signal only sets the flag again
        if alive:
            return
        self.finish(rec, trial, frozen)

    def finish(self, rec: dict[str, Any], trial: Any, frozen: Any) -> None:
        from optuna.trial import TrialState

        reason, last_step = outcome(rec)
        rec["tokens"] = tokens_trained(rec, self.spec.base.train.batch_tokens)
        rec["checkpoints"] = checkpoints_of(rec)
        values, _ = val_losses(rec, self.uri)
        full_step = self.spec.rungs.full_tokens // self.spec.base.train.batch_tokens
        if rec["status"] == "stopping":
            rec["status"] = "pruned"
            self.say(
                f"  {self.label(rec)}: ended ({reason} at step {last_step}, checkpoint {', '.join(rec['checkpoints'][-1:]) or 'none'})"
            )
        elif reason == "finished" and full_step in values:
            rec["status"], rec["final_val"] = "complete", values[full_step]
            self.study.tell(trial, values[full_step], skip_if_finished=True)
            best = self.study.best_trial
            self.say(
                f"  {self.label(rec)}: complete, val {values[full_step]:.4f}"
                + (
                    " (best so far)"
                    if best.number == rec["trial"]
                    else f" (best: {trial_key(best.number)} {best.value:.4f})"
                )
            )
        else:
            rec["status"] = "failed"
            if frozen.state == TrialState.RUNNING:
                self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            self.say(f"  {self.label(rec)}: failed ({reason} at step {last_step}); its log: {rec['folder']}/train.log")
        self.state.save()

    def run(self) -> int:
        from optuna.trial import TrialState

        s = self.spec
        self.say(
            f"prism search {s.name}: {s.trials} trials over {len(s.schedules)} schedules, {s.concurrency} at a time "
            f"({s.executor}); rungs {' -> '.join(f'{t:,}' for t in s.rungs.points)} tokens -> {s.folder}"
        )
        if s.executor == "local":
            from data_prep.build import prepare

            prepare(s.base)  # the data config as the spec spells it, so every rerun compares equal to the build
        report.parent_run(self.spec, self.state, self.uri, self.say)
        self.adopt()
        last = ""
        while True:
            for rec in list(self.state.runs.values()):
                if rec["kind"] == "trial" and rec["status"] in ("running", "stopping"):
                    self.step(rec)
            active = [r for r in self.state.runs.values() if r["status"] in ("running", "stopping", "launching")]
            asked = sum(t.state != TrialState.WAITING for t in self.study.get_trials(deepcopy=False))
            while len(active) < s.concurrency and asked < s.trials:
                rec = self.ask()
                self.launch(rec)
                active.append(rec)
                asked += 1
            line = report.summary(self.spec, self.state, self.t0)
            counts = line.split(" | tokens")[0]  # a new line when a trial changes state, not per step
            if counts != last:
                self.say(line)
                last = counts
            if not active and asked >= s.trials:
                break
            time.sleep(self.poll_s)
        results = report.results(self.spec, self.state, self.uri, self.say)
        if s.confirm_top_k:
            return self.confirm(results)
        return 0

    # -- the confirmation stage
    def confirm(self, complete: list[dict[str, Any]]) -> int:
        from pipeline.compare import compare_arms

        s = self.spec
        top = sorted(complete, key=lambda r: r["final_val"])[: s.confirm_top_k]
        if not top:
            self.say("prism search: no trial completed; no confirmation stage")
            return 1
        experiment = f"{s.name}-confirm"
        uniform = f"{s.base.model.h_base}x{s.base.model.num_layers}"
        arms = [("prism", r["schedule"], r.get("lr")) for r in top] + [("uniform", uniform, None)]
        self.say(
            f"prism search: confirmation: {', '.join(a[1] for a in arms)} x {s.confirm_seeds} seeds -> experiment {experiment}"
        )
        for seed in range(1, s.confirm_seeds + 1):
            for arm, sched, lr in arms:
                key = f"c-{arm}-{sched.replace(',', '_')}-s{seed}"
                if key in self.state.runs:
                    continue
                extra = [f"run.arm={arm}", f"schedule.heads={sched}", f"run.seed={seed}"] + (
                    [f"train.lr={lr!r}"] if lr else []
                )
                # one folder per run, seeds included: a run's marker, exit record and log are its own
                folder = s.folder / "confirm" / key
                self.new_record(
                    key, "confirm", run_overrides(s, folder, experiment, extra), "queued", schedule=sched, lr=lr
                )
        while True:
            pending = [r for r in self.state.runs.values() if r["kind"] == "confirm" and r["status"] not in FINAL]
            for rec in pending:
                if rec["status"] == "running" and not self.launcher.alive(rec):
                    reason, step = outcome(rec)
                    rec["status"] = "complete" if reason == "finished" else "failed"
                    self.state.save()
                    self.say(f"  {self.label(rec)}: {reason} at step {step}")
            running = [r for r in pending if r["status"] == "running"]
            for rec in pending:
                if rec["status"] == "queued" and len(running) < s.concurrency:
                    rec["status"] = "launching"
                    self.state.save()
                    self.launch(rec)
                    running.append(rec)
            if not any(r["status"] not in FINAL for r in self.state.runs.values() if r["kind"] == "confirm"):
                break
            time.sleep(self.poll_s)
        result = compare_arms(experiment, self.uri, s.folder / "confirm" / "compare")
        self.say(result["table"])
        failed = [r["key"] for r in self.state.runs.values() if r["kind"] == "confirm" and r["status"] == "failed"]
        return 1 if failed else 0


def make_sampler(spec: SearchSpec) -> Any:
    import optuna

    if spec.sampler == "random" or (spec.sampler == "grid" and not spec.lr):
        return optuna.samplers.RandomSampler(seed=spec.seed)
    return optuna.samplers.TPESampler(seed=spec.seed)


def make_pruner(spec: SearchSpec) -> Any:
    import optuna

    r = spec.rungs
    if spec.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(r.min_tokens, r.full_tokens, r.reduction_factor)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=r.min_tokens, reduction_factor=r.reduction_factor)


def run_search(spec: SearchSpec, resume: bool = False, poll_s: float = 1.0) -> int:
    driver = Driver(spec, resume, poll_s=poll_s)
    try:
        return driver.run()
    except KeyboardInterrupt:  # the runs live in their own sessions: they go on without the driver
        running = [driver.launcher.describe(r) for r in driver.state.runs.values() if r["status"] == "running"]
        print(
            f"prism search: driver stopped; {len(running)} runs keep going ({', '.join(running) or 'none'}); "
            f"`prism search {spec.path} --resume` picks them up",
            flush=True,
        )
        return 130
