"""``deepspeed.runtime.zero.leaf_module_config``: ``zero_optimization.leaf_module`` - the modules ZeRO-3 treats
as leaves (gathered whole, no hooks inside), by class path, by name or by name suffix."""

from __future__ import annotations

from typing import List

from pydantic import Field, model_validator

from ..config_utils import DeepSpeedConfigModel

#: DeepSpeed's default leaf classes: the Mixture-of-Experts blocks of Hugging Face models whose experts run on
#: data-dependent routing (hooks inside them would gather differently on each rank).
DEFAULT_LEAF_MODULE_CLASSES: List[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: List[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: List[str] = []


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """``classes``, ``names``, ``name_suffixes``: each a list of strings (a single string is one entry; repeats are
    dropped)."""

    classes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @model_validator(mode="before")
    @classmethod
    def _as_lists(cls, values):
        if values is None:
            return {}
        if not isinstance(values, dict):
            raise TypeError("zero_optimization.leaf_module must be a mapping (classes / names / name_suffixes)")
        return {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                for k, v in values.items()}  # fmt: skip

    @model_validator(mode="after")
    def _unique(self):
        for key in ("classes", "names", "name_suffixes"):
            self.__dict__[key] = list(dict.fromkeys(str(e) for e in getattr(self, key)))
        return self
