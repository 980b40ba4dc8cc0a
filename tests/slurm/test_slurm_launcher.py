"""The SLURM launcher: its presets and dry runs (fast), and real jobs on a local two-node SLURM cluster.

The cluster tests start slurmctld + two slurmd with scripts/slurm/local_cluster.sh (installing Debian's
SLURM and munge first when missing), submit scripts/slurm/pretrain_gpt.sbatch with sbatch, and read the
job's output. They skip, saying why, where the machine cannot run SLURM (not root, no SLURM and no apt); a
cluster that does not start fails them, with the script's output.
"""
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch"
CLUSTER_SCRIPT = REPO / "scripts" / "slurm" / "local_cluster.sh"
TOY_SCRIPT = Path(__file__).resolve().parent / "toy_pipeline.py"
FINAL_JOB_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                    "PREEMPTED", "BOOT_FAIL", "DEADLINE"}

# The paper's models: (layers, hidden, heads, micro batch, p, smallest m); seq 1024 for all.
PAPER_PRESETS = {
    "1.5b": (22, 2304, 24, 6, 8, 24),
    "6.2b": (30, 4096, 32, 3, 8, 24),
    "14.6b": (46, 5120, 40, 1, 16, 48),
    "28.3b": (62, 6144, 48, 1, 32, 96),
}


def clean_environment(**knobs: str) -> dict:
    """The test's environment without SLURM job variables or any knob the launcher reads from outside."""
    launcher_knobs = set(re.findall(r"\$\{([A-Z_]+)", SBATCH_SCRIPT.read_text()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in launcher_knobs}
    env.update(knobs)
    return env


def dry_run(*args: str, **knobs: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH_SCRIPT), *args], env=clean_environment(DRY_RUN="1", **knobs),
                          capture_output=True, text=True, timeout=30)


def torchrun_command(output: str) -> list:
    line = next(l for l in output.splitlines() if l.startswith("torchrun command: "))
    return shlex.split(line[len("torchrun command: "):])


def flag_values(command: list) -> dict:
    """Last value of every `--flag value` (later flags win, as with argparse); bare flags map to True."""
    values = {}
    for i, word in enumerate(command):
        if word.startswith("--"):
            nxt = command[i + 1] if i + 1 < len(command) else None
            values[word] = True if nxt is None or nxt.startswith("--") else nxt
    return values


