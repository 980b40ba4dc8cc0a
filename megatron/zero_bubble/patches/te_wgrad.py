"""B/W split of Transformer Engine's modules through their own deferral (`delay_wgrad_compute`, `backward_dw()`).

TE's documented contract: a module built with `delay_wgrad_compute=True` computes only the input gradient in
backward and the caller runs `module.backward_dw()` later for the weight gradient. How TE's sources implement it
(`Linear`, `LayerNormLinear`, `LayerNormMLP`, `GroupedLinear`; 2.3 to 2.20, see `version_refusal`): each
module keeps a FIFO, `module.wgrad_store` (TE's `WeightGradStore`); when its `delay_wgrad_compute()` answers
True in backward, the module `put`s what the weight-gradient GEMM needs (the operands and the GEMM as a
function) and returns to autograd no weight gradient, TE's placeholder (`fuse_wgrad_accumulation` with megatron
DDP: `grad_added_to_main_grad` set), or (`GroupedLinear` without fusion) the buffer W will write into, not yet
written. `backward_dw()` pops one entry (`LayerNormMLP` two: fc2 then fc1), runs the GEMM (into `main_grad` when
fused, with the accumulate flag B decided), assigns `weight.grad` (not fused; 2.8+ always, before only where None; TE
issue #3437: it does not add) and `bias.grad` where it is still None (a bias gradient B formed, e.g. with FP8, stays;
with none there and none from the GEMM, `LayerNormMLP` fails in every release and the others before 2.20, TE issue
#3400), then runs the hooks given to `register_wgrad_accumulation_and_reduce_hooks` (2.7+). Popping an empty queue
raises "Pop empty queue";
`GroupedLinear.backward_dw` returns early on `wgrad_store.context.empty()`. `Linear` (2.16+) hands the queue to
its backward only if `delay_wgrad_compute()` answered True in the forward; the others read it in backward.

How the runtime uses it (`split_modules`, one call per model chunk): each TE module's `wgrad_store` is replaced by a
`ModuleWgradQueue` (restored by the returned PatchSet), which keeps TE's contract and answers `delay_wgrad_compute()`
per pass: True in a forward, True in backward only while the chunk's WeightGradStore runs a B pass, and while our W
runs `backward_dw()`; False otherwise, so a BW pass (or megatron's own schedule on the same layers) is TE's ordinary
fused backward. Every entry TE queues during a B pass becomes one work item in the chunk's WeightGradStore
(runtime/wgrad_store.py), filed under the microbatch like the local layers' work: running it calls the TE class's own
`backward_dw()` until that entry is popped, so each module's entries run in microbatch order. Then the gradients TE
assigned, summed over the entries of one B pass as autograd sums a module's uses in one backward, are accumulated
where megatron's fused backward puts them: with megatron DDP as DDP's hook does (into `main_grad`, unless TE
accumulated there already), otherwise as autograd does. Readiness for `--overlap-grad-reduce` goes the local layers'
way: the store reports each parameter after its last microbatch's work (megatron's `register_grad_ready`); during a B
pass megatron DDP's own hook for these parameters is kept quiet (it would find no gradient, or TE's placeholder, and
count it ready; under --overlap-grad-reduce it asserts a gradient). What a B pass leaves in their `.grad` is taken
out when the pass ends; a bias gradient formed in B is handed back to that entry's `backward_dw` (TE expects it
there; where megatron DDP's hook accumulated it during B already, a placeholder whose result is dropped), a
weight's (a placeholder, or GroupedLinear's unwritten buffer) is dropped.

The TE internals used beyond the documented option, and why: `module.wgrad_store` is replaced because the option
is fixed when megatron builds the module (megatron's own `--delay-wgrad-compute` needs its combined-1F1B
schedule), while zero bubble defers in B passes only, and because TE's store gives no notice of a `put`, which
must become W work of the microbatch as it is queued; the class's unbound `backward_dw` is called because
megatron's wrappers do nothing in theirs unless `--delay-wgrad-compute`; `.grad` is moved around B for the
bias rule above.

Versions (`version_refusal`): 2.3 to 2.20, whose sources were read (docs/transformer-engine.md says how, and what
changed between them); a later release is refused until its deferral is read; without gradient-accumulation fusion
2.8 on (before, `backward_dw` assigns `weight.grad` only where it is None).
Refused (PatchError, one line naming the module or parameter): a TE module with a Userbuffers option (see
`USERBUFFERS_IN_W`), and a parameter of a TE module that another module shares (tied): every B pass takes such a
parameter's `.grad` aside, which would drop the other user's gradient. Not split (their W stays in B, which is
exact): megatron's `TELMHeadColumnParallelLinear` (megatron keeps its W in B), TE modules with distributed weights
(megatron's `--tensor-parallel-num-weight-shards`: TE 2.19 and 2.20 finalize, i.e. reduce-scatter, such a gradient in
backward only, skipping or mishandling one it defers), and the TE modules whose parameters megatron runs through TE's
operation-based modules (`te.pytorch.ops`: `TEFusedMLP`, and `TEGroupedMLP` under
`--use-transformer-engine-op-fuser`), whose own forward never runs.
"""
from __future__ import annotations

