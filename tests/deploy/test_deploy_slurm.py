"""deploy/slurm/dualpath.sbatch under a real two-node Slurm on this host: roles by node, one engine per (fake) GPU
with its own CUDA_VISIBLE_DEVICES, a chat request served end to end, and an ordered shutdown that ends the job
COMPLETED with no process left behind. Security (deploy/README.md, "Security"): a per-job cluster token in a 0600
file that every part gets, the frontend's key required beyond the node and given to the frontend alone, the job's
files private (umask 077)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from dualpath import LLM, SamplingParams
from slurm_cluster import SlurmCluster, free_port, slurm_missing
from dualpath.traffic.memory import SEGMENT_PREFIX, SHM_DIR, remove_segments

ROOT = Path(__file__).resolve().parents[2]
BS = 16
KEY = "sk-slurm-test-key"  # the frontend's API key in the test jobs (it listens on 0.0.0.0)
needs_slurm = pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster(nodes=2, cpus=2, gpus=2).start()
    yield cluster
    cluster.stop()


def dualpath_command(tmp: Path) -> str:
    """This interpreter's dualpath, as one executable path (what DUALPATH names in the job)."""
    wrapper = tmp / "dualpath"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m dualpath.cli "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def wait_for(predicate, timeout: float, what: str, diagnose=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout:.0f} s\n{diagnose()}")


