"""`prism tracking sync RUN_DIR`: deliver what a run buffered while MLflow was unreachable.
`prism tracking grant USER`: on a server started with `ops/mlflow_server.sh start --auth`, create a user and
grant it a permission on an experiment."""

from __future__ import annotations

import argparse
import stat
import sys
from pathlib import Path

from pipeline.config import ConfigError

# What a user may be granted on an experiment (MLflow's basic-auth permissions; NO_PERMISSIONS revokes).
PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")
CREDENTIALS_HINT = "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or ~/.mlflow/credentials"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tracking", help="MLflow tracking chores (replay a run's offline buffer, grant users)")
    actions = p.add_subparsers(dest="tracking_action", required=True, metavar="ACTION")
    s = actions.add_parser("sync", help="replay the records of RUN_DIR's tracking.jsonl not yet in MLflow")
    s.add_argument("run_dir", help="the run folder (<output_dir>/<run name>) or its checkpoint folder")
    s.add_argument("--tracking-uri", help="send to this store instead of the one the run used")
    s.set_defaults(func=run)
    g = actions.add_parser(
        "grant",
        help="create USER on an authenticated server (if new) and grant it a permission on an experiment; "
        f"the admin's credentials come from {CREDENTIALS_HINT}, never from the command line",
    )
    g.add_argument("user", help="the user's name")
    g.add_argument("--experiment", required=True, help="the experiment (created if absent)")
    g.add_argument("--tracking-uri", required=True, help="the server, http(s)://HOST:PORT, without a password")
    g.add_argument(
        "--password-file",
        help="the user's password: a file of mode 0600, or - to read it from stdin; needed for a new user, "
        "sets a new password for an existing one",
    )
    g.add_argument("--permission", default="EDIT", help=f"one of {', '.join(PERMISSIONS)}")
    g.set_defaults(func=grant)


def run(args: argparse.Namespace) -> int:
    from pipeline.tracking.journal import JOURNAL, Journal, journal_folder, sync

    folder = journal_folder(args.run_dir)
    before = len(Journal(folder).pending()) if (folder / JOURNAL).is_file() else 0
    try:
        sent, uri, run_id = sync(folder, args.tracking_uri)
    except Exception as e:
        if isinstance(e, ConfigError):
            raise
        left = len(Journal(folder).pending())
        raise ConfigError(
            f"{folder}: MLflow did not take the records ({_first_line(e)}); {left} still pending; "
            "start the server (ops/mlflow_server.sh start) or pass --tracking-uri, then run sync again"
        ) from None
    print(f"prism tracking sync: {sent} of {before} pending records sent to {uri} (run {run_id})")
    return 0


def _first_line(e: Exception) -> str:
    from pipeline.redaction import redact_text

    return redact_text(str(e).splitlines()[0] if str(e) else type(e).__name__)[:160]


def read_secret(source: str) -> str:
    """A password from stdin ("-") or from a file only its owner can read (mode 0600 or 0400)."""
    if source == "-":
        text = sys.stdin.readline().rstrip("\r\n")
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"--password-file {path} does not exist; write the password into it (mode 0600)")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise ConfigError(f"--password-file {path} has mode {mode:o}, readable by others; run 'chmod 600 {path}'")
        text = path.read_text().rstrip("\r\n")
    if not text:
        raise ConfigError(f"--password-file {source}: the password is empty")
    return text


def _check_grant_args(args: argparse.Namespace) -> None:
    from pipeline.redaction import redact_uri

    uri = args.tracking_uri
    if not uri.startswith(("http://", "https://")):
        raise ConfigError(
            f"--tracking-uri {uri!r}: users exist only on a server; give its http(s)://HOST:PORT "
            "(ops/mlflow_server.sh start --auth)"
        )
    if redact_uri(uri) != uri:
        raise ConfigError(
            f"--tracking-uri {redact_uri(uri)} holds a password, which `ps` and the shell history show; "
            f"drop it and put the admin's credentials in {CREDENTIALS_HINT}"
        )
    if args.permission not in PERMISSIONS:
        raise ConfigError(f"--permission {args.permission!r} is not one of {', '.join(PERMISSIONS)}")
    if not args.user.strip() or not args.experiment.strip():
        raise ConfigError("prism tracking grant: the user and --experiment must not be empty")


def grant(args: argparse.Namespace) -> int:
    _check_grant_args(args)
    password = read_secret(args.password_file) if args.password_file else None
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    from pipeline.tracking import store

    tracking = store.client(args.tracking_uri)  # HTTP defaults: a dead server fails at once
    auth = get_app_client("basic-auth", tracking_uri=args.tracking_uri)
    try:
        created = _ensure_user(auth, args.user, password)
        experiment = tracking.get_experiment_by_name(args.experiment)
        exp_id = experiment.experiment_id if experiment else tracking.create_experiment(args.experiment)
        _set_permission(auth, args.user, exp_id, args.permission)
    except ConfigError:
        raise
    except MlflowException as e:
        raise ConfigError(_refusal(e, args.tracking_uri)) from None
    except Exception as e:  # noqa: BLE001 - unreachable server, TLS: one line, not a traceback
        raise ConfigError(
            f"{args.tracking_uri}: {_first_line(e)}; is the server up (ops/mlflow_server.sh status)?"
        ) from None
    print(
        f"prism tracking grant: user {args.user} ({created}) has {args.permission} on experiment "
        f"{args.experiment} (id {exp_id}) at {args.tracking_uri}"
    )
    return 0


def _ensure_user(auth, user: str, password: str | None) -> str:
    """Create ``user`` or set its new password; returns what happened, for the summary line."""
    from mlflow.exceptions import RestException

    try:
        auth.get_user(user)
    except RestException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        if password is None:
            raise ConfigError(
                f"user {user} does not exist; give its password with --password-file FILE (or -)"
            ) from None
        auth.create_user(user, password)
        return "created"
    if password is None:
        return "existing, password unchanged"
    auth.update_user_password(user, password)
    return "existing, password set"


def _set_permission(auth, user: str, exp_id: str, permission: str) -> None:
    """Grant ``permission``, replacing the one ``user`` holds on the experiment (MLflow grants only once)."""
    from mlflow.exceptions import RestException

    try:
        auth.grant_user_permission(user, "experiment", exp_id, permission)
    except RestException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        auth.revoke_user_permission(user, "experiment", exp_id)
        auth.grant_user_permission(user, "experiment", exp_id, permission)


def _refusal(e: Exception, uri: str) -> str:
    from mlflow.exceptions import RestException

    if not isinstance(e, RestException):  # no answer at all
        return f"{uri} did not answer ({_first_line(e)}); is the server up (ops/mlflow_server.sh status)?"
    code = e.error_code
    if code == "UNAUTHENTICATED":
        return f"{uri} refused the admin's credentials (401); set {CREDENTIALS_HINT} to the admin's"
    if code == "PERMISSION_DENIED":
        return f"{uri}: the credentials in {CREDENTIALS_HINT} are not an admin's (403)"
    return f"{uri}: MLflow refused ({_first_line(e)})"
