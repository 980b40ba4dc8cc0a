"""pretrain_gpt.py's command line before megatron is imported: the flags users bring from other zero-bubble
implementations (accepted as ours, or refused in one line naming what to use), the automatic memory limit's
share, and the virtual-pipeline flags handed on to megatron. No megatron import, no process launched."""
from __future__ import annotations

import types

import pytest

from megatron.zero_bubble.training import arguments
from megatron.zero_bubble.training.checks import chosen_schedule
from megatron.zero_bubble.training.flags import SCHEDULE_ALIASES, UNSUPPORTED_FLAGS

MODEL = ["--zero-bubble-cpu", "--num-layers", "8", "--micro-batch-size", "2", "--global-batch-size", "16"]
PP4 = ["--pipeline-model-parallel-size", "4"]


def _refusal(flags: list[str], monkeypatch, world_size: int = 4) -> str | None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    try:
        arguments.check_early(MODEL + flags)
    except arguments.StartupRefusal as refusal:
        message = str(refusal)
        assert "\n" not in message
        return message
    return None


@pytest.mark.parametrize("flag", sorted(UNSUPPORTED_FLAGS))
def test_flags_of_other_implementations_without_a_counterpart_are_refused_naming_what_to_use(flag, monkeypatch):
    takes_value, why = UNSUPPORTED_FLAGS[flag]
    message = _refusal(PP4 + ["--enable-zero-bubble", flag, *(["2"] if takes_value else [])], monkeypatch)
    assert message == f"{flag}: {why}"
    assert "--" in why.split(";")[-1] or "drop the flag" in why  # the fix names a flag of ours (or says drop it)


@pytest.mark.parametrize("flag", sorted(SCHEDULE_ALIASES))
def test_megatron_deepspeeds_zb_h1_flags_run_our_exact_zb_h1(flag, monkeypatch):
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP4 + [flag])
    assert chosen_schedule(args) == ("zb-h1", flag)
    assert _refusal(PP4 + [flag], monkeypatch) is None
    message = _refusal(PP4 + [flag, "--pipeline-schedule", "zb-h2"], monkeypatch)
    assert message is not None and flag in message and "keep one of them" in message


def test_the_original_implementations_exact_match_flag_is_our_exact_rollback(monkeypatch):
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP4 + ["--enable-exactly-numeric-match"])
    assert args.zero_bubble_exact_rollback is True
    message = _refusal(PP4 + ["--enable-zero-bubble", "--enable-exactly-numeric-match"], monkeypatch)
    assert message is not None and "--enable-optimizer-post-validation" in message
    assert _refusal(PP4 + ["--enable-zero-bubble", "--enable-optimizer-post-validation",
                           "--enable-exactly-numeric-match"], monkeypatch) is None


@pytest.mark.parametrize("flags, words", [
    (["--zero-bubble-adaptive-memory-limit-percentile", "120"], "not a percentage"),
    (["--zero-bubble-adaptive-memory-limit-percentile", "80", "--zero-bubble-max-pending-backward", "4"],
     "the limit is given"),
    (["--zero-bubble-adaptive-memory-limit-percentile", "80"], "no effect without CUDA"),
])
def test_the_automatic_limits_share_of_device_memory_is_checked(flags, words, monkeypatch):
    message = _refusal(PP4 + ["--enable-zero-bubble", *flags], monkeypatch)
    assert message is not None and words in message and "--zero-bubble-adaptive-memory-limit-percentile" in message


def test_the_share_needs_a_runtime_schedule(monkeypatch):
    message = _refusal(PP4 + ["--zero-bubble-adaptive-memory-limit-percentile", "80"], monkeypatch)
    assert message is not None and "--zero-bubble-adaptive-memory-limit-percentile has no effect" in message


@pytest.mark.parametrize("flags, expected", [
    ([], {"num_virtual_stages_per_pipeline_rank": 2}),
    (["--num-layers-per-virtual-pipeline-stage", "1"], {}),  # megatron allows one of its three layout flags
    (["--num-virtual-stages-per-pipeline-rank", "2"], {}),
    (["--pipeline-model-parallel-layout", "Et|t|t|t|t|t|t|tL"], {}),
])
def test_a_v_schedules_two_chunks_are_handed_to_megatron_only_when_no_layout_flag_is_given(flags, expected):
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP4 + ["--zero-bubble-v-schedule", *flags])
    options = types.SimpleNamespace(schedule="zb-v")
    assert arguments.megatron_defaults(options, args) == expected


def test_megatrons_yaml_config_is_refused_with_a_zero_bubble_flag_it_would_drop(monkeypatch, tmp_path):
    """--yaml-cfg makes megatron replace every command-line flag by the file's: a zero-bubble flag beside it would be
    dropped unseen (--zero-bubble-cpu included). Without one, the run is megatron's own and the file megatron's to
    read."""
    config = tmp_path / "run.yaml"
    config.write_text("num_layers: 8\n")
    message = _refusal(PP4 + ["--yaml-cfg", str(config), "--pipeline-schedule", "zb-h1"], monkeypatch)
    assert message == ("--yaml-cfg makes megatron ignore the command line, --pipeline-schedule with it (its YAML "
                       "arguments replace every flag); pass megatron's flags on the command line instead of --yaml-cfg")
    from megatron.zero_bubble.training import early

    early._check_yaml([f for f in MODEL if f != "--zero-bubble-cpu"] + PP4 + ["--yaml-cfg", str(config)])


def test_the_memory_limit_takes_a_multiple_of_1f1bs_peak():
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP4 + ["--zero-bubble-max-pending-backward", "1.5x"])
    limit = args.zero_bubble_max_pending_backward
    assert limit.of_1f1b and limit.amount == 1.5 and limit.describe() == "1.5x 1F1B's peak"
    with pytest.raises(arguments.StartupRefusal, match="a multiple of 1F1B's peak such as 1x"):
        arguments.early_parser().parse_known_args(MODEL + PP4 + ["--zero-bubble-max-pending-backward", "0x"])


@pytest.mark.parametrize("flags, words", [
    ([], "--zero-bubble-output-layer-wgrad has no effect: no zero-bubble schedule is chosen"),
    (["--pipeline-schedule", "1f1b", "--enable-zb-runtime"],
     "--zero-bubble-output-layer-wgrad in-b places the output layer's weight gradient, which --pipeline-schedule 1f1b "
     "does not split from its backward"),
    (["--pipeline-schedule", "zb-h1"], None),
    (["--pipeline-schedule", "zb-auto"], None),
])
def test_where_the_output_layers_w_runs_is_a_split_schedules_choice(flags, words, monkeypatch):
    message = _refusal(PP4 + flags + ["--zero-bubble-output-layer-wgrad", "in-b"], monkeypatch)
    assert message == words if words is None else message.startswith(words)