def leftovers(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "--", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def job_env(slurm, tmp_path: Path, model: Path, sched_port: int, gpus: int = 2) -> dict[str, str]:
    """The environment of a small CPU job: ``gpus`` engines per node, a tiny model, the shared dir under tmp_path;
    no cluster token of this test process's (an in-process cluster gave it one): the job makes its own."""
    inherited = {
        k: v for k, v in slurm.env.items() if k not in ("DUALPATH_CLUSTER_TOKEN", "DUALPATH_CLUSTER_TOKEN_FILE")
    }
    return {
        **inherited,
        "DUALPATH": dualpath_command(tmp_path),
        "DUALPATH_DEVICE": "cpu",
        "DUALPATH_DTYPE": "float32",
        "DUALPATH_SHARED_DIR": str(tmp_path / "shared"),
        "DUALPATH_MODEL": str(model),
        "DUALPATH_TRANSPORT": "shm",
        "DUALPATH_PORT": str(free_port()),
        "DUALPATH_SCHEDULER_PORT": str(sched_port),
        "DUALPATH_SCHEDULER_HTTP_PORT": str(free_port()),
        "DUALPATH_START_TIMEOUT": "240",
        "DUALPATH_ENGINE_ARGS": f"--block-size {BS} --buffer-bytes {8 << 20} --cache-bytes {32 << 20} "
        "--workspace-tokens 2048 --cost-model 0.002,0.00001,0",
        "DUALPATH_GPUS_PER_NODE": str(gpus),
        "PYTHONPATH": str(ROOT),
        "DUALPATH_API_KEY": KEY,
    }


def submit(slurm, script: str, env: dict[str, str], tmp_path: Path) -> str:
    gpus = env["DUALPATH_GPUS_PER_NODE"]
    return subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            f"--gpus-per-node={gpus}",
            "--time=20",
            f"--output={tmp_path}/job.out",
            str(ROOT / "deploy/slurm" / script),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()


def job_diagnosis(slurm, job: str, tmp_path: Path):
    def diagnose() -> str:
        run_dir = tmp_path / "shared" / f"run-{job}"
        logs = [p for p in [tmp_path / "job.out", *sorted(run_dir.glob("*.log"))] if p.exists()]
        return f"job: {slurm.job(job)}\n" + "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in logs)

    return diagnose


def wait_job_end(slurm, job: str, diagnose, timeout: float = 180) -> dict[str, str]:
    wait_for(
        lambda: slurm.job(job).get("JobState") not in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING", None, ""),
        timeout,
        "the job's end",
        diagnose,
    )
    return slurm.job(job)


def assert_clean_end(run_dir: Path, tmp_path: Path, markers: list[str], diagnose, engines: int = 4) -> None:
    assert "shutting down" in (tmp_path / "job.out").read_text()
    assert not (run_dir / "endpoint").exists()
    assert not (run_dir / "cluster-token").exists(), "the job's token outlived it"
    logs = list(run_dir.glob("*-node*-*.log"))
    assert len(logs) == engines, diagnose()
    for log in logs:  # every engine stopped on SIGTERM, none was killed
        assert "stopped" in log.read_text().splitlines()[-1], diagnose()
    time.sleep(1)
    left = [line for m in markers for line in leftovers(m)]
    assert not left, left
    assert not orphan_segments(since=tmp_path.stat().st_ctime), "engines left shared memory behind"


def orphan_segments(since: float) -> list[str]:
    """Shared-memory segments created after ``since`` by processes that are gone (names carry the pid)."""
    out = []
    for name in os.listdir(SHM_DIR):
        pid = name[len(SEGMENT_PREFIX) :].split("-")[0]
        if name.startswith(SEGMENT_PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                if os.stat(os.path.join(SHM_DIR, name)).st_ctime >= since:
                    out.append(name)
            except FileNotFoundError:
                pass
    return out


@needs_slurm
@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_sbatch_serves_a_chat_and_shuts_down_cleanly_on_scancel(slurm, tiny_dirs, tmp_path):
    sched_port = free_port()
    job = submit(slurm, "dualpath.sbatch", job_env(slurm, tmp_path, tiny_dirs["llama"], sched_port), tmp_path)
    run_dir, diagnose = tmp_path / "shared" / f"run-{job}", job_diagnosis(slurm, job, tmp_path)

    def endpoint():
        state = slurm.job(job).get("JobState", "")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {state}\n{diagnose()}"
        p = run_dir / "endpoint"
        return p.read_text().strip() if p.exists() else None

    try:
        url = wait_for(endpoint, 300, "the endpoint", diagnose)
        assert_private_and_keyed(run_dir, url, sched_port, diagnose)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
        messages = [{"role": "user", "content": "hello from a slurm job, how are the engines? " * 3}]
        for turn in range(2):  # the second turn's prefix comes back from the KV store on the shared mount
            r = c.chat.completions.create(
                model="llama", messages=messages, max_tokens=8, temperature=0, extra_body={"dualpath": {"usage": True}}
            )
            want = reference.generate(
                reference.tokenizer.apply_chat_template(messages), SamplingParams(temperature=0, max_tokens=8)
            )[0]
            assert r.choices[0].message.content == want.text
            messages += [{"role": "assistant", "content": want.text}, {"role": "user", "content": "and then?"}]
        assert r.usage.prompt_tokens_details.cached_tokens > 0

        # Roles by node, one engine per GPU: each task of a node got a different GPU.
        for role, node in (("prefill", "node1"), ("decode", "node2")):
            seen = {
                (run_dir / f"{role}-{node}-{t}.log").read_text().split("CUDA_VISIBLE_DEVICES=")[1].split()[0]
                for t in range(2)
            }
            assert seen == {"0", "1"}, (role, seen)
    finally:
        slurm.run("scancel", "--batch", "--signal=TERM", job, check=False)
    info = wait_job_end(slurm, job, diagnose)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", diagnose()
    assert_clean_end(run_dir, tmp_path, [str(tmp_path / "shared"), f":{sched_port}"], diagnose)
    # umask 077 reached the engines: the KV blocks they stored (the second turn's hit) are the user's alone
    kv = [f for f in (tmp_path / "shared" / "kv").rglob("*") if f.is_file()]
    assert kv and not [f for f in kv if f.stat().st_mode & 0o077], [oct(f.stat().st_mode) for f in kv][:5]


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def process_umask(pid: int) -> str:
    return next(
        line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Umask:")
    )


def assert_private_and_keyed(run_dir: Path, url: str, sched_port: int, diagnose) -> None:
    """While the job serves: its run directory and token are the user's alone; every engine (an srun task, one per
    node), the scheduler and the frontend got the token's file and the job's umask; only the frontend got the key,
    and through its environment, not its command line; a request without the key is refused."""
    import httpx

    token = run_dir / "cluster-token"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700, oct(run_dir.stat().st_mode)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64, oct(token.stat().st_mode)
    scheduler = f"127.0.0.1:{sched_port}"  # the nodes' NodeAddr
    parts = {
        "prefill": f"--scheduler {scheduler} --engine-id prefill-node1-0",
        "decode": f"--scheduler {scheduler} --engine-id decode-node2-0",
        "scheduler": f"scheduler --host 0.0.0.0 --port {sched_port} ",
        "frontend": f"frontend --scheduler {scheduler}",
    }
    for part, marker in parts.items():
        pids = [int(line.split()[0]) for line in leftovers(marker)]
        assert len(pids) == 1, f"{part}: {pids}\n{diagnose()}"
        env = process_env(pids[0])
        assert env.get("DUALPATH_CLUSTER_TOKEN_FILE") == str(token), (part, diagnose())
        assert process_umask(pids[0]) == "0077", part
        assert ("DUALPATH_API_KEY" in env) is (part == "frontend"), part  # the key is the frontend's alone
        assert KEY.encode() not in Path(f"/proc/{pids[0]}/cmdline").read_bytes(), part
    # the job's internal plane is closed: its scheduler refuses a caller without the token, answers one with it
    plain = {k: v for k, v in os.environ.items() if not k.startswith("DUALPATH_CLUSTER_TOKEN")}
    status = [sys.executable, "-m", "dualpath.cli", "status", "--scheduler", scheduler]
    r = subprocess.run(status, cwd=ROOT, capture_output=True, text=True, timeout=60, env=plain)
    assert r.returncode != 0 and "token" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    subprocess.run(
        status,
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
        env={**plain, "DUALPATH_CLUSTER_TOKEN_FILE": str(token)},
    )
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200


@needs_slurm
def test_a_job_serving_beyond_its_node_without_a_key_fails_at_start(slurm, tiny_dirs, tmp_path):
    """No DUALPATH_API_KEY, the frontend on 0.0.0.0: the job fails at once, saying why, with nothing started."""
    env = job_env(slurm, tmp_path, tiny_dirs["llama"], free_port(), gpus=1)
    del env["DUALPATH_API_KEY"]
    job = submit(slurm, "dualpath.sbatch", env, tmp_path)
    diagnose = job_diagnosis(slurm, job, tmp_path)
    info = wait_job_end(slurm, job, diagnose, timeout=60)
    assert info["JobState"] == "FAILED", diagnose()
    out = (tmp_path / "job.out").read_text()
    assert "refusing to start: the frontend would listen on 0.0.0.0" in out and "DUALPATH_API_KEY" in out, out
    assert "DUALPATH_ALLOW_NO_KEY=1" in out
    assert not (tmp_path / "shared" / f"run-{job}").exists()  # nothing made, nothing started
    assert not leftovers(str(tmp_path / "shared"))


@needs_slurm
@pytest.mark.slow  # ~16 s: a whole job; the replay itself is test_rollout's, this script parses in the default run
def test_rollout_job_replays_trajectories_and_ends(slurm, tiny_dirs, tmp_path):
    from dualpath.rollout.trajectory import read_trajectories

    traj, out = tmp_path / "traj.jsonl", tmp_path / "out.jsonl"
    traj.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"agent-{a}",
                    "rounds": [
                        {"append": f"agent {a} starts a task with a long enough prompt " * 4, "generate": 4},
                        {"append": "tool output " * 8, "generate": 3},
                    ],
                }
            )
            + "\n"
            for a in range(3)
        )
    )
    sched_port = free_port()
    # one engine per node: roles by node and GPUs by task are the serving job's test; this one is the replay
    env = {
        **job_env(slurm, tmp_path, tiny_dirs["llama"], sched_port, gpus=1),
        "DUALPATH_TRAJECTORIES": str(traj),
        "DUALPATH_ROLLOUT_OUT": str(out),
    }
    del env["DUALPATH_API_KEY"]  # its frontend serves the node only (DUALPATH_HOST=127.0.0.1): no key needed
    job = submit(slurm, "rollout.sbatch", env, tmp_path)
    diagnose = job_diagnosis(slurm, job, tmp_path)
    info = wait_job_end(slurm, job, diagnose, timeout=300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", diagnose()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6 and len(list(read_trajectories(traj))) == 3
    assert sorted(r["completion_tokens"] for r in records) == [3, 3, 3, 4, 4, 4], records[0]
    assert_clean_end(
        tmp_path / "shared" / f"run-{job}", tmp_path, [str(tmp_path / "shared"), f":{sched_port}"], diagnose, engines=2
    )


def test_slurm_scripts_parse():
    for script in ("cluster.sh", "dualpath.sbatch", "rollout.sbatch"):
        subprocess.run(["bash", "-n", str(ROOT / "deploy/slurm" / script)], check=True)
    assert os.access(ROOT / "deploy/slurm/dualpath.sbatch", os.X_OK)


@needs_slurm
@pytest.mark.slow  # ~22 s: a whole job, the scheduler restarted
def test_a_killed_scheduler_comes_back_on_its_port_and_the_job_keeps_serving(slurm, tiny_dirs, tmp_path):
    sched_port = free_port()
    job = submit(slurm, "dualpath.sbatch", job_env(slurm, tmp_path, tiny_dirs["llama"], sched_port, gpus=1), tmp_path)
    run_dir, diagnose = tmp_path / "shared" / f"run-{job}", job_diagnosis(slurm, job, tmp_path)
    job_out, marker = tmp_path / "job.out", f"scheduler --host 0.0.0.0 --port {sched_port} "
    try:
        url = wait_for(
            lambda: (run_dir / "endpoint").exists() and (run_dir / "endpoint").read_text().strip(),
            300,
            "the endpoint",
            diagnose,
        )
        victim = int(leftovers(marker)[0].split()[0])
        os.kill(victim, 9)
        wait_for(lambda: "scheduler restarted" in job_out.read_text(), 60, "the scheduler's restart", diagnose)
        assert "scheduler (process" in job_out.read_text() and "(restart 1 of at most 5" in job_out.read_text()
        again = [int(line.split()[0]) for line in leftovers(marker)]
        assert again and victim not in again, diagnose()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "dualpath.cli",
                "status",
                "--scheduler",
                f"127.0.0.1:{sched_port}",
                "--wait-prefill",
                "1",
                "--wait-decode",
                "1",
                "--timeout",
                "60",
            ],  # the engines register again
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=90,
            env={
                **{k: v for k, v in os.environ.items() if k != "DUALPATH_CLUSTER_TOKEN"},
                "DUALPATH_CLUSTER_TOKEN_FILE": str(run_dir / "cluster-token"),
            },
        )
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        r = c.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "still there?"}], max_tokens=4, temperature=0
        )
        assert r.choices[0].message.content, diagnose()
        assert slurm.job(job).get("JobState") == "RUNNING", diagnose()
    finally:
        slurm.run("scancel", "--batch", "--signal=TERM", job, check=False)
    info = wait_job_end(slurm, job, diagnose)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", diagnose()
    assert_clean_end(run_dir, tmp_path, [str(tmp_path / "shared"), f":{sched_port}"], diagnose, engines=2)


