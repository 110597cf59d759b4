"""Submit a `gti` command to a Ray cluster as a Ray job, wait for it, print its logs.

    python jobs/submit.py --address http://127.0.0.1:8265 -- gti run --config jobs/configs/tiny.yaml

The same as `ray job submit --working-dir . --runtime-env jobs/runtime_env.yaml -- <command>`,
through the Job Submission SDK (`ray.job_submission.JobSubmissionClient`), with what the bare
CLI leaves to the user:
- token authentication: when the cluster's token is at hand (RAY_AUTH_TOKEN,
  RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) and RAY_AUTH_MODE is unset, token mode is switched
  on for this client; without it a Ray 2.60 head answers "Missing authentication token";
- waiting for a head that is still starting (--connect-timeout);
- the exit status: 0 only when the job ends SUCCEEDED, so scripts and CI can chain on it.

Run it from the repository root: the runtime env's `py_modules: [platform/gti]` is a path
relative to the current directory. What it does not know: anything about gti's pipeline; the
command after `--` is passed through verbatim as the job's entrypoint (a shell command run on
the head, in the uploaded working directory, with the cluster's Python and PATH).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import yaml

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _enable_token_auth_if_available() -> None:
    """Set RAY_AUTH_MODE=token when a token exists and the user did not choose a mode.

    Must run before `ray` is imported: Ray reads the mode once per process."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    if (
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or (Path.home() / ".ray" / "auth_token").is_file()
    ):
        os.environ["RAY_AUTH_MODE"] = "token"


def load_runtime_env(path: str | None, working_dir: str | None) -> dict:
    env: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise SystemExit(f"submit: runtime env file not found: {p}")
        env = yaml.safe_load(p.read_text()) or {}
        if not isinstance(env, dict):
            raise SystemExit(f"submit: {p}: top level must be a mapping")
    if working_dir:
        env["working_dir"] = working_dir
    return env


def connect(address: str, timeout: float):
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    deadline = time.time() + timeout
    while True:
        try:
            return JobSubmissionClient(address)
        except AuthenticationError as err:
            # Waiting does not help: the token is missing or wrong.
            first = str(err).strip().splitlines()[0]
            raise SystemExit(
                f"submit: {address} refused the client ({first}); set RAY_AUTH_MODE=token and give "
                "the cluster's token via RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
            ) from None
        except Exception as err:  # the head may still be starting
            if time.time() > deadline:
                raise SystemExit(f"submit: no Ray job API at {address} after {timeout:.0f}s: {err}")
            time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"),
                    help="the head's job API (dashboard) address")
    ap.add_argument("--working-dir", default=".", help="uploaded and used as the job's cwd")
    ap.add_argument("--runtime-env", default="jobs/runtime_env.yaml")
    ap.add_argument("--submission-id", default=None)
    ap.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to wait for the job")
    ap.add_argument("--connect-timeout", type=float, default=60)
    ap.add_argument("--no-wait", action="store_true", help="print the submission id and return")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the job's command")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the job's command after --, e.g. -- gti run --config jobs/configs/tiny.yaml")

    _enable_token_auth_if_available()
    client = connect(args.address, args.connect_timeout)
    runtime_env = load_runtime_env(args.runtime_env, args.working_dir)
    job_id = client.submit_job(
        entrypoint=shlex.join(command), runtime_env=runtime_env, submission_id=args.submission_id
    )
    print(f"submit: job {job_id} submitted to {args.address}", file=sys.stderr, flush=True)
    if args.no_wait:
        print(job_id)
        return 0

    deadline = time.time() + args.timeout
    status = str(client.get_job_status(job_id))
    while status.split(".")[-1] not in TERMINAL:
        if time.time() > deadline:
            client.stop_job(job_id)
            print(f"submit: job {job_id} still {status} after {args.timeout:.0f}s; stopped it",
                  file=sys.stderr)
            return 124
        time.sleep(2.0)
        status = str(client.get_job_status(job_id)).split(".")[-1]
    sys.stdout.write(client.get_job_logs(job_id))
    print(f"submit: job {job_id} {status}", file=sys.stderr, flush=True)
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    raise SystemExit(main())
