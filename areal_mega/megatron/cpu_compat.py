"""Make megatron-core run on a CPU-only machine (CI, laptops). On GPU it does nothing.

megatron-core hard-codes CUDA in a handful of places that the CPU tests and the CPU demo reach.
:func:`apply` patches exactly those, once per process, and only when ``torch.cuda.is_available()``
is False. Each patched call site is one :class:`~areal_mega.megatron.compat.Entry` in
:data:`ENTRIES` (symptom, megatron-core versions, the test that shows it), applied only where its
version range holds -- the same registry rules as :mod:`areal_mega.megatron.compat`, whose
entries (megatron bugs that bite on GPU too) apply on every device; revisit both on an upgrade.

Invariant: :func:`apply` is idempotent and must run on the thread that later calls megatron
(torch function modes are thread-local); ``areal_mega.megatron.parallel_state.init_model_parallel``
calls it for you.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from areal_mega.megatron.compat import Entry

ENTRIES: dict[int, Entry] = {
    1: Entry(
        "tensor_parallel/random.py CudaRNGStatesTracker.add/fork read and write the CUDA RNG "
        "(torch.cuda.get_rng_state: 'Torch not compiled with CUDA'). CpuRNGStatesTracker keeps the "
        "named states (data-parallel / model-parallel / expert) as CPU generator states",
        ">=0.16.1",
        "tests/test_megatron_model.py::test_logits_match_hf_every_layout",
    ),
    2: Entry(
        "torch.cuda.current_device() picks the device in utils.py (GlobalMemoryBuffer), "
        "rotary_pos_embedding.py, p2p_communication.py, param_and_grad_buffer.py, "
        "distrib_optimizer.py: returns 'cpu'",
        ">=0.16.1",
        "tests/test_megatron_model.py::test_logits_match_hf_every_layout",
    ),
    3: Entry(
        "torch.cuda.synchronize() in p2p_communication.py and dist_checkpointing "
        "filesystem_async.py: a no-op (CPU ops are synchronous)",
        ">=0.16.1",
        "tests/test_megatron_model.py::test_checkpoint_saved_tp2_loads_pp2",
    ),
    4: Entry(
        "device='cuda' tensor creation (schedules' token counters, optimizer found_inf / scale, "
        "grad_scaler, clip_grads), tensor.cuda() (tied embeddings under PP, optimizer state "
        "reload), tensor.type() == 'torch.cuda.FloatTensor' asserts (optimizer.py, "
        "distrib_optimizer.py): a TorchFunctionMode maps CUDA devices to CPU, .cuda() to identity "
        "and reports CPU tensor types by their CUDA names (about 2x step time on tiny models)",
        ">=0.16.1",
        "tests/test_engine.py::test_one_step_same_in_every_layout",
    ),
    5: Entry(
        "activation recompute (CheckpointFunction) snapshots _get_cuda_rng_state() / "
        "_set_cuda_rng_state() ('Torch not compiled with CUDA'): an empty placeholder and a no-op "
        "(the CPU RNG and the tracker states are still saved by megatron, so recomputed dropout "
        "masks equal the original)",
        ">=0.16.1",
        "tests/test_engine_sp.py::test_recompute_same_loss_and_grads_fewer_saved_bytes",
    ),
    6: Entry(
        "the all-to-all MoE dispatcher's class-wide torch.cuda.Stream() for device-to-host copies, "
        "torch.cuda.stream(...), current_stream(), record_event().synchronize(): one _CpuStream "
        "stand-in (current == side stream), a null stream context, trivially complete events",
        ">=0.16.1",
        "tests/test_megatron_moe.py::test_logprobs_match_hf_every_layout",
    ),
    7: Entry(
        "all-to-all split sizes reach all_to_all_single through maybe_move_tensor_to_cpu(t, "
        "as_numpy=True), which converts only CUDA tensors; c10d rejects a CPU tensor as split "
        "sizes: the dispatcher's reference converts CPU tensors to numpy too",
        ">=0.16.1",
        "tests/test_megatron_moe.py::test_logprobs_match_hf_every_layout",
    ),
    8: Entry(
        "expert tensor parallelism gathers / reduce-scatters tokens with UNEVEN split sizes "
        "(tensor_parallel/mappings.py), which gloo refuses ('invalid tensor size'): zero-padded "
        "all-gather then trim; all-reduce then this rank's slice (same sums)",
        ">=0.16.1",
        "tests/test_megatron_moe.py::test_logprobs_match_hf_every_layout",
    ),
    9: Entry(
        "torch.tensor(..., pin_memory=True) in rope_utils.get_pos_emb_on_this_cp_rank (YaRN's cos/sin "
        "cache under context parallelism, gpt-oss): 'pin_memory=True requires a CUDA or other "
        "accelerator backend': the mode drops pin_memory (no pinned allocator on CPU)",
        ">=0.16.1",
        "tests/test_gpt_oss.py::test_layouts_logprobs_match_hf",
    ),
}


_applied_threads: set[int] = set()
_lock = threading.Lock()
_global_patched = False


def needed() -> bool:
    """True when the compatibility layer applies (no usable CUDA device)."""
    return not torch.cuda.is_available()


def _to_cpu_device(dev):
    if isinstance(dev, torch.device):
        return torch.device("cpu") if dev.type == "cuda" else dev
    if isinstance(dev, str) and dev.startswith("cuda"):
        return "cpu"
    if isinstance(dev, int) and not isinstance(dev, bool):
        return "cpu"  # a CUDA ordinal, e.g. from a cached torch.cuda.current_device()
    return dev


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to CPU for every torch call made under it (entry 4)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # megatron asserts param.type() == "torch.cuda.FloatTensor" for fp32 master params.
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # entry 9
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """CPU stand-in for megatron's CudaRNGStatesTracker (entry 1).

    Same interface (reset/get_states/set_states/add/fork/is_initialized); each named state is a
    CPU generator state. ``fork(name)`` swaps the global CPU RNG to ``name``'s state for the block
    and stores the advanced state back, exactly as the CUDA tracker does with the CUDA RNG.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _CpuStream:
    """Entry 6: the one "stream" of a CPU process (every op is already synchronous)."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":
        return self  # an event on a synchronous stream is complete: synchronize() is a no-op


_CPU_STREAM = _CpuStream()


def _patch_moe_streams() -> None:
    """Entries 6 and 7 (see ENTRIES)."""
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if ENTRIES[6].applies():
        torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CPU_STREAM
    if not ENTRIES[7].applies():
        return

    upstream = token_dispatcher.maybe_move_tensor_to_cpu

    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _patch_uneven_tp_collectives() -> None:
    """Entry 8 (see ENTRIES)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(x) for x in output_split_sizes]
        big = max(sizes)
        pad = input_.new_zeros((big, *input_.shape[1:]))
        pad[: input_.shape[0]] = input_
        parts = [torch.empty_like(pad) for _ in sizes]
        dist.all_gather(parts, pad.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return list(torch.split(total, [int(x) for x in input_split_sizes], dim=0))[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


def install_rng_tracker() -> None:
    """Install a fresh :class:`CpuRNGStatesTracker` as megatron's global tracker."""
    from megatron.core.tensor_parallel import random as mrandom

    if not ENTRIES[1].applies():
        return
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _patch_recompute_rng_state() -> None:
    """Entry 5: CUDA RNG snapshots of megatron's activation checkpointing, as no-ops."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def apply() -> bool:
    """Install the CPU patches on this thread if CUDA is unavailable. Returns True if active."""
    global _global_patched
    if not needed():
        return False
    with _lock:
        if not _global_patched:
            if ENTRIES[2].applies():
                torch.cuda.current_device = lambda: "cpu"
            if ENTRIES[3].applies():
                torch.cuda.synchronize = lambda *a, **k: None
            install_rng_tracker()  # entry 1
            if ENTRIES[5].applies():
                _patch_recompute_rng_state()
            _patch_moe_streams()  # entries 6 and 7
            if ENTRIES[8].applies():
                _patch_uneven_tp_collectives()
            _global_patched = True
        tid = threading.get_ident()
        if tid not in _applied_threads and ENTRIES[4].applies():
            # Entered for the rest of the thread's life on purpose: megatron creates CUDA
            # tensors from deep inside its schedules/optimizer, not from one call we could wrap.
            _CudaToCpuMode().__enter__()
            _applied_threads.add(tid)
    return True