import functools
import importlib.metadata
import sys
from collections import deque
from contextlib import contextmanager

import torch

from ..runtime.tensor_bytes import held_bytes, storages
from ._patching import PatchError, PatchSet

MIN_VERSION = "2.3"  # delay_wgrad_compute, backward_dw
MIN_VERSION_UNFUSED = "2.8"  # without main_grad fusion: backward_dw overwrites weight.grad
MAX_VERSION = "2.20"  # the newest release whose sources were read
VERSIONS_READ = f"transformer-engine {MIN_VERSION} to {MAX_VERSION}"
SPLIT_KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")  # in transformer_engine.pytorch
KEEP_IN_B = ("TELMHeadColumnParallelLinear",)  # megatron pins its deferral off (its backward_dw does nothing)
# TE's Userbuffers options (attributes of its modules, 2.3 to 2.20) under which a deferred W would read or write a
# Userbuffers buffer that later passes reuse. A split module with any Userbuffers option set is refused: the others
# (forward only, or the dgrad reduce-scatter) leave W's operands alone in TE's sources, but megatron sets them together
# with these and the split has never run with Userbuffers.
USERBUFFERS_IN_W = {
    "ub_overlap_ag_dgrad": "W would read grad_output from the Userbuffers buffer it was gathered into",
    "ub_overlap_ag": "W would read fc2's grad_output from the Userbuffers buffer it was gathered into",  # LayerNormMLP
    "ub_bulk_dgrad": "W would read its input from the Userbuffers buffer it was gathered into",
    "ub_bulk_wgrad": "W's GEMM would write into a Userbuffers buffer",
}
_DISTRIBUTIONS = ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu13",
                  "transformer-engine-cu12")


# -- versions ------------------------------------------------------------------------------------------
def installed_version() -> str | None:
    """Transformer Engine's version from the package metadata (no import: TE initialises CUDA), or None."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _minor(version: str) -> tuple | None:
    """(major, minor) of a version string (dev, post and local builds of a release count as it), None if unreadable."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return None


def _as_minor(version: str) -> tuple:
    return tuple(int(part) for part in version.split("."))


