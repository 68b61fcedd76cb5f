"""Vision-language checkpoints trained text-only: the language model of a VL checkpoint, named
as the VL checkpoint names it, through a registered text family's adapter.

    class MyVLAdapter(VisionLanguageAdapter, MyTextAdapter):
        model_type = "my_vl"; architecture = "MyVLForConditionalGeneration"
        lm_prefixes = {"model.": "model.language_model.", "lm_head.": "lm_head."}
        frozen_prefixes = ("model.visual.",)

The text adapter's HF names (``model.*``, ``lm_head.weight``) are renamed by ``lm_prefixes``;
the configuration is the VL config's ``text_config`` (top-level keys checked against
``vl_keys``). The vision tower (``frozen_prefixes``) is not built, trained or synced (the
servers keep theirs); an HF export copies it unchanged from the source checkpoint. Families:
qwen3_5 / qwen3_5_moe (models/qwen3_5.py), kimi_k25 (models/moe_families.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from areal_mega.models.base import ModelAdapter, ModelArch, StagePlan
from areal_mega.models.qwen3 import _INERT


class VisionLanguageAdapter(ModelAdapter):
    """Mixin (first base) over a text family's adapter; see the module doc."""

    lm_prefixes: ClassVar[dict[str, str]] = {}
    """The text adapter's name prefix -> the VL checkpoint's (every text name starts with one)."""
    frozen_prefixes: ClassVar[tuple[str, ...]] = ()
    """Checkpoint tensors copied unchanged through an HF export (the vision tower, projector)."""
    vl_keys: ClassVar[frozenset[str]] = frozenset()
    """Top-level config keys besides ``text_config`` and the inert ones (refused otherwise)."""
    tie_default: ClassVar[bool | None] = None
    """``tie_word_embeddings`` when the VL config does not set it: None = the text_config's (else
    false); a bool = transformers' default for the VL config (its top-level key alone ties)."""

    def text_config(self, c: dict) -> dict:
        """The text family's config from the VL config ``c`` (checked key by key)."""
        for key in sorted(set(c) - self.vl_keys - _INERT - {"text_config"}):
            raise ValueError(f"{key}: config key not implemented by the {self.model_type} adapter")
        if not isinstance(c.get("text_config"), dict):
            raise ValueError(f"text_config: a {self.model_type} config needs its text_config")
        t = c["text_config"]
        tie = t.get("tie_word_embeddings", False) if self.tie_default is None else self.tie_default
        text = {**t, "model_type": self.model_type, "architectures": c.get("architectures"),
                "tie_word_embeddings": c.get("tie_word_embeddings", tie)}
        text.setdefault("dtype", c.get("dtype") or c.get("torch_dtype"))
        return text

    def parse_config(self, c: dict) -> ModelArch:
        return super().parse_config(self.text_config(c))

    def _vl_name(self, n: str) -> str:
        for text, vl in self.lm_prefixes.items():
            if n.startswith(text):
                return vl + n[len(text):]
        raise ValueError(f"{n}: not a name of the {self.model_type} language model")

    def _hf_shape(self, hf_name):
        for text, vl in self.lm_prefixes.items():
            if hf_name.startswith(vl):
                return super()._hf_shape(text + hf_name[len(vl):])
        return super()._hf_shape(hf_name)

    def plan(self, layout, **kw):
        out = []
        for sp in super().plan(layout, **kw):
            params = tuple(replace(p, hf_names=tuple(map(self._vl_name, p.hf_names))) for p in sp.params)
            by_name = {p.name: p for p in params}
            out.append(StagePlan(sp.stage, params, tuple(
                replace(t, name=self._vl_name(t.name), source=by_name[t.source.name]) for t in sp.tensors)))
        return out

    def frozen_hf_tensors(self, source_dir):
        if source_dir is None:
            raise ValueError(f"{self.model_type}: an HF export needs the source checkpoint (its vision tower is copied "
                             "from it); the checkpoint records none: pass --tokenizer-dir / source_dir")
        from areal_mega.models.hf_checkpoint import HFCheckpointReader

        r = HFCheckpointReader(source_dir)
        return {n: r.read(n) for n in r.names() if n.startswith(self.frozen_prefixes)}