# cluster.sh's supervision without Slurm: a "scheduler" that stays up, a "frontend" that exits 3 after 0.3 s.
SUPERVISED = r"""
set -uo pipefail
source "$CLUSTER_SH"
dp_run_steady() { sleep 300 & }
dp_run_flaky() { bash -c 'echo started >>"$0"; sleep 0.3; exit 3' "$STARTS" & }
trap dp_on_signal TERM INT
dp_start scheduler dp_run_steady
dp_start frontend dp_run_flaky
dualpath_cluster_wait; rc=$?
kill -0 "$DP_SCHEDULER" 2>/dev/null && echo "the scheduler was left running" >&2
exit $rc
"""


def supervised(tmp_path: Path, max_restarts: int) -> tuple[subprocess.Popen, Path, Path]:
    """Run SUPERVISED; its stderr (the dp_log lines) goes to the returned log, each start of the frontend to starts."""
    log, starts = tmp_path / "supervised.log", tmp_path / "starts"
    env = {
        **os.environ,
        "CLUSTER_SH": str(ROOT / "deploy/slurm/cluster.sh"),
        "DUALPATH_RUN_DIR": str(tmp_path),
        "DUALPATH_MAX_RESTARTS": str(max_restarts),
        "STARTS": str(starts),
    }
    with open(log, "w") as err:
        proc = subprocess.Popen(["bash", "-c", SUPERVISED], env=env, stderr=err, stdout=err)
    return proc, log, starts


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_part_that_keeps_dying_is_restarted_with_backoff_up_to_the_cap(tmp_path):
    proc, log, starts = supervised(tmp_path, max_restarts=2)
    t0 = time.monotonic()
    assert proc.wait(30) == 1, log.read_text()
    took, text = time.monotonic() - t0, log.read_text()
    assert starts.read_text().count("started") == 3, text  # the first start and 2 restarts
    assert "frontend (process" in text and "exited with status 3; restarting it in 1 s (restart 1 of at most 2" in text
    assert "restarting it in 2 s (restart 2 of at most 2 in 600 s)" in text, text
    assert re.search(
        r"process \d+ \(frontend, status 3\) exited on its own after 2 restarts in 600 s; "
        "stopping the job",
        text,
    ), text
    assert "shutting down" in text and "left running" not in text, text
    assert took >= 3, took  # 1 s + 2 s of backoff