def version_refusal(version: str | None, fused_accumulation: bool) -> str | None:
    """Why this TE version cannot have its layers split into B and W (None: it can); `fused_accumulation`:
    megatron's --gradient-accumulation-fusion (TE accumulates into main_grad itself). Checked by major.minor:
    patch, post and local builds of a release whose sources were read are accepted."""
    if version is None:
        return "Transformer Engine is not installed"
    minor = _minor(version)
    if minor is None:
        return f"cannot read the transformer-engine version {version!r} (this split supports {VERSIONS_READ})"
    if minor > _as_minor(MAX_VERSION):
        return (f"transformer-engine {version} is newer than the releases this split was checked against "
                f"({VERSIONS_READ}): its weight-gradient deferral has not been read")
    if minor < _as_minor(MIN_VERSION):
        return (f"splitting Transformer Engine's layers into B and W needs {VERSIONS_READ} (delay_wgrad_compute "
                f"and backward_dw came in {MIN_VERSION}); {version} is installed")
    if not fused_accumulation and minor < _as_minor(MIN_VERSION_UNFUSED):
        return (f"splitting Transformer Engine's layers into B and W without --gradient-accumulation-fusion needs "
                f"transformer-engine {MIN_VERSION_UNFUSED} to {MAX_VERSION} (before {MIN_VERSION_UNFUSED}, "
                f"backward_dw assigns weight.grad only where it is None); {version} is installed")
    return None


def layer_types() -> tuple:
    """TE's module classes that defer (those of SPLIT_KINDS this TE has), if megatron imported TE; else ()."""
    te = sys.modules.get("transformer_engine.pytorch")
    return tuple(getattr(te, name) for name in SPLIT_KINDS if hasattr(te, name)) if te is not None else ()


