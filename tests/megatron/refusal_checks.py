"""The start-up checks of pretrain_gpt.py for many command lines in one process (tests/megatron/test_pretrain_refusals.py).

    python tests/megatron/refusal_checks.py CASES.json

For each case (flags, world size): the one-line refusal of the start-up checks, or null (line REFUSALS); how the
early parser declares megatron's flags against megatron's parser (EARLY_FLAGS); the `--help` text (HELP); how a bare
assert of megatron's argument validation stops the start-up (MEGATRON_ASSERT). Each a JSON line on stdout.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_up_refusals(cases: dict, directory) -> dict:
    """The parent's side: `cases` {label: (flags, world size)} through this script in a process of its own (written
    to `directory`); {label: the one-line refusal, or None}."""
    import subprocess

    from tests.launching import launch_environment

    path = os.path.join(str(directory), "start-up-cases.json")
    with open(path, "w") as f:
        json.dump(cases, f)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), path], cwd=REPO, env=launch_environment(),
                          capture_output=True, text=True, timeout=600)
    line = next((line for line in done.stdout.splitlines() if line.startswith("REFUSALS ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("REFUSALS "):])


def check_refusals(cases_path: str) -> None:
    """For each case (flags, world size): the one-line refusal of the start-up checks, or null."""
    sys.path.insert(0, REPO)
    from megatron.zero_bubble.training.setup import prepare_process

    prepare_process()
    from megatron.training.arguments import parse_args

    from megatron.zero_bubble.training import arguments

    results = {}
    for label, (flags, world_size) in json.load(open(cases_path)).items():
        sys.argv = ["pretrain_gpt.py", *flags]
        os.environ["WORLD_SIZE"] = str(world_size)
        try:
            arguments.check(parse_args(arguments.add_arguments), flags)
            results[label] = None
        except arguments.StartupRefusal as refusal:
            results[label] = str(refusal)
    print("REFUSALS " + json.dumps(results))
    # the megatron flags the early checks parse before megatron is imported, as megatron's parser declares them
    parsers = []
    sys.argv = ["pretrain_gpt.py"]
    parse_args(lambda parser: parsers.append(parser) or arguments.add_arguments(parser))
    theirs = {flag: action for action in parsers[0]._actions for flag in action.option_strings}
    ours = {flag: action for action in arguments.early_parser()._actions for flag in action.option_strings}

    def declared(action):
        return None if action is None else [type(action).__name__, action.dest, action.nargs, action.const,
                                            action.default, getattr(action.type, "__name__", action.type)]

    print("EARLY_FLAGS " + json.dumps({flag: [declared(action), declared(theirs.get(flag))]
                                       for flag, action in ours.items()}))
    # `pretrain_gpt.py --help`: megatron's parser with our flags, printed as argparse prints it, then exit 0
    sys.argv, text = ["pretrain_gpt.py", "--help"], io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            parse_args(arguments.add_arguments)
            status = None
        except SystemExit as exit_:
            status = exit_.code
    print("HELP " + json.dumps({"status": status, "text": text.getvalue()}))
    print("MEGATRON_ASSERT " + json.dumps(_megatron_assert()))


def _megatron_assert() -> dict:
    """A flag combination megatron's own validation refuses with a bare assert (--save without --save-interval),
    through the start-up's parse_and_validate on one rank: its exit status and what it printed."""
    from megatron.zero_bubble.training import arguments

    sys.argv = ["pretrain_gpt.py", *("--zero-bubble-cpu --num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
                                     "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 1 "
                                     "--train-iters 1 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 16 "
                                     "--mock-data --save /nonexistent-zb-test/ckpt").split()]
    os.environ.update(WORLD_SIZE="1", RANK="0")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            arguments.parse_and_validate()
            status = None
        except SystemExit as exit_:
            status = exit_.code
        except BaseException:  # a traceback is what the test rules out: show it
            traceback.print_exc()
            status = "raised"
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    check_refusals(sys.argv[1])
