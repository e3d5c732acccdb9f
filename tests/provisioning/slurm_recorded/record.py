"""Re-records the Slurm outputs the parsing tests read (`python -m
tests.provisioning.slurm_recorded.record`, as root, Slurm installed by
scripts/slurm_cluster.sh). Run it against another Slurm version to see whether the
parsers still hold; the files say which version made them (`meta` in the JSON)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.slurm_cluster import running_cluster

HERE = Path(__file__).resolve().parent


def main() -> None:
    with running_cluster() as cluster, cluster.lease():

        def sh(*argv: str, user: str | None = None) -> tuple[int, str, str]:
            if user is not None:
                argv = ("runuser", "-u", user, "--", "env", f"SLURM_CONF={cluster.conf}", *argv)
            done = cluster.command(*argv)
            return done.returncode, done.stdout, done.stderr

        def sbatch(*opts: str) -> int:
            code, out, err = sh("sbatch", "--parsable", "--output=/dev/null", *opts)
            assert code == 0, err
            return int(out.strip())

        a = sbatch(
            "--job-name=train | lr=0.1", "--gres=gpu:a100:2", "--time=10", "--wrap=sleep 120"
        )
        b = sbatch(
            "--job-name=b",
            "--partition=short",
            "--requeue",
            "--gres=gpu:a100:2",
            "--time=5",
            "--wrap=sleep 120",
        )
        c = sbatch("--job-name=c", "--gres=gpu:a100:1", "--time=5", "--wrap=sleep 120")
        d = sbatch("--job-name=d", "--time=1", "--wrap=exit 3")
        e = sbatch("--job-name=e", "--time=1", "--hold", "--wrap=true")
        sh("scancel", str(e))
        end = time.monotonic() + 30
        seen_d = False
        while time.monotonic() < end:
            _, out, _ = sh("squeue", "--all", "--states=all", "--json")
            states = {j["job_id"]: j["job_state"] for j in json.loads(out)["jobs"]}
            pending_reason = {j["job_id"]: j["state_reason"] for j in json.loads(out)["jobs"]}
            seen_d = states.get(d) == "FAILED"
            if seen_d and states.get(c) == "PENDING" and pending_reason.get(c) == "Resources":
                break
            time.sleep(0.1)
        (HERE / "squeue.json").write_text(out)
        (HERE / "sinfo.json").write_text(sh("sinfo", "--all", "--Node", "--json")[1])
        (HERE / "scontrol_show_job_d.txt").write_text(
            sh("scontrol", "show", "job", "-d", str(a))[1]
        )
        refusals = {
            "eight_gpus": sh("sbatch", "--parsable", "--gres=gpu:a100:8", "--wrap=true")[2],
            "unknown_type": sh("sbatch", "--parsable", "--gres=gpu:h100:1", "--wrap=true")[2],
            "bad_partition": sh("sbatch", "--parsable", "-p", "nope", "--wrap=true")[2],
            "uid_not_root": sh(
                "sbatch", "--parsable", "--uid=root", "--wrap=true", user="gpubot-run"
            )[2],
            "timelimit_not_owner": sh(
                "scontrol", "update", f"JobId={a}", "TimeLimit=30", user="gpubot-run"
            )[2],
            "scancel_not_owner": sh("scancel", str(a), user="gpubot-run")[2],
            "requeue_not_requeueable": sh("scontrol", "requeue", str(c))[2],
            "sacct_no_dbd": sh("sacct", "-j", str(a))[2],
        }
        sh("scontrol", "update", f"NodeName={cluster.node}", "State=DRAIN", "Reason=fan broken")
        (HERE / "sinfo_drained.json").write_text(sh("sinfo", "--all", "--Node", "--json")[1])
        sh("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME")
        sh("scancel", str(a), str(b), str(c))
        code, out, err = sh(
            "sbatch",
            "--parsable",
            "--output=/dev/null",
            "--time=5",
            "--chdir=/tmp",
            "--wrap=sleep 60",
            user="gpubot-run",
        )
        assert code == 0, err
        own = out.strip()
        while sh("squeue", "-h", "-j", own, "-o", "%T")[1].strip() != "RUNNING":
            time.sleep(0.1)  # a user may change a pending job's limit, not a running one's
        refusals["timelimit_not_operator"] = sh(
            "scontrol", "update", f"JobId={own}", "TimeLimit=30", user="gpubot-run"
        )[2]
        sh("scancel", own)
        time.sleep(1)
        (HERE / "jobcomp.txt").write_text(cluster.jobcomp.read_text())
        with cluster.controller_down():
            (HERE / "squeue_down.json").write_text(sh("squeue", "--json")[1])
            (HERE / "sinfo_down.json").write_text(sh("sinfo", "--Node", "--json")[1])
            refusals["ping_down"] = sh("scontrol", "ping")[1]
        (HERE / "stderr.json").write_text(json.dumps(refusals, indent=1) + "\n")
        print("recorded jobs", a, b, c, d, e, "into", HERE)


if __name__ == "__main__":
    main()