def test_no_restarts_with_max_restarts_0_the_job_stops_at_once(tmp_path):
    proc, log, starts = supervised(tmp_path, max_restarts=0)
    assert proc.wait(30) == 1, log.read_text()
    text = log.read_text()
    assert re.search(r"process \d+ exited on its own; stopping the job", text), text
    assert starts.read_text().count("started") == 1 and "restart" not in text, text
    assert "shutting down" in text and "left running" not in text, text


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_shutdown_during_the_backoff_starts_nothing_more(tmp_path):
    proc, log, starts = supervised(tmp_path, max_restarts=5)
    try:
        wait_for(lambda: "restarting it in 2 s" in log.read_text(), 20, "the second restart's backoff", log.read_text)
        proc.send_signal(15)
        assert proc.wait(10) == 0, log.read_text()  # the ordered shutdown, not the backoff's end
    finally:
        proc.kill()
    time.sleep(2.5)
    text = log.read_text()
    assert starts.read_text().count("started") == 2, text
    assert "shutting down" in text and "left running" not in text, text
    assert text.count("frontend restarted") == 1, text


def test_a_shutdown_signal_while_a_part_starts_stops_that_part_too(tmp_path):
    """TERM between a part's launch and the record of its pid: the shutdown waits for the record, so it stops it."""
    script = r"""
set -uo pipefail
source "$CLUSTER_SH"
dp_run_steady() { sleep 300 & }
dp_run_signaled() { sleep 301 & kill -TERM $$; sleep 0.2; }
trap dp_on_signal TERM INT
dp_start scheduler dp_run_steady
dp_start frontend dp_run_signaled
kill -0 "$DP_FRONTEND" 2>/dev/null && echo "the frontend was left running" >&2
dp_start frontend dp_run_steady || echo "nothing started after the shutdown" >&2
"""
    env = {**os.environ, "CLUSTER_SH": str(ROOT / "deploy/slurm/cluster.sh"), "DUALPATH_RUN_DIR": str(tmp_path)}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30).stderr
    assert "shutting down" in out and "left running" not in out, out
    assert "nothing started after the shutdown" in out, out


