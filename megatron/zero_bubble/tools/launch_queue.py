"""Part (f) of gpu_check: does a kernel that cannot start yet hold back later launches on another stream?

megatron-core asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or context parallelism before Blackwell. With one
hardware connection every stream's work enters the GPU through one in-order queue, so a kernel waiting for its
stream's predecessor holds back everything launched after it, on every stream (docs/gpu-check.md, part (f)).

The measurement, per repetition: on stream A a long `torch.cuda._sleep` and then a second kernel (which cannot start
before the sleep ends), then a short kernel on stream B. A CUDA event times B's end from the start of A's sleep; less
the host's time from launching A's sleep to launching B, that is B's time from its launch to its end. B's own start
event sits in the same queue behind A's second kernel, so B's start-to-end alone does not show the wait.

The variable is read when CUDA initialises, so each setting needs a process of its own: gpu_check starts this module
once per setting with the variable in its environment, and reads the one line `RESULT <json>` it prints:
    CUDA_DEVICE_MAX_CONNECTIONS=1 python -m megatron.zero_bubble.tools.launch_queue [--reps N] [--sleep-ms MS]
`--cpu-stand-in` runs the same steps with threads and time.sleep instead of streams and kernels: CPU threads have no
launch queue, so it tests the child processes and the reading of their results, and says nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

CONNECTIONS_VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
RESULT_PREFIX = "RESULT "
CALIBRATION_CYCLES = 10_000_000  # GPU clock cycles of the sleep that measures the clock
STAND_IN_LABEL = "CPU stand-in (threads and time.sleep, no launch queue)"


def read_result(stdout: str) -> dict | None:
    """The child's result from its output, None when it printed none."""
    line = next((line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)), None)
    return json.loads(line[len(RESULT_PREFIX):]) if line is not None else None


def launch_to_end_ms(result: dict) -> list[float]:
    """Per repetition, B's time from its launch to its end: its end (from the start of A's sleep) less the host's
    time between launching A's sleep and launching B."""
    return [b_end - gap for b_end, gap in zip(result["b_end_ms"], result["launch_gap_ms"])]


def waited(result: dict) -> list[bool]:
    """Per repetition: was B, from its launch, longer than half of A's sleep and second kernel? Without a wait B ends
    within microseconds of its launch; behind A's second kernel it ends with the sleep."""
    return [b > a / 2 for a, b in zip(result["a_ms"], launch_to_end_ms(result))]


# -- on a GPU ------------------------------------------------------------------------------------------------------
def measure_on_gpu(reps: int, sleep_ms: float) -> dict:
    import torch

    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    tensors = (torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"))
    cycles = _sleep_cycles(torch, sleep_ms)
    _gpu_round(torch, streams, tensors, cycles)  # loads the kernels before anything is timed
    rounds = [_gpu_round(torch, streams, tensors, cycles) for _ in range(reps)]
    return {"device": torch.cuda.get_device_name(0), "stand_in": False, **_columns(rounds)}


def _sleep_cycles(torch, sleep_ms: float) -> int:
    """Clock cycles of `torch.cuda._sleep` that last about `sleep_ms` on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(CALIBRATION_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return int(CALIBRATION_CYCLES * sleep_ms / start.elapsed_time(end))


def _gpu_round(torch, streams: tuple, tensors: tuple, cycles: int) -> dict:
    """One repetition: A's sleep and second kernel, then B's short kernel; times in ms from the start of A's sleep."""
    stream_a, stream_b = streams
    a_start, a_end, b_start, b_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    torch.cuda.synchronize()
    host_start = time.perf_counter()
    a_start.record(stream_a)
    with torch.cuda.stream(stream_a):
        torch.cuda._sleep(cycles)
        tensors[0].add_(1)  # A's second kernel: cannot start before the sleep ends
    a_end.record(stream_a)
    b_launch = time.perf_counter()
    b_start.record(stream_b)
    with torch.cuda.stream(stream_b):
        tensors[1].add_(1)
    b_end.record(stream_b)
    torch.cuda.synchronize()
    return {"a_ms": a_start.elapsed_time(a_end), "b_end_ms": a_start.elapsed_time(b_end),
            "launch_gap_ms": (b_launch - host_start) * 1000, "b_ms": b_start.elapsed_time(b_end)}


# -- the CPU stand-in ----------------------------------------------------------------------------------------------
def measure_stand_in(reps: int, sleep_ms: float) -> dict:
    rounds = [_stand_in_round(sleep_ms) for _ in range(reps)]
    return {"device": STAND_IN_LABEL, "stand_in": True, **_columns(rounds)}


def _stand_in_round(sleep_ms: float) -> dict:
    """A thread plays stream A (a sleep, then a short step), this thread plays stream B (a short step); times in ms
    from A's start."""
    start = time.perf_counter()
    a_done = {}

    def stream_a() -> None:
        time.sleep(sleep_ms / 1000)
        _short_step()
        a_done["at"] = time.perf_counter()

    thread_a = threading.Thread(target=stream_a)
    thread_a.start()
    b_start = time.perf_counter()
    _short_step()
    b_end = time.perf_counter()
    thread_a.join()
    return {"a_ms": (a_done["at"] - start) * 1000, "b_end_ms": (b_end - start) * 1000,
            "launch_gap_ms": (b_start - start) * 1000, "b_ms": (b_end - b_start) * 1000}


def _short_step() -> int:
    """The stand-in's short kernel: a few microseconds of Python."""
    return sum(range(100))


def _columns(rounds: list[dict]) -> dict:
    """The repetitions' times as one list per measure, and the variable as this process saw it."""
    columns = {key: [r[key] for r in rounds] for key in ("a_ms", "b_end_ms", "launch_gap_ms", "b_ms")}
    return {"connections": os.environ.get(CONNECTIONS_VARIABLE), **columns}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="repetitions (default %(default)s)")
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="length of A's sleep (default %(default)s)")
    parser.add_argument("--cpu-stand-in", action="store_true", help="threads and time.sleep: tests the plumbing only")
    args = parser.parse_args(argv)
    measure = measure_stand_in if args.cpu_stand_in else measure_on_gpu
    result = {"sleep_ms": args.sleep_ms, **measure(args.reps, args.sleep_ms)}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
