"""Which nodes a job may use: launchers/train_job.sh asks before each start of the training step.

    python -m launchers.nodes preflight STATE_DIR NODES PROCS_PER_NODE CONFIG [overrides...]
    python -m launchers.nodes excluded      # the job's ExcNodeList, comma separated (empty: none)

`preflight` runs pipeline.preflight on every node of the job (one srun task per node) and exits 0 when every
node passed. A node that failed it, or on which it could not run (srun names the node), is kept out of the
job: the job is requeued held, the node joins the job's ExcNodeList (merged with the nodes already there;
Slurm refuses the change while the job runs, hence the hold) and the job is released; exits EXIT_STOPPED, and
the job script ends. The nodes a job excluded are listed in STATE_DIR/JOB.excluded: once PRISM_MAX_RESTARTS
nodes are out, a further failure more likely has one shared cause (a full filesystem, a broken image), so the
job stops with EXIT_PREFLIGHT instead. PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS sets the all-reduce floor on CUDA
nodes. Prints the nodes' check lines and one verdict line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from pipeline import config, preflight
from pipeline.atomic import write_atomic
from pipeline.config import ConfigError
from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_PREFLIGHT, EXIT_STOPPED
from pipeline.restart import max_restarts

# srun's line for a task that failed: `srun: error: prism2: task 1: Exited with exit code 6`
SRUN_TASK_FAILED = re.compile(r"^srun: error: (\S+): tasks? [\d,-]+: ")
SRUN_TIME_LIMIT_MIN = 10  # a check hung on a sick GPU ends here, and srun names the node


def failed_nodes(output: str) -> list[str]:
    """The nodes a pre-flight step's output names as failed, in order of appearance."""
    nodes: dict[str, None] = {}
    for text in output.splitlines():
        if m := preflight.FAILED_NODE.match(text) or SRUN_TASK_FAILED.match(text):
            nodes[m.group(1)] = None
    return list(nodes)


def merge(existing: list[str], new: list[str]) -> list[str]:
    """``existing`` then the nodes of ``new`` not in it."""
    return existing + [n for n in new if n not in existing]


def job_field(show_job: str, name: str) -> str:
    """A field of `scontrol show job -o` ('' when unset: Slurm prints `(null)`)."""
    m = re.search(rf"(?:^|\s){name}=(\S*)", show_job)
    return "" if not m or m.group(1) == "(null)" else m.group(1)


def scontrol(*args: str) -> str:
    out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise RuntimeError(f"scontrol {' '.join(args)}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def excluded(job_id: str) -> list[str]:
    """The nodes the job may not use now, its ExcNodeList expanded (`prism[1-2]` -> prism1, prism2)."""
    expr = job_field(scontrol("show", "job", "-o", job_id), "ExcNodeList")
    return scontrol("show", "hostnames", expr).split() if expr else []


def exclude_and_requeue(job_id: str, nodes: list[str]) -> list[str]:
    """Requeue the job held, add ``nodes`` to its ExcNodeList, release it; returns the new list. The hold ends
    this job's processes with SIGTERM: this one, and the scontrol calls it makes, ignore it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    merged = merge(excluded(job_id), nodes)
    scontrol("requeuehold", job_id)
    try:
        scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(merged)}")
    finally:
        scontrol("release", job_id)  # never leave the job held, even when the update failed
    return merged


def check_flags(nodes: str, procs: str, config_path: str, overrides: list[str]) -> list[str]:
    """The per-node command's flags, refused here in one line before srun starts anything."""
    flags = [config_path, *overrides, "--nodes", nodes, "--nproc-per-node", procs]
    floor = os.environ.get("PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS")
    if floor is not None:
        flags += ["--min-allreduce-gbps", floor]
    try:
        args = preflight.parse(flags)
    except ConfigError as e:
        if floor is None:
            raise
        raise ConfigError(f"{e} (PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS={floor!r} sets the floor)") from None
    config.load(args.config, args.overrides)
    return flags


def run_preflight(state_dir: Path, flags: list[str], nodes: int, bound: int) -> int:
    job_id = os.environ["SLURM_JOB_ID"]
    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    command = [*srun, f"--time={SRUN_TIME_LIMIT_MIN}", sys.executable, "-m", "pipeline.preflight", *flags]
    output = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as step:
        for text in step.stdout or ():  # into the job log as they come: a hung check shows where it hangs
            print(text, end="", flush=True)
            output.append(text)
    if step.returncode == 0:
        return 0
    bad = failed_nodes("".join(output))
    if not bad:
        print(
            f"train_job: error: the pre-flight step failed (exit {step.returncode}) without naming a node; see the "
            "lines above; not requeueing",
            flush=True,
        )
        return EXIT_PREFLIGHT
    record = state_dir / f"{job_id}.excluded"
    before = record.read_text().split() if record.is_file() else []
    if len(before) >= bound:
        print(
            f"train_job: error: node(s) {','.join(bad)} failed the pre-flight after this job excluded {len(before)} "
            f"({','.join(before)}), the bound (PRISM_MAX_RESTARTS={bound}); one shared cause is likelier than "
            "so many bad nodes; not requeueing (docs/cluster.md: a node excluded)",
            flush=True,
        )
        return EXIT_PREFLIGHT
    try:
        merged = exclude_and_requeue(job_id, bad)
    except RuntimeError as e:
        print(
            f"train_job: error: node(s) {','.join(bad)} failed the pre-flight and could not be excluded: {e}; "
            "not requeueing",
            flush=True,
        )
        return EXIT_PREFLIGHT
    write_atomic(record, "".join(f"{n}\n" for n in merge(before, bad)))
    print(
        f"train_job: node(s) {','.join(bad)} failed the pre-flight; job {job_id} requeued with "
        f"ExcNodeList={','.join(merged)} (exclusion {len(before) + 1} of at most {bound}, PRISM_MAX_RESTARTS; "
        "docs/cluster.md: a node excluded)",
        flush=True,
    )
    return EXIT_STOPPED


def main(argv: list[str]) -> int:
    if argv[:1] == ["excluded"]:  # for the run's MLflow tag: a failure here must not stop the job
        try:
            print(",".join(excluded(os.environ["SLURM_JOB_ID"])))
        except (RuntimeError, OSError, KeyError, subprocess.SubprocessError) as e:
            print(f"train_job: warning: cannot read the job's ExcNodeList: {e}", file=sys.stderr)
        return 0
    if len(argv) < 5 or argv[0] != "preflight":
        print("train_job: error: usage: python -m launchers.nodes preflight|excluded ...", file=sys.stderr)
        return EXIT_BAD_INPUT
    state_dir, nodes, procs, config_path, overrides = Path(argv[1]), argv[2], argv[3], argv[4], argv[5:]
    try:
        bound = max_restarts(os.environ)
        flags = check_flags(nodes, procs, config_path, overrides)
    except ConfigError as e:
        print(f"train_job: error: pre-flight: {e}; not requeueing", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return run_preflight(state_dir, flags, int(nodes), bound)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