@pytest.mark.parametrize("model", sorted(PAPER_PRESETS))
def test_paper_presets_give_the_papers_model_and_pipeline_sizes(model):
    layers, hidden, heads, micro, p, m = PAPER_PRESETS[model]
    result = dry_run(MODEL=model, NNODES=str(p // 8))  # 8 GPUs per node, pipeline only: DP = 1
    assert result.returncode == 0, result.stderr
    flags = flag_values(torchrun_command(result.stdout))
    assert flags["--num-layers"] == str(layers)
    assert flags["--hidden-size"] == str(hidden)
    assert flags["--num-attention-heads"] == str(heads)
    assert flags["--seq-length"] == flags["--max-position-embeddings"] == "1024"
    assert flags["--micro-batch-size"] == str(micro)
    assert flags["--pipeline-model-parallel-size"] == str(p)
    assert flags["--tensor-model-parallel-size"] == "1"
    assert flags["--global-batch-size"] == str(micro * m)
    assert flags["--nnodes"] == str(p // 8) and flags["--nproc-per-node"] == "8"
    # layers + embedding + loss divide evenly into p stages only when both count as layers
    assert flags["--account-for-embedding-in-pipeline-split"] is True
    assert flags["--account-for-loss-in-pipeline-split"] is True
    assert (layers + 2) % p == 0
    assert flags["--distributed-backend"] == "nccl" and flags["--bf16"] is True


def test_dry_run_combines_tensor_pipeline_and_data_parallelism():
    result = dry_run(MODEL="6.2b", NNODES="4", TP="2", PP="4", SCHEDULE="zb-h2", NUM_MICROBATCHES="32")
    assert result.returncode == 0, result.stderr
    flags = flag_values(torchrun_command(result.stdout))
    assert flags["--tensor-model-parallel-size"] == "2"
    assert flags["--pipeline-model-parallel-size"] == "4"
    assert flags["--pipeline-schedule"] == "zb-h2"
    assert flags["--global-batch-size"] == str(3 * 32 * 4)  # micro batch x m x DP (32 GPUs / 8)
    assert "world 32 = TP 2 x PP 4 x DP 4" in result.stdout
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-endpoint"] == "localhost:29500"


def test_dry_run_cpu_mode_uses_gloo_and_the_cpu_flags_and_passes_extra_args_last():
    result = dry_run("--seed", "7", "--lr", "5e-3", MODEL="tiny", CPU="1", NNODES="2",
                     NPROC_PER_NODE="2", PP="4", EXTRA_ARGS="--seed 3 --log-interval 2")
    assert result.returncode == 0, result.stderr
    command = torchrun_command(result.stdout)
    flags = flag_values(command)
    assert flags["--distributed-backend"] == "gloo"
    assert flags["--nproc-per-node"] == "2" and flags["--nnodes"] == "2"
    assert flags["--pipeline-model-parallel-size"] == "4"
    for cpu_flag in ("--transformer-impl", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"):
        assert cpu_flag in flags
    assert "--bf16" not in flags and "--account-for-embedding-in-pipeline-split" not in flags
    assert command[-4:] == ["--seed", "7", "--lr", "5e-3"]  # positional arguments come last
    assert flags["--seed"] == "7" and flags["--log-interval"] == "2"


def test_dry_run_paths_turn_on_real_data_checkpoints_and_tensorboard():
    result = dry_run(MODEL="1.5b", DATA_PATH="/data/web_text_document", VOCAB_FILE="/data/vocab.json",
                     MERGE_FILE="/data/merges.txt", CHECKPOINT_DIR="/ckpt", TENSORBOARD_DIR="/tb", LOG_DIR="/logs")
    assert result.returncode == 0, result.stderr
    flags = flag_values(torchrun_command(result.stdout))
    assert flags["--data-path"] == "/data/web_text_document" and "--mock-data" not in flags
    assert flags["--vocab-file"] == "/data/vocab.json" and flags["--merge-file"] == "/data/merges.txt"
    assert flags["--save"] == flags["--load"] == "/ckpt"
    assert flags["--tensorboard-dir"] == "/tb" and flags["--log-dir"] == "/logs"
    without = flag_values(torchrun_command(dry_run(MODEL="1.5b").stdout))
    assert "--mock-data" in without and "--save" not in without and "--tensorboard-dir" not in without


def test_dry_run_zb_v_splits_transformer_layers_only():
    # ZB-V places 2p equal chunks of transformer layers; the runtime refuses the embedding/loss split flags.
    result = dry_run(MODEL="6.2b", NNODES="2", PP="16", NUM_LAYERS="32", SCHEDULE="zb-v")
    assert result.returncode == 0, result.stderr
    flags = flag_values(torchrun_command(result.stdout))
    assert flags["--pipeline-schedule"] == "zb-v" and flags["--num-layers"] == "32"
    assert "--account-for-embedding-in-pipeline-split" not in flags
    assert "--account-for-loss-in-pipeline-split" not in flags


def test_dry_run_rejects_a_world_size_that_tp_times_pp_does_not_divide():
    result = dry_run(MODEL="1.5b", NNODES="1", GPUS_PER_NODE="8", TP="3")
    assert result.returncode != 0
    assert "not a multiple of TP x PP = 3 x 8" in result.stderr


def test_dry_run_rejects_an_unknown_model():
    result = dry_run(MODEL="175b")
    assert result.returncode != 0 and "MODEL must be one of" in result.stderr


# ---------------------------------------------------------------- a real two-node cluster


def cannot_run_slurm() -> str:
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root to run SLURM daemons and network namespaces"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it"
    return ""


@dataclasses.dataclass
class Cluster:
    env: dict  # SLURM_CONF for sbatch/scontrol; empty where the cluster did not start
    failure: str = ""  # why it did not start


def start_cluster() -> Cluster:
    started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True, timeout=300)
    conf = re.search(r"SLURM_CONF=(\S+)", started.stderr)
    if started.returncode != 0 or conf is None:
        return Cluster({}, f"local SLURM cluster did not start (exit {started.returncode}):\n"
                           f"{started.stdout.strip()[-800:]}\n{started.stderr.strip()[-1600:]}")
    return Cluster({"SLURM_CONF": conf.group(1)})


def job_state(job_id: str, env: dict) -> dict:
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True,
                          text=True, timeout=10).stdout
    return dict(field.split("=", 1) for field in line.split() if "=" in field)


@dataclasses.dataclass
class Job:
    job_id: str
    env: dict
    output: Path
    work: Path  # LOG_DIR is work / "logs"


def submit_job(cluster: Cluster, work: Path, *args: str, **knobs: str) -> Job:
    """Submits the launcher on two nodes (LOG_DIR under `work`); the job runs while other tests do."""
    env = clean_environment(**cluster.env, CPU="1", MODEL="tiny", LOG_DIR=str(work / "logs"),
                            TORCHRUN=f"{sys.executable} -m torch.distributed.run", **knobs)
    output = work / "job.out"
    # --exclusive=user (over the script's --exclusive): the suite's two jobs share the two nodes, a core each
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--exclusive=user", f"--output={output}", "--time=10",
         str(SBATCH_SCRIPT), *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    return Job(job_id, env, output, work)


def submit_both_jobs(cluster: Cluster, work: Path) -> dict[str, Job]:
    """Both jobs, submitted together: the cluster runs them side by side (each node has room for two ranks), so the
    second does not wait for the first's start-up. The toy script stands in for megatron: it prints one loss line
    per iteration naming every rank's host, and honours the last --train-iters, here the positional one given to
    sbatch. Their torchruns meet on node 1 at ports of their own."""
    (work / "toy").mkdir(exist_ok=True)
    (work / "pretrain").mkdir(exist_ok=True)
    return {
        "toy": submit_job(cluster, work / "toy", "--train-iters", "3", PP="2", TRAIN_ITERS="7",
                          TRAIN_SCRIPT=str(TOY_SCRIPT), MASTER_PORT="29511"),
        "pretrain": submit_job(cluster, work / "pretrain", PP="2", TRAIN_ITERS="5", SCHEDULE="zb-h1", LR="1e-3"),
    }


def wait_job(job: Job, timeout_s: float) -> tuple:
    """Polls every 0.5 s until the job ends (cancelled after `timeout_s`); returns (state, exit code, output)."""
    deadline = time.monotonic() + timeout_s
    state = job_state(job.job_id, job.env)
    while state.get("JobState") not in FINAL_JOB_STATES:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job.job_id], env=job.env, timeout=10)
            pytest.fail(f"job {job.job_id} still {state.get('JobState')} after {timeout_s} s:\n"
                        + (job.output.read_text() if job.output.exists() else "(no output)"))
        time.sleep(0.5)
        state = job_state(job.job_id, job.env)
    return state["JobState"], state.get("ExitCode"), job.output.read_text() if job.output.exists() else ""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> tuple[Cluster, dict[str, Job]]:
    """The cluster and both jobs on it (a cluster that does not start fails each test, with the script's output);
    the cluster is stopped afterwards, whatever happened."""
    reason = cannot_run_slurm()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("slurm")
    try:
        cluster = start_cluster()
        yield cluster, ({} if cluster.failure else submit_both_jobs(cluster, work))
    finally:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], capture_output=True, timeout=60)