@needs_slurm
@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_dead_engine_ends_the_job_with_a_failure_and_nothing_left(slurm, tiny_dirs, tmp_path):
    sched_port = free_port()
    env = {**job_env(slurm, tmp_path, tiny_dirs["llama"], sched_port, gpus=1), "DUALPATH_MAX_RESTARTS": "0"}
    job = submit(slurm, "dualpath.sbatch", env, tmp_path)
    run_dir, diagnose = tmp_path / "shared" / f"run-{job}", job_diagnosis(slurm, job, tmp_path)
    wait_for(lambda: (run_dir / "endpoint").exists(), 300, "the endpoint", diagnose)
    victim = [line.split()[0] for line in leftovers("decode-node2-0")]
    assert victim, diagnose()
    os.kill(int(victim[0]), 9)
    info = wait_job_end(slurm, job, diagnose)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", diagnose()
    assert "exited on its own" in (tmp_path / "job.out").read_text()
    time.sleep(1)
    left = leftovers(str(tmp_path / "shared")) + leftovers(f":{sched_port}")
    assert not left, left
    remove_segments(int(victim[0]))  # killed outright, it could not unlink its buffer (a job epilog's work)
    assert not orphan_segments(since=tmp_path.stat().st_ctime), "the engines stopped in order left shared memory"