# -- one module's queue ----------------------------------------------------------------------------------
class ModuleWgradQueue:
    """TE's WeightGradStore contract for one module, answering "defer?" per pass (see the module docstring).

    store: the chunk's runtime WeightGradStore; backward_dw: the TE class's own (unbound); held: (name, parameter)
    of the parameters whose gradient backward_dw may compute (weights and biases; a fused layer norm's come in B).

    TE's backward_dw computes a bias gradient only where `bias.grad` is None, and leaves one B produced (a bias the
    caller adds, or one B sums for FP8) for its hooks. So each B pass's own gradients of the held parameters are
    taken out of `.grad` when the pass ends (`end_b`), kept with the pass's first entry, and put back just for that
    entry's backward_dw: what TE then finds is what its own flow would (a weight's B "gradient" is only ever
    a placeholder, overwritten in W: dropped).

    What each backward_dw leaves in `.grad` is taken out too, and the gradients of all entries of one B pass are
    summed, in the order B queued them, before they are accumulated once when the pass's last entry has been popped:
    autograd sums the gradients of a module called twice in one backward before accumulating them, and TE's
    backward_dw assigns `.grad` instead of adding to it (TE issue #3437), so it must not be left to add them."""

    def __init__(self, module, name: str, store, backward_dw, held: list):
        self.module, self.name, self.store = module, name, store
        self._backward_dw = backward_dw
        self.held = tuple(param for _, param in held)
        self._biases = {id(param) for n, param in held if "bias" in n}
        self.cost = sum(p.numel() for p in self.held)
        self.enabled = True
        self._entries: deque = deque()
        self.puts = self.pops = 0  # entries ever queued and popped: work item n waits for pops > n
        self._draining = False
        self._outside_b: dict = {}  # .grad of the held parameters from before the B pass now running
        self._first_of_b = 0  # puts when the B pass now running began
        self._b_grads: dict[int, dict] = {}  # first entry of a B pass -> that pass's bias gradients
        self._pass_ends: deque = deque()  # one past the last entry of each B pass whose W has not finished
        self._summed: dict = {}  # the gradients backward_dw gave so far for the entries of the oldest such pass
        self._formed_in_b: set = set()  # ids of the biases whose gradient the B pass now running formed
        self._b_hooks: list = []

    # TE's contract (what its modules call)
    def delay_wgrad_compute(self) -> bool:
        # a forward (grad mode on) keeps the queue reachable; a backward defers only inside a B pass
        return self.enabled and (self._draining or self.store.active or torch.is_grad_enabled())

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False

    @property
    def context(self):  # TE's GroupedLinear.backward_dw reads wgrad_store.context.empty()
        return self

    def empty(self) -> bool:
        return not self._entries

    def qsize(self) -> int:
        return len(self._entries)

    def put(self, tensor_list, func) -> None:
        if not self.store.active:
            raise RuntimeError(f"{self.name}: Transformer Engine deferred a weight gradient outside a B pass of "
                               f"WeightGradStore {self.store.name!r}")
        self._entries.append((tensor_list, func))
        self.puts += 1
        # what the entry keeps alive (M_W), by storage (TE's grouped and quantized operands are no plain tensors):
        # not the parameters or the gradient buffers it accumulates into (GroupedLinear's fused W)
        own = storages([(p, getattr(p, "main_grad", None)) for p in self.held])
        self.store.defer(TEModuleWeightGrad(self, self.puts - 1, held_bytes(tensor_list, own)))

    def pop(self):
        if not self._entries:
            raise RuntimeError(f"Pop empty queue ({self.name})")
        tensor_list, func = self._entries.popleft()
        self.pops += 1
        return func(*tensor_list), tensor_list

    def assert_empty(self) -> None:
        assert not self._entries, f"Queue is not empty ({self.name}: {len(self._entries)} entries)"

    # the runtime's side: B passes
    def begin_b(self) -> None:
        self._first_of_b = self.puts
        self._outside_b = {p: p.grad for p in self.held}
        for p in self.held:
            p.grad = None
        # noted as autograd hands it over: megatron DDP's hook may accumulate it (and empty .grad) before B ends
        self._formed_in_b.clear()
        self._b_hooks = [p.register_hook(functools.partial(_note_formed, self._formed_in_b, p))
                         for p in self.held if id(p) in self._biases]

    def end_b(self) -> None:
        for hook in self._b_hooks:
            hook.remove()
        self._b_hooks = []
        produced = {p: p.grad for p in self.held if p.grad is not None and id(p) in self._biases}
        # accumulated already, but TE's LayerNormMLP.backward_dw needs one in .grad: a placeholder, dropped after it
        consumed = {p: _ACCUMULATED for p in self.held if id(p) in self._formed_in_b and p not in produced}
        for p in self.held:
            p.grad = self._outside_b.pop(p)
        if self.puts > self._first_of_b:
            self._pass_ends.append(self.puts)
            if produced or consumed:
                self._b_grads[self._first_of_b] = {**produced, **consumed}
        else:  # no W entry will come for them: accumulate as B would have
            for p, grad in produced.items():
                _accumulate(p, grad)

    # the runtime's side: W
    def run_through(self, entry: int) -> None:
        """TE's backward_dw until queue entry number `entry` has been popped (FIFO: the older ones first)."""
        while self.pops <= entry:
            popped = self.pops
            self._backward_dw_once()
            if self.pops == popped:
                raise RuntimeError(f"{self.name}: backward_dw() popped nothing while entry {entry} of its queue was "
                                   f"pending (is its delay_wgrad_compute switched off?)")

    def _backward_dw_once(self) -> None:
        from_b = self._b_grads.pop(self.pops, {})
        kept = {p: p.grad for p in self.held}
        for p in self.held:
            given = from_b.get(p)
            p.grad = torch.zeros_like(p) if given is _ACCUMULATED else given
        self._draining = True
        try:
            with torch.no_grad():  # saved activations may require grad; W is not differentiated
                self._backward_dw(self.module)
        finally:
            self._draining = False
        for p in self.held:
            new, p.grad = p.grad, kept[p]
            if new is not None and from_b.get(p) is not _ACCUMULATED:
                self._summed[p] = new if p not in self._summed else self._summed[p] + new
        if self._pass_ends and self.pops >= self._pass_ends[0]:
            self._pass_ends.popleft()
            for p, grad in self._summed.items():
                _accumulate(p, grad)
            self._summed.clear()


_ACCUMULATED = object()  # a bias gradient B formed that megatron's hook accumulated in B already


