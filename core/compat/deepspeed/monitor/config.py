"""``deepspeed.monitor.config``: the ``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet`` sections of a
DeepSpeed config, with DeepSpeed's fields and defaults; ``DeepSpeedMonitorConfig.enabled`` says whether any is on."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from ..runtime.config_utils import DeepSpeedConfigModel

SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet")


def get_monitor_config(param_dict: dict) -> "DeepSpeedMonitorConfig":
    """The four monitor sections of a config dict (an absent one takes its defaults)."""
    return DeepSpeedMonitorConfig(**{key: param_dict.get(key, {}) for key in SECTIONS})


class TensorBoardConfig(DeepSpeedConfigModel):
    """The ``tensorboard`` section: events under ``<output_path>/<job_name>``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(DeepSpeedConfigModel):
    """The ``wandb`` section: a run in ``project`` (``team`` is the wandb entity)."""

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CSVConfig(DeepSpeedConfigModel):
    """The ``csv_monitor`` section: one CSV file per metric under ``<output_path>/<job_name>``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CometConfig(DeepSpeedConfigModel):
    """The ``comet`` section: an experiment started with ``comet_ml.start``; a metric is logged again only after
    ``samples_log_interval`` more samples. The ``None`` fields are left to Comet's own configuration."""

    enabled: bool = False
    samples_log_interval: int = 100
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


class DeepSpeedMonitorConfig(DeepSpeedConfigModel):
    """The monitor sections together; ``enabled`` is true when any writer is."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)

    @model_validator(mode="after")
    def _any_enabled(self):
        self.__dict__["enabled"] = any(section.enabled for section in (self.tensorboard, self.wandb,
                                                                       self.csv_monitor, self.comet))  # fmt: skip
        return self