def _job(jobs: tuple[Cluster, dict[str, Job]], name: str) -> Job:
    cluster, submitted = jobs
    if cluster.failure:
        pytest.fail(cluster.failure, pytrace=False)
    return submitted[name]


def rank_outputs(tmp_path: Path) -> str:
    """What every rank printed, from torchrun's per-rank logs (--log-dir): its --tee copy in the job's output can
    miss a rank's last lines (torchrun stops tailing the logs when the rank exits)."""
    return "\n".join(path.read_text() for path in sorted((tmp_path / "logs").rglob("stdout.log")))


def test_launcher_starts_one_rank_per_node_and_passes_arguments_through_sbatch(jobs):
    toy = _job(jobs, "toy")
    state, exit_code, output = wait_job(toy, 120)
    assert (state, exit_code) == ("COMPLETED", "0:0"), output
    printed = rank_outputs(toy.work)
    losses = re.findall(r"iteration (\d+)/3 \| lm loss: (\S+) \| hosts: (\S+)", printed)
    assert [int(i) for i, _, _ in losses] == [1, 2, 3], output + printed
    assert {hosts for _, _, hosts in losses} == {"mzb-n1,mzb-n2"}  # rank 0 on node 1, rank 1 on node 2


def test_pretrain_gpt_pipeline_across_two_nodes_logs_every_iteration(jobs):
    pretrain = _job(jobs, "pretrain")
    state, exit_code, output = wait_job(pretrain, 240)
    assert (state, exit_code) == ("COMPLETED", "0:0"), output
    printed = rank_outputs(pretrain.work)
    assert "using world size: 2" in printed and "pipeline-model-parallel size: 2" in printed, output + printed
    assert re.search(r"zero-bubble.*zb-h1", printed), "the zero-bubble schedule did not run:\n" + output + printed
    iterations = re.findall(r"iteration\s+(\d+)/\s*5 \|.*\| lm loss: ([0-9.E+-]+)", printed)
    assert [int(i) for i, _ in iterations] == [1, 2, 3, 4, 5], output + printed
    assert all(0 < float(loss) < 10 for _, loss in iterations)  # ln(128) = 4.85 at the start

