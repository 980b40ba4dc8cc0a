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


# ---------------------------------------------------------------- examples/ through the launcher


def example_dry_run(name: str, *positional: str, **knobs: str) -> list:
    """What examples/NAME.sh alone passes to pretrain_gpt.py (its DRY_RUN), with the arguments and knobs given."""
    result = subprocess.run(["bash", str(REPO / "examples" / f"{name}.sh"), *positional],
                            env=clean_environment(DRY_RUN="1", **knobs),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    command = torchrun_command(result.stdout)
    return command[[Path(word).name for word in command].index("pretrain_gpt.py") + 1:]


def launched_arguments(output: str) -> list:
    command = torchrun_command(output)
    return command[[Path(word).name for word in command].index("pretrain_gpt.py") + 1:]


def test_dry_run_launches_an_example_with_its_own_arguments_across_the_nodes():
    result = dry_run("--seed", "7", EXAMPLE="llama3_8b", NNODES="2", EXTRA_ARGS="--log-interval 10")
    assert result.returncode == 0, result.stderr
    flags = flag_values(torchrun_command(result.stdout))
    assert flags["--nnodes"] == "2" and flags["--nproc-per-node"] == "8"
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-endpoint"] == "localhost:29500"
    # the example saw the allocation's size (its description), and its arguments arrive unchanged, then ours
    assert "TP 1 x PP 4 x DP 4 on 16 processes; schedule zb-v" in result.stdout
    assert "world 16 = TP 1 x PP 4 x DP 4 (2 nodes x 8, nccl); schedule zb-v, micro batch 1, global batch 128" \
        in result.stdout
    assert launched_arguments(result.stdout) == example_dry_run("llama3_8b", NNODES="2", NPROC_PER_NODE="8") + [
        "--log-interval", "10", "--seed", "7"]


def test_dry_run_cpu_mode_runs_an_examples_tiny_mode_with_its_knobs_and_positional_arguments(tmp_path):
    result = dry_run(EXAMPLE=str(REPO / "examples" / "deepseek_moe.sh"), CPU="1", NNODES="2", NPROC_PER_NODE="2",
                     MLA="1", EXAMPLE_ARGS=f"{tmp_path}/ckpt")
    assert result.returncode == 0, result.stderr
    arguments = launched_arguments(result.stdout)
    assert arguments == example_dry_run("deepseek_moe", f"{tmp_path}/ckpt", TINY="1", MLA="1", NNODES="2",
                                        NPROC_PER_NODE="2")
    flags = flag_values(arguments)
    assert flags["--save"] == f"{tmp_path}/ckpt" and flags["--distributed-backend"] == "gloo"
    assert flags["--multi-latent-attention"] is True and "--transformer-impl" not in flags  # the script's own layers
    assert "world 4 = TP 1 x PP 2 x DP 2 (2 nodes x 2, gloo)" in result.stdout


def test_dry_run_an_arguments_file_written_by_an_example(tmp_path):
    path = tmp_path / "run.args"
    written = subprocess.run(["bash", str(REPO / "examples" / "gpt3_175b.sh")],
                             env=clean_environment(ARGS_FILE=str(path)), capture_output=True, text=True, timeout=30)
    assert written.returncode == 0, written.stderr
    result = dry_run(ARGS_FILE=str(path), NNODES="16")
    assert result.returncode == 0, result.stderr
    assert launched_arguments(result.stdout) == path.read_text().splitlines()
    assert "world 128 = TP 8 x PP 16 x DP 1 (16 nodes x 8, nccl); schedule zb-auto" in result.stdout
    assert dry_run(ARGS_FILE=str(path), NNODES="2").returncode != 0  # TP 8 x PP 16 needs 16 nodes of 8


@pytest.mark.parametrize("knobs, words", [
    ({"EXAMPLE": "llama3_8b", "MODEL": "1.5b"}, "MODEL has no effect with EXAMPLE=llama3_8b"),
    ({"EXAMPLE": "llama3_8b", "SCHEDULE": "zb-h1"}, "SCHEDULE has no effect with EXAMPLE=llama3_8b"),
    ({"ARGS_FILE": "/dev/null", "TP": "2"}, "TP has no effect with ARGS_FILE=/dev/null"),
    ({"EXAMPLE": "llama3_8b", "ARGS_FILE": "/dev/null"}, "set EXAMPLE or ARGS_FILE, not both"),
    ({"EXAMPLE": "llama4"}, "no such script; name one of examples/ (deepseek_moe gpt3_175b llama3_8b mixtral_8x7b)"),
    ({"ARGS_FILE": "/nonexistent/run.args"}, "ARGS_FILE=/nonexistent/run.args: no such file"),
    ({"EXAMPLE": "mixtral_8x7b", "CPU": "1", "NNODES": "2"}, "EP 2 does not divide the 1 data-parallel ranks"),
])
def test_dry_run_refuses_what_an_example_would_ignore_or_cannot_run(knobs, words):
    result = dry_run(**knobs)
    assert result.returncode != 0 and "torchrun command" not in result.stdout
    assert words in result.stderr


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
    preset = {} if "EXAMPLE" in knobs else {"MODEL": "tiny"}  # an example brings its own model
    env = clean_environment(**cluster.env, CPU="1", **preset, LOG_DIR=str(work / "logs"),
                            TORCHRUN=f"{sys.executable} -m torch.distributed.run", **knobs)
    output = work / "job.out"
    # --exclusive=user (over the script's --exclusive): the suite's two jobs share the two nodes, a core each
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--exclusive=user", f"--output={output}", "--time=10",
         str(SBATCH_SCRIPT), *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    return Job(job_id, env, output, work)


def submit_jobs(cluster: Cluster, work: Path) -> dict[str, Job]:
    """The jobs, submitted together: the cluster runs the first two side by side (each node has room for two ranks),
    so the second does not wait for the first's start-up; the third (an example's tiny mode, two ranks per node)
    starts when a core is free. The toy script stands in for megatron: it prints one loss line per iteration naming
    every rank's host, and honours the last --train-iters, here the positional one given to sbatch. Their torchruns
    meet on node 1 at ports of their own."""
    for name in ("toy", "pretrain", "example"):
        (work / name).mkdir(exist_ok=True)
    return {
        "toy": submit_job(cluster, work / "toy", "--train-iters", "3", PP="2", TRAIN_ITERS="7",
                          TRAIN_SCRIPT=str(TOY_SCRIPT), MASTER_PORT="29511"),
        "pretrain": submit_job(cluster, work / "pretrain", PP="2", TRAIN_ITERS="5", SCHEDULE="zb-h1", LR="1e-3"),
        "example": submit_job(cluster, work / "example", EXAMPLE="mixtral_8x7b", NPROC_PER_NODE="2", TRAIN_ITERS="4",
                              MASTER_PORT="29512"),
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
        yield cluster, ({} if cluster.failure else submit_jobs(cluster, work))
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


def test_an_examples_tiny_mode_runs_across_two_nodes_through_sbatch(jobs):
    """examples/mixtral_8x7b.sh's tiny mode (PP 2 x EP 2, 4 ranks, two per node) as EXAMPLE= with CPU=1 submits it,
    its TRAIN_ITERS knob passed through the submitting environment."""
    example = _job(jobs, "example")
    state, exit_code, output = wait_job(example, 600)
    assert (state, exit_code) == ("COMPLETED", "0:0"), output
    printed = rank_outputs(example.work)
    assert "mixtral_8x7b: Mixtral 8x7B (4 layers, 8 experts top-2, sequence 64) at CPU size; TP 1 x PP 2 x DP 2 " \
        "(EP 2) on 4 processes" in output
    assert "using world size: 4" in printed, output + printed
    assert re.search(r"expert_model_parallel_size \.+ 2\n", printed), output + printed
    assert re.search(r"zero-bubble: running zb-auto \(p=2, m=8\)", printed), output + printed
    iterations = re.findall(r"iteration\s+(\d+)/\s*4 \|.*\| lm loss: ([0-9.E+-]+) \| load_balancing_loss: ", printed)
    assert [int(i) for i, _ in iterations] == [1, 2, 3, 4], output + printed
    assert all(0 < float(loss) < 10 for _, loss in iterations)

