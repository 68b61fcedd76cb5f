"""Make megatron-core 0.16.1 run on a CPU-only machine (CI, laptops). On GPU it does nothing.

megatron-core hard-codes CUDA in a handful of places that the CPU tests and the CPU demo reach.
:func:`apply` patches exactly those, once per process, and only when
``torch.cuda.is_available()`` is False. Patched call sites (megatron-core 0.16.1):

1. ``tensor_parallel/random.py`` -- ``CudaRNGStatesTracker.add/fork`` read and write the CUDA RNG
   (``torch.cuda.get_rng_state``). We pre-install :class:`CpuRNGStatesTracker`, which keeps the
   named states (data-parallel / model-parallel / expert) as CPU generator states, so
   ``model_parallel_cuda_manual_seed`` and dropout under ``get_cuda_rng_tracker().fork()``
   work unchanged.
2. ``torch.cuda.current_device()`` -- called by utils.py (GlobalMemoryBuffer),
   rotary_pos_embedding.py, p2p_communication.py, param_and_grad_buffer.py,
   distrib_optimizer.py to pick a device: returns ``"cpu"``.
3. ``torch.cuda.synchronize()`` -- p2p_communication.py, dist_checkpointing
   filesystem_async.py: a no-op (CPU ops are synchronous).
4. ``device="cuda"`` tensor creation (pipeline schedules' token counters, optimizer found_inf /
   scale tensors, grad_scaler, clip_grads), ``tensor.cuda()`` (tied embeddings under PP,
   optimizer state reload) and ``tensor.type() == "torch.cuda.FloatTensor"`` asserts
   (optimizer.py, distrib_optimizer.py): a :class:`torch.overrides.TorchFunctionMode` that maps
   every CUDA device argument to CPU, turns ``.cuda()`` into identity, and reports CPU tensor
   types with their CUDA names. It costs roughly 2x step time on tiny models -- acceptable for
   tests; production runs on GPU where none of this is installed.
5. ``tensor_parallel/random.py`` -- activation recompute (``CheckpointFunction``, used by
   ``recompute: selective | full``) snapshots and restores ``_get_cuda_rng_state()`` /
   ``_set_cuda_rng_state()`` (``torch.cuda.random.get_rng_state``: "Torch not compiled with
   CUDA" on CPU) around the recomputed forward, next to the CPU RNG and the tracker states it
   also saves. On CPU there is no CUDA generator to keep in step: the getter returns an empty
   placeholder and the setter ignores it (the CPU RNG -- the one CPU dropout draws from -- and
   the :class:`CpuRNGStatesTracker` states are still saved and restored by megatron itself, so a
   recomputed dropout mask equals the original).
6. ``transformer/moe/token_dispatcher.py`` -- the all-to-all MoE dispatcher creates a class-wide
   ``torch.cuda.Stream()`` for its device-to-host copies of the token counts and enters it with
   ``torch.cuda.stream(...)``, comparing it with ``torch.cuda.current_stream()`` and syncing on
   ``record_event().synchronize()``; moe_utils.py ``record_stream(torch.cuda.current_stream())``
   (only for CUDA tensors). On CPU all of that is ordering of a single synchronous stream:
   :class:`_CpuStream` is one stand-in object for "the" stream (so current == side stream, no
   wait), ``torch.cuda.stream(s)`` is a null context, events synchronise trivially.
7. ``transformer/moe/token_dispatcher.py`` -- the all-to-all split sizes reach
   ``all_to_all_single`` through ``maybe_move_tensor_to_cpu(t, as_numpy=True)``, which converts
   only CUDA tensors; a CPU tensor stays a tensor and c10d's binding rejects it as split sizes.
   The dispatcher's reference to it is replaced by a version that also turns CPU tensors into
   numpy when ``as_numpy`` (what the GPU path hands to c10d).
8. ``tensor_parallel/mappings.py`` -- with expert tensor parallelism the dispatcher gathers /
   reduce-scatters tokens over the expert-TP group with UNEVEN split sizes
   (``_gather_along_first_dim(..., output_split_sizes)``: ``dist.all_gather`` into tensors of
   different sizes; ``_reduce_scatter_along_first_dim(..., input_split_sizes)``:
   ``dist.reduce_scatter`` of a list), which NCCL supports and gloo refuses ("invalid tensor
   size"). On CPU (gloo) the uneven branches become: all-gather of every shard zero-padded to the
   largest, then trimmed; all-reduce of the whole input, then this rank's slice. Same values
   (a sum over the same ranks); the even-split branches are untouched.

megatron-core bugs that bite on GPU as well (optimizer checkpointing, interleaved-pipeline p2p)
are worked around in :mod:`areal_mega.megatron.compat`, unconditionally; on a megatron-core
upgrade revisit both modules (this one's list of call sites above, compat's list of bugs).

Invariant: :func:`apply` is idempotent and must run on the thread that later calls megatron
(torch function modes are thread-local); ``areal_mega.megatron.parallel_state.init_model_parallel``
calls it for you.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

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
    """Maps CUDA device arguments to CPU for every torch call made under it (call site 4)."""

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
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """CPU stand-in for megatron's CudaRNGStatesTracker (call site 1).

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
    """Call site 6: the one "stream" of a CPU process (every op is already synchronous)."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":
        return self  # an event on a synchronous stream is complete: synchronize() is a no-op


_CPU_STREAM = _CpuStream()


def _patch_moe_streams() -> None:
    """Call site 6 (see the module doc)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CPU_STREAM
    from megatron.core.transformer.moe import token_dispatcher

    upstream = token_dispatcher.maybe_move_tensor_to_cpu

    def to_cpu(tensor, as_numpy=False, record_stream=False):  # call site 7
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _patch_uneven_tp_collectives() -> None:
    """Call site 8 (see the module doc)."""
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

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _patch_recompute_rng_state() -> None:
    """Call site 5: CUDA RNG snapshots of megatron's activation checkpointing, as no-ops."""
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
            torch.cuda.current_device = lambda: "cpu"  # call site 2
            torch.cuda.synchronize = lambda *a, **k: None  # call site 3
            install_rng_tracker()  # call site 1
            _patch_recompute_rng_state()  # call site 5
            _patch_moe_streams()  # call sites 6 and 7
            _patch_uneven_tp_collectives()  # call site 8
            _global_patched = True
        tid = threading.get_ident()
        if tid not in _applied_threads:
            # Entered for the rest of the thread's life on purpose: megatron creates CUDA
            # tensors from deep inside its schedules/optimizer, not from one call we could wrap.
            _CudaToCpuMode().__enter__()
            _applied_threads.add(tid)
    return True