@needs_slurm
@pytest.mark.slow  # ~20 s: a whole job, an engine step restarted
def test_a_killed_engine_is_restarted_and_the_job_keeps_serving(slurm, tiny_dirs, tmp_path):
    """SIGKILL a decode engine: its srun step ends, the batch shell runs it again on the same node under the same
    engine name, and the endpoint serves again; scancel still ends the job in order with nothing left."""
    sched_port = free_port()
    job = submit(slurm, "dualpath.sbatch", job_env(slurm, tmp_path, tiny_dirs["llama"], sched_port, gpus=1), tmp_path)
    run_dir, diagnose = tmp_path / "shared" / f"run-{job}", job_diagnosis(slurm, job, tmp_path)
    job_out = tmp_path / "job.out"
    victim = None
    try:
        url = wait_for(
            lambda: (run_dir / "endpoint").exists() and (run_dir / "endpoint").read_text().strip(),
            300,
            "the endpoint",
            diagnose,
        )
        victim = int(leftovers("decode-node2-0")[0].split()[0])
        os.kill(victim, 9)
        wait_for(
            lambda: "decode engine step restarted" in job_out.read_text(), 60, "the decode step's restart", diagnose
        )
        assert (
            "exited with status" in job_out.read_text() and "(restart 1 of at most 5 in 600 s)" in job_out.read_text()
        ), diagnose()
        assert slurm.job(job).get("JobState") == "RUNNING", diagnose()

        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
        messages = [{"role": "user", "content": "is the decode engine back after its restart? " * 3}]
        r = c.chat.completions.create(model="llama", messages=messages, max_tokens=8, temperature=0)
        want = reference.generate(
            reference.tokenizer.apply_chat_template(messages), SamplingParams(temperature=0, max_tokens=8)
        )[0]
        assert r.choices[0].message.content == want.text
        again = [int(line.split()[0]) for line in leftovers("decode-node2-0")]
        assert again and victim not in again, diagnose()  # a new engine process under the old name served it
        assert "ready on port" in (run_dir / "decode-node2-0.log").read_text().rsplit("engine task 0", 1)[1], diagnose()
    finally:
        slurm.run("scancel", "--batch", "--signal=TERM", job, check=False)
    info = wait_job_end(slurm, job, diagnose)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", diagnose()
    remove_segments(victim)  # killed outright, it could not unlink its buffer (a job epilog's work)
    assert_clean_end(run_dir, tmp_path, [str(tmp_path / "shared"), f":{sched_port}"], diagnose, engines=2)


@needs_slurm
@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_part_dying_during_start_up_fails_the_job_at_once(slurm, tiny_dirs, tmp_path):
    """The scheduler cannot bind its port: the job fails within seconds, not after DUALPATH_START_TIMEOUT."""
    import socket

    sched_port = free_port()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", sched_port))
        taken.listen()
        env = job_env(slurm, tmp_path, tiny_dirs["llama"], sched_port, gpus=1)
        job = submit(slurm, "dualpath.sbatch", env, tmp_path)
        diagnose = job_diagnosis(slurm, job, tmp_path)
        info = wait_job_end(slurm, job, diagnose, timeout=120)  # START_TIMEOUT is 240 s
    assert info["JobState"] == "FAILED", diagnose()
    assert "exited during start-up" in (tmp_path / "job.out").read_text(), diagnose()
    time.sleep(1)
    assert not leftovers(str(tmp_path / "shared"))


# cluster.sh's security set-up without Slurm: dualpath_cluster_up runs until it looks for the allocation's nodes
# (scontrol, stubbed to name none, so it stops there with 2), then reports what a part it starts would get.
SECURE = r"""
set -uo pipefail
source "$CLUSTER_SH"
scontrol() { :; }
dualpath_cluster_up; rc=$?
echo "rc=$rc umask=$(umask)"
bash -c 'echo "child token=${DUALPATH_CLUSTER_TOKEN_FILE:-} key=${DUALPATH_API_KEY:-}"'
DUALPATH_SCHEDULER=node1:50051 DUALPATH_MODEL_ARGS=""  # (set once the nodes are known)
[ "${PARTS:-0}" = 0 ] || { dp_run_scheduler; wait $!; dp_run_engines prefill node1 1; wait $!; dp_run_frontend; wait $!; }
dualpath_cluster_down
"""


