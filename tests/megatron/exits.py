"""How a pretrain_gpt.py process ends: single launches run to their end, as users run them (test_clean_exit.py,
benchmarks/clean_exit.py).

    launch(work, schedule, ending="pretrain_gpt.py" | "megatron", lagging_worker=None) -> Launch
    build_lagging_worker(work) -> the fault injection's library (or None: no C compiler)

The flags are shaped like megatron's GPT-3 175B example (examples/gpt3/train_gpt3_175b_distributed.sh) shrunk to CPU
sizes: fp16 with a loss scale, clipping at 1.0, cosine decay with warm-up, Adam's betas, weight decay; PP=4, mock
data, a few iterations, an evaluation every 3 and at the end, a checkpoint (--save). `ending="megatron"` runs the
same `main()` but ends as megatron's own scripts do, the interpreter finishing with the process groups alive
(what pretrain_gpt.py did before training/teardown.py).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.launching import REPO, launch_environment, torchrun_command

# megatron's local layers: how a process ends is the point (TE's layers end the same way: clean_exit's TE launches
# are test_pretrain_gpt.py's, each of which fails on a group left alive)
GPT3_SHAPED = (
    "--zero-bubble-cpu --transformer-impl local --pipeline-model-parallel-size 4 "
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 6 "
    "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 "
    "--fp16 --initial-loss-scale 65536 --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --lr-warmup-fraction .001 "
    "--lr-decay-iters 430000 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 949,50,1 "
    "--log-interval 1 --eval-interval 3 --eval-iters 2 --save-interval 6"
).split()
SCHEDULES = {"1f1b": [], "zb-h1": ["--pipeline-schedule", "zb-h1"]}  # megatron's own 1F1B; ours through the runtime
LAGGING_WORKER = os.path.join(REPO, "benchmarks", "lagging_gloo_worker")
# The entry file of a launch that is not pretrain_gpt.py itself: with the lagging worker injected, its exit handler is
# registered first (so that it runs last); with megatron's ending, main() alone, then the interpreter ends. A file, not
# `-c`: megatron's checkpoint writer starts a process that imports the main module again, which must not train again.
ENTRY = '''import sys
sys.path[:0] = [{repo!r}, {lagging!r}]
if __name__ == "__main__":
    if {inject!r}:
        import release_at_exit  # noqa: F401
    sys.argv[0] = {entry!r}
    if {megatron_ending!r}:
        import pretrain_gpt
        pretrain_gpt.main()
    else:
        import runpy
        runpy.run_path({entry!r}, run_name="__main__")
'''
TERMINATE = "terminate called"
FINISHED = re.compile(r"validation loss at iteration 6 on test set")  # the last line a run that ended well prints


@dataclass
class Launch:
    returncode: int | None  # torchrun's (None: killed at the timeout)
    output: str  # stdout and stderr, every rank's
    seconds: float

    @property
    def clean(self) -> bool:
        """Exit status 0, and no rank aborted (std::terminate's line, a SIGABRT in torchrun's report)."""
        return self.returncode == 0 and not self.aborted

    @property
    def aborted(self) -> bool:
        return TERMINATE in self.output or "SIGABRT" in self.output

    @property
    def finished_training(self) -> bool:
        return bool(FINISHED.search(self.output))

    def summary(self) -> str:
        """One line: the exit status and what went wrong, if anything."""
        status = "timed out" if self.returncode is None else f"exit {self.returncode}"
        if self.clean:
            return status
        terminated = self.output.count(TERMINATE)
        signals = sorted(set(re.findall(r"exitcode\s*: (-?\d+)", self.output)))
        return (f"{status}, {terminated} x '{TERMINATE}', rank exit codes {signals}, "
                f"{'after' if self.finished_training else 'before'} the final evaluation")


def launch(work: str, schedule: str, ending: str = "pretrain_gpt.py", lagging_worker: str | None = None,
           timeout: float = 900) -> Launch:
    """One torchrun of 4 ranks of pretrain_gpt.py, its checkpoint under `work` (made afresh)."""
    save = os.path.join(work, "checkpoint")
    shutil.rmtree(save, ignore_errors=True)
    if ending not in ("pretrain_gpt.py", "megatron"):
        raise ValueError(f"ending: 'pretrain_gpt.py' or 'megatron', not {ending!r}")
    entry = os.path.join(REPO, "pretrain_gpt.py")
    env = launch_environment()
    if ending == "megatron" or lagging_worker is not None:
        wrapper = os.path.join(work, "entry.py")
        with open(wrapper, "w") as f:
            f.write(ENTRY.format(repo=REPO, lagging=LAGGING_WORKER, inject=lagging_worker is not None, entry=entry,
                                 megatron_ending=ending == "megatron"))
        entry = wrapper
    if lagging_worker is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [lagging_worker, env.get("LD_PRELOAD")]))
    command = torchrun_command(4, [entry, *GPT3_SHAPED, *SCHEDULES[schedule], "--save", save])
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, output = None, _text(expired.stdout) + _text(expired.stderr)
    shutil.rmtree(save, ignore_errors=True)
    return Launch(returncode, output, time.monotonic() - start)


def build_lagging_worker(work: str) -> str | None:
    """benchmarks/lagging_gloo_worker/lagging_gloo_worker.c built into `work`; None without a C compiler or off
    Linux (it stands in for a function of libtorch_cpu and for glibc's pthread_join)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        return None
    library = os.path.join(work, "lagging_gloo_worker.so")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", library,
                    os.path.join(LAGGING_WORKER, "lagging_gloo_worker.c"), "-ldl"], check=True)
    return library


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")
