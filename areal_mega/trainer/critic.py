"""The PPO critic: a megatron GPT trunk with a scalar value head, trained on GAE returns.

    critic = CriticEngine.create(cfg.critic, cfg.model_path, groups, hf_weights_dir=cfg.model_path, seed=cfg.seed)
    batch["values"] = critic.compute_values(batch)                  # [T], before advantages
    batch.update(compute_advantages(batch, cfg.algorithm))         # gae: advantages + returns
    stats = critic.train_batch(batch, PPOCriticLoss(cfg.algorithm, total_tokens=..., total_seqs=...))

The critic is the actor's GPTModel with the vocab-parallel output layer swapped for a replicated
``Linear(hidden, 1)`` (:class:`ValueHead`) on the last stage, so megatron's schedules, PP p2p and
the engine's micro-batching work unchanged; why that is exact under TP and SP, the head's init,
dtype and alignment: docs/engine.md ("The PPO critic and the reference model").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.model import MegatronModel
from areal_mega.batching.packing import last_token_mask
from areal_mega.megatron.context_parallel import gather_tokens
from areal_mega.megatron.model import build_model, load_hf_weights


@dataclass
class CriticConfig(MegatronEngineConfig):
    """The PPO critic's engine (built only when ``algorithm.needs_critic``, e.g. "gae"). Same keys
    as ``actor`` (``critic.model``, ``critic.optimizer``, ``critic.max_tokens_per_microbatch``,
    ...); the trunk starts from the experiment's ``model_path`` in the actor's layout."""

    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Adam and learning-rate schedule of the critic (its own, independent of the actor's)."""
    compute_entropy: bool = False
    """Unused by the critic (values have no entropy); kept False to skip the work."""
    value_head_init_std: float = 0.02
    """Std of the value head's initial weight (seeded by the experiment ``seed``; bias 0).
    0 starts every value at exactly 0."""

    def validate(self) -> None:
        super().validate()
        if self.value_head_init_std < 0:
            raise ValueError(f"value_head_init_std: must be >= 0, got {self.value_head_init_std}")


class ValueHead(torch.nn.Module):
    """Drop-in for GPTModel.output_layer: hidden [s, b, h] -> (values [s, b, 1] fp32, None).

    Replicated on every TP rank (see the module docstring for why that is exact)."""

    def __init__(self, hidden_size: int, *, init_std: float, seed: int, device: torch.device, dtype: torch.dtype,
                 sequence_parallel_group: Any = None):
        """``sequence_parallel_group``: the TP group when the trunk runs sequence parallel (the
        head then gathers the tokens first), None otherwise."""
        super().__init__()
        self._sp_group = sequence_parallel_group
        g = torch.Generator().manual_seed(seed)
        # Named weight/bias directly on the module (not a nested Linear): megatron's
        # LanguageModule.sharded_state_dict looks up "output_layer.weight" on the last stage.
        self.weight = torch.nn.Parameter((torch.randn(1, hidden_size, generator=g) * init_std).to(device, dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        self.sequence_parallel = False  # GPTModel reads this attribute of its output layer

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        # ``weight`` is the tied embedding megatron would pass to an LM head: not ours (untied).
        if self._sp_group is not None:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self._sp_group
            )
        return torch.nn.functional.linear(hidden_states.float(), self.weight.float(), self.bias.float()), None


def attach_value_head(model: MegatronModel, *, init_std: float, seed: int) -> None:
    """Turn ``model`` (HF weights already loaded) into a critic in place: untie embeddings on
    every chunk, replace the LM head of the last-stage chunk with a :class:`ValueHead`."""
    last = model.groups.is_last_stage
    for i, chunk in enumerate(model.chunks):
        chunk.share_embeddings_and_output_weights = False
        if last and i == len(model.chunks) - 1:
            assert chunk.post_process, "the last chunk of the last stage must own the output layer"
            p = next(chunk.parameters())
            sp_group = model.groups.tp if model.config.sequence_parallel else None
            chunk.output_layer = ValueHead(model.arch.hidden_size, init_std=init_std, seed=seed, device=p.device,
                                           dtype=p.dtype, sequence_parallel_group=sp_group)


class CriticEngine(MegatronTrainEngine):
    """A :class:`MegatronTrainEngine` whose per-token output is the value instead of
    (log-prob, entropy). ``train_batch(batch, loss_fn)`` calls ``loss_fn(values, zeros, mb)``,
    the signature :class:`areal_mega.algo.losses.PPOCriticLoss` takes; everything else (micro-batch
    plan, DP/PP gathering, optimizer, checkpoints) is the actor engine's, unchanged."""

    checkpoint_role = "critic"
    """Its checkpoints say so: they cannot be exported to HF or loaded as a policy."""

    @classmethod
    def create(  # type: ignore[override]
        cls, cfg: CriticConfig, hf_config: Any, groups: Any, hf_weights_dir: str | None = None, *, seed: int = 1
    ) -> "CriticEngine":

        cfg.validate()
        model = build_model(hf_config, groups, cfg.model)
        if hf_weights_dir is not None:
            load_hf_weights(model, hf_weights_dir)  # before the head swap: the adapter maps the LM head
        attach_value_head(model, init_std=cfg.value_head_init_std, seed=seed)
        critic = cls(cfg, model)
        critic.source_hf_dir = str(hf_weights_dir) if hf_weights_dir is not None else None  # checkpoint metadata
        return critic

    def _token_outputs(self, output: torch.Tensor, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
        """Last stage: values [1, T, 1] -> (values [T], zeros [T]), 0 at sequence ends (under
        context parallelism this CP rank's tokens, gathered back into row order)."""
        values = output[0, :, 0].float()
        shard = self._shard(mb, output)
        if shard is not None:
            values = gather_tokens(values, shard, self.groups.cp)
        ends = last_token_mask(mb["cu_seqlens"], values.numel())
        values = values.masked_fill(ends, 0.0)
        return values, torch.zeros_like(values)

    def compute_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """V per token, flat [T] fp32 on every rank (next-token aligned, 0 at sequence ends)."""
        return self.forward(batch, with_entropy=False)["logprobs"]  # the engine's per-token slot
