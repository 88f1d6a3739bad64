"""Session fixtures, one module each under tests/fixtures/; each is built at most once per pytest session.

tiny_data         a real prepared dataset (embedded corpus slice, 8k BPE, datatrove, seq_len 128)
mlflow_server     a real `mlflow server` on 127.0.0.1
tracked_runs      four tiny `prism train` runs logged to mlflow_server
tiny_checkpoints  a 2-step Prism and uniform checkpoint, each with its own SQLite MLflow store
sqlite_store      an empty, migrated MLflow store at tmp_path/mlflow.db (a copy of one migrated per session)
slurm_cluster     the two-node Slurm cluster of ops/local_slurm

tests/unit/ uses only tiny_data and sqlite_store; the others start processes or services and belong to
tests/integration/.
"""

pytest_plugins = [
    "tests.fixtures.tiny_data",
    "tests.fixtures.mlflow_server",
    "tests.fixtures.tracked_runs",
    "tests.fixtures.checkpoints",
    "tests.fixtures.sqlite_store",
    "tests.fixtures.slurm",
]
