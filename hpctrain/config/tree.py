"""The configuration tree: ``Config``, one section dataclass per TOML table (their keys: ``*_keys.py``)."""
from dataclasses import dataclass, field

from hpctrain.config.model_keys import LoraConfig, ModelConfig
from hpctrain.config.moe_keys import MoeConfig
from hpctrain.config.parallel_keys import CommConfig, CompressionConfig, ParallelConfig
from hpctrain.config.train_keys import CheckpointConfig, DataConfig, MonitorConfig, OptimConfig, TrainConfig


@dataclass
class Config:
    """The whole run configuration, one attribute per TOML section."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