def _note_formed(formed: set, param, grad):
    if grad is not None:  # autograd calls a leaf's hooks for an input the backward gave no gradient too
        formed.add(id(param))
    return grad


def _accumulate(param, grad) -> None:
    """Where megatron's fused backward puts a gradient: with megatron DDP what its hook does (into main_grad
    unless TE accumulated there already), otherwise what autograd does (the first is taken, later ones added)."""
    if getattr(param, "main_grad", None) is not None:
        if not getattr(param, "grad_added_to_main_grad", False):
            param.main_grad.add_(grad.data)
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class TEModuleWeightGrad:
    """W of one TE module for one queued entry (a runtime DeferredWork): pops through that entry."""

    __slots__ = ("queue", "entry", "nbytes", "weight", "params", "cost")

    def __init__(self, queue: ModuleWgradQueue, entry: int, nbytes: int):
        self.queue, self.entry, self.nbytes = queue, entry, nbytes
        self.weight, self.params, self.cost = queue.held[0], queue.held, queue.cost

    def __call__(self) -> None:
        self.queue.run_through(self.entry)


# -- a chunk ---------------------------------------------------------------------------------------------
def split_modules(module: torch.nn.Module, store, kinds: tuple, check_version: bool = True) -> tuple[list, PatchSet]:
    """Switch every splittable TE module of `module` (instances of `kinds`, see `splittable_layers`) to a
    ModuleWgradQueue feeding `store`; returns (the parameters whose gradients now come in W, the PatchSet whose
    restore() switches them back). check_version: refuse what the installed TE cannot do (off for a stand-in's
    kinds in tests)."""
    patches, queues = PatchSet(f"te_wgrad ({store.name})"), []
    if check_version:
        _check_version(module, kinds)
    layers = splittable_layers(module, kinds)
    _check_untied(module, layers)
    try:
        for name, layer, kind, held in layers:
            _check_switchable(layer, name, store)
            queue = ModuleWgradQueue(layer, name or type(layer).__name__, store, kind.backward_dw, held)
            patches.replace(layer, "wgrad_store", queue)
            queues.append(queue)
    except BaseException:
        patches.restore()
        raise
    held_all = [p for queue in queues for p in queue.held]
    if queues:
        store.around_b_passes(_b_pass_scope(queues, module if hasattr(module, "param_to_bucket_group") else None))
    return held_all, patches


def splittable_layers(module: torch.nn.Module, kinds: tuple) -> list:
    """(name, layer, TE class, held (name, parameter) pairs) of the TE modules of `module` whose weight gradients
    go to W: instances of `kinds` with trainable weights or biases (a fused norm's gradients come in B), except
    those whose W stays in B (the module docstring says which and why)."""
    bypassed = _run_through_te_ops(module)
    found = []
    for name, layer in module.named_modules():
        kind = next((k for k in kinds if isinstance(layer, k)), None)
        if kind is None or type(layer).__name__ in KEEP_IN_B or id(layer) in bypassed:
            continue
        held = [(n, p) for n, p in layer.named_parameters(recurse=False)
                if p.requires_grad and not n.startswith("layer_norm")]
        # TE's DistributedWeight protocol (2.19+; megatron's --tensor-parallel-num-weight-shards): TE finalizes
        # (reduce-scatters) such a weight's gradient only when it computes it in backward, never in backward_dw
        if held and not any(getattr(p, "is_distributed_weight", False) for _, p in held):
            found.append((name, layer, kind, held))
    return found


def _run_through_te_ops(module: torch.nn.Module) -> set:
    """ids of the modules whose parameters megatron runs through TE's operation-based modules instead of their
    own forward: the descendants of a module with megatron's `_fused_impl` (TEFusedMLP: the ops, built at the
    first forward, are kept in a tuple, out of the module tree) or `_with_fused_impl` set (TEGroupedMLP under
    --use-transformer-engine-op-fuser). Their queues would never be fed, while each B pass would take their
    parameters' gradients, which the ops compute in B, for a W that never comes."""
    bypassed: set = set()
    for candidate in module.modules():
        if hasattr(candidate, "_fused_impl") or getattr(candidate, "_with_fused_impl", False):
            bypassed.update(id(child) for child in candidate.modules() if child is not candidate)
    return bypassed


