"""Each rank's program as the runtime runs it: as JSON (what a person reads when a run hangs, what an outside checker
reads), and timed on the model of NCCL and CUDA (nccl_model.py).

A program is the rank's compute passes in order with what it posts between them (comm.lower). `program_json` writes
it per rank as a list of items:
- a warm-up, first: {"warmup": [{"group": "pipeline", "peer": 1}, ...]}, a first exchange with every peer at once,
  made by the first call, before any other message;
- a batch: {"batch": [POST, ...], "group": "pipeline"}, sends and receives posted together (one NCCL kernel), where
  POST is {"post": "send" | "recv", "message": MESSAGE, "peer": rank};
- a compute pass: {"compute": "F", "mb": 0, "chunk": 0, "waits_for": MESSAGE or null, "waits_for_send": MESSAGE or
  null}: the message it consumes, and for a backward the send of its forward's output, which must complete first;
where MESSAGE is {"kind": "act" | "grad" | "valid" | "stats", "mb", "from_stage", "to_stage", "from_rank", "to_rank"}
(virtual stages and pipeline ranks). Groups are named alike on both ends. `programs_from_json` reads it back.
"""
from __future__ import annotations

from .comm import Action, Batch, Message, Recv, Send, Warmup, consumed, output_send
from .costs import Costs
from .nccl_model import replay
from .ops import Kind
from .schedule import Pass, Schedule
from .simulate import Timeline

# What the exported programs assume of the transport (key "transport" of `zb-schedule export --program`).
TRANSPORT = {
    "groups": "every message on megatron's pipeline group, named 'pipeline' on both ends",
    "posting": "what a rank posts between two compute passes goes out as one batch (batch_isend_irecv), after a "
               "warm-up of every link at the head of the first call",
    "proven_on": "one in-order stream per communicator, rendezvous, a batch as one kernel, NCCL waiting for the "
                 "compute posted before it, the first use of a link blocking the host, one launch queue per GPU",
}


def message_json(msg: Message) -> dict:
    return {"kind": str(msg.kind), "mb": msg.mb, "from_stage": msg.src_stage, "to_stage": msg.dst_stage,
            "from_rank": msg.src, "to_rank": msg.dst}


def message_of(data: dict) -> Message:
    return Message(Kind(data["kind"]), data["mb"], data["from_stage"], data["to_stage"], data["from_rank"],
                   data["to_rank"])


def _post_json(post: Send | Recv) -> dict:
    msg = post.msg
    is_send = type(post) is Send
    return {"post": "send" if is_send else "recv", "message": message_json(msg),
            "peer": msg.dst if is_send else msg.src}


def item_json(schedule: Schedule, rank: int, item: Action) -> dict:
    if isinstance(item, Warmup):
        return {"warmup": [{"group": item.group, "peer": peer} for peer in item.peers]}
    if isinstance(item, Batch):
        return {"batch": [_post_json(post) for post in item.ops], "group": item.group}
    need, sent = consumed(schedule, rank, item), output_send(schedule, rank, item)
    return {"compute": str(item.op), "mb": item.mb, "chunk": item.chunk,
            "waits_for": None if need is None else message_json(need),
            "waits_for_send": None if sent is None else message_json(sent)}


def program_json(schedule: Schedule, programs: list[list[Action]]) -> list[list[dict]]:
    return [[item_json(schedule, rank, item) for item in program] for rank, program in enumerate(programs)]


def _item_of(entry: dict) -> Action:
    if "warmup" in entry:
        links = entry["warmup"]
        groups = {link["group"] for link in links}
        if len(groups) != 1:
            raise ValueError(f"a warm-up names one group, not {sorted(groups)}")
        return Warmup([link["peer"] for link in links], groups.pop())
    if "batch" in entry:
        posts = [(Send if post["post"] == "send" else Recv)(message_of(post["message"])) for post in entry["batch"]]
        return Batch(posts, entry["group"])
    return Pass(entry["compute"], entry["mb"], entry["chunk"])


def programs_from_json(data: list[list[dict]]) -> list[list[Action]]:
    """The programs of `program_json`."""
    return [[_item_of(entry) for entry in program] for program in data]


def simulate_program(schedule: Schedule, programs: list[list[Action]], costs: Costs) -> Timeline:
    """The timeline of the programs on the model of NCCL and CUDA; ScheduleError when they cannot run to their end."""
    return replay(schedule, programs, costs)