def secure(tmp_path: Path, **env: str) -> tuple[str, Path]:
    """Run SECURE; the fake `srun` and `dualpath` it may call write their environment and arguments to files."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "shared" / "run-7"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "dualpath"):  # what a part would be started with
        fake = bin_dir / name
        fake.write_text(
            f'#!/bin/sh\nenv >"{tmp_path}/{name}-$(echo "$@" | cut -c1-12 | tr -c "a-z\\n" _).env"\n'
            f'echo "$@" >>"{tmp_path}/{name}.args"\n'
        )
        fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("DUALPATH")}
    full = {
        **base,
        "CLUSTER_SH": str(ROOT / "deploy/slurm/cluster.sh"),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DUALPATH": str(bin_dir / "dualpath"),
        "DUALPATH_SHARED_DIR": str(tmp_path / "shared"),
        "DUALPATH_MODEL": "/models/m",
        "SLURM_JOB_ID": "7",
        **env,
    }
    r = subprocess.run(["bash", "-c", SECURE], env=full, capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr, run_dir


def test_the_job_makes_a_private_cluster_token_and_every_part_gets_it(tmp_path):
    out, run_dir = secure(tmp_path, DUALPATH_API_KEY=KEY, PARTS="1")
    assert "rc=2 umask=0077" in out, out  # (2: the stubbed allocation has no nodes)
    token = run_dir / "cluster-token"
    assert f"child token={token} key={KEY}" in out, out  # exported: every process the batch shell starts has it
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "shared" / "kv").stat().st_mode) == 0o700  # the KV store, made under umask 077
    assert not token.exists(), "the job's token outlived it"  # (dualpath_cluster_down removed it)
    # srun steps get the whole environment explicitly (--export=ALL), the token with it, the frontend's key not
    (srun_env,) = tmp_path.glob("srun-*.env")
    srun_env = srun_env.read_text()
    assert "--export=ALL" in (tmp_path / "srun.args").read_text()
    assert f"DUALPATH_CLUSTER_TOKEN_FILE={token}\n" in srun_env and "DUALPATH_API_KEY" not in srun_env
    envs = {p.name.split("-")[1].split("_")[0]: p.read_text() for p in tmp_path.glob("dualpath-*.env")}
    assert set(envs) == {"scheduler", "frontend"}, list(tmp_path.glob("dualpath-*"))
    for part, env in envs.items():
        assert f"DUALPATH_CLUSTER_TOKEN_FILE={token}\n" in env, part
        assert (f"DUALPATH_API_KEY={KEY}\n" in env) is (part == "frontend"), part
    assert KEY not in (tmp_path / "dualpath.args").read_text()  # never on a command line


def test_a_frontend_beyond_the_node_needs_a_key_unless_opted_out(tmp_path):
    out, run_dir = secure(tmp_path)
    assert "rc=2" in out and "refusing to start: the frontend would listen on 0.0.0.0:8000, beyond this node" in out
    assert "DUALPATH_ALLOW_NO_KEY=1" in out and not run_dir.exists() and "child token= " in out  # nothing made

    out, run_dir = secure(tmp_path, DUALPATH_ALLOW_NO_KEY="1")
    assert "refusing" not in out and "WARNING: the frontend listens on 0.0.0.0:8000 without an API key" in out, out
    assert run_dir.exists()

    out, _ = secure(tmp_path, DUALPATH_HOST="127.0.0.1")  # the node alone: no key needed, no warning
    assert "refusing" not in out and "WARNING" not in out and "umask=0077" in out, out

    key_file = tmp_path / "key"
    key_file.write_text("sk-from-a-file\n")
    key_file.chmod(0o600)
    out, _ = secure(tmp_path, DUALPATH_API_KEY_FILE=str(key_file))
    assert "refusing" not in out and "key=sk-from-a-file\n" in out, out  # read once, handed on as DUALPATH_API_KEY


def test_a_given_token_file_is_used_only_when_private(tmp_path):
    token = tmp_path / "token"
    token.write_text("mine")
    token.chmod(0o644)
    out, _ = secure(tmp_path, DUALPATH_API_KEY=KEY, DUALPATH_CLUSTER_TOKEN_FILE=str(token))
    assert f"DUALPATH_CLUSTER_TOKEN_FILE={token} is readable by others: chmod 600 it" in out and "rc=2" in out, out
    token.chmod(0o600)
    out, run_dir = secure(tmp_path, DUALPATH_API_KEY=KEY, DUALPATH_CLUSTER_TOKEN_FILE=str(token))
    assert f"child token={token} " in out and not (run_dir / "cluster-token").exists(), out
    assert token.read_text() == "mine"  # the user's file: neither replaced nor removed