def _check_version(module, kinds: tuple) -> None:
    layers = [layer for layer in module.modules() if isinstance(layer, kinds)]
    if layers:
        reason = version_refusal(installed_version(), all(getattr(l, "fuse_wgrad_accumulation", False) for l in layers))
        if reason is not None:
            raise PatchError(reason)


def _check_switchable(layer, name: str, store) -> None:
    current = getattr(layer, "wgrad_store", _MISSING)
    if current is _MISSING or not hasattr(layer, "backward_dw"):
        raise PatchError(f"{name}: this Transformer Engine has no wgrad_store / backward_dw on "
                         f"{type(layer).__name__}; splitting its layers needs transformer-engine >= {MIN_VERSION}")
    if isinstance(current, ModuleWgradQueue):
        raise PatchError(f"{name} is already split into WeightGradStore {current.store.name!r}; a layer can belong "
                         f"to one model chunk only")
    _check_no_userbuffers(layer, name)


def userbuffers_options(layer) -> list[str]:
    """The Userbuffers options set on a TE module (its `ub_overlap_*` and `ub_bulk_*` attributes that are True)."""
    return sorted(option for option, value in vars(layer).items()
                  if option.startswith(("ub_overlap_", "ub_bulk_")) and value is True)


def _check_no_userbuffers(layer, name: str) -> None:
    options = userbuffers_options(layer)
    if options:
        option = next((o for o in options if o in USERBUFFERS_IN_W), options[0])
        why = USERBUFFERS_IN_W.get(option, "the split has never run with Userbuffers")
        raise PatchError(f"{name}: Transformer Engine's Userbuffers option {option} does not work with a schedule that "
                         f"splits the backward ({why}); build {name} without Userbuffers options (megatron: drop "
                         f"--tp-comm-overlap), or use a schedule that does not split it (--pipeline-schedule 1f1b)")


def _check_untied(module: torch.nn.Module, layers: list) -> None:
    """Refuse a parameter that a split TE module holds and another module shares (see the module docstring)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for _, _, _, held in layers:
        for _, param in held:
            shared = names.get(id(param), [])
            if len(shared) > 1:
                raise PatchError(f"{shared[0]} and {shared[1]} are one parameter (tied), and a schedule that splits "
                                 f"the backward sets a B pass's gradient of a Transformer Engine module's parameters "
                                 f"aside, which would drop the other use's; untie them, or use a schedule that does "
                                 f"not split the backward (--pipeline-schedule 1f1b)")


_MISSING = object()


def _b_pass_scope(queues: list, ddp):
    """What each B pass of a chunk with TE modules runs in: every queue's begin_b / end_b and, for a megatron DDP
    chunk, DDP's per-parameter hook skipping the held parameters (their gradients arrive in W, whose store reports
    them ready; the hook reads `param_to_bucket_group` when it fires, and would count a parameter ready without
    its gradient, or, under --overlap-grad-reduce, assert one)."""
    held = {p for queue in queues for p in queue.held}
    cache: dict = {}

    @contextmanager
    def scope():
        full = ddp.param_to_bucket_group if ddp is not None else None
        if ddp is not None:
            if cache.get("full") is not full:
                cache.update(full=full, quiet={p: g for p, g in full.items() if p not in held})
            ddp.param_to_bucket_group = cache["quiet"]
        for queue in queues:
            queue.begin_b()
        try:
            yield
        finally:
            if ddp is not None:
                ddp.param_to_bucket_group = full
            for queue in queues:
                queue.end_b()

    return scope
